#!/usr/bin/env bash
# The main job: a real 2-rank Horovod (Gloo, CPU) training of the built-in MLP, traced by hvtrace,
# then what was recorded per rank and where the files are.
set -euo pipefail
cd "$(dirname "$0")/.."
NP=${NP:-2}
RUN_DIR=${RUN_DIR:-runs/demo}
STEPS=${STEPS:-40}
rm -rf "$RUN_DIR"
mkdir -p "$RUN_DIR"
echo "== training: horovodrun -np $NP -H localhost:$NP --gloo (built-in MLP, $STEPS steps) =="
PATH="$PWD/.venv/bin:$PATH" horovodrun -np "$NP" -H "localhost:$NP" --gloo \
  python -m hvtrace.examples.train --steps "$STEPS" --trace-dir "$RUN_DIR"
echo
echo "== recorded: .venv/bin/hvtrace info $RUN_DIR =="
.venv/bin/hvtrace info "$RUN_DIR"
echo
echo "== analysis: .venv/bin/hvtrace analyze $RUN_DIR -o $RUN_DIR/timeline.json.gz --json $RUN_DIR/report.json =="
.venv/bin/hvtrace analyze "$RUN_DIR" -o "$RUN_DIR/timeline.json.gz" --json "$RUN_DIR/report.json"
echo
echo "timeline for https://ui.perfetto.dev or chrome://tracing: $RUN_DIR/timeline.json.gz"
echo "dashboard: .venv/bin/hvtrace dashboard $RUN_DIR"
