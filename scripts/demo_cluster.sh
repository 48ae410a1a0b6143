#!/usr/bin/env bash
# The main job across hosts: 2 hosts made of namespaces (host 2's clock 7.3 s ahead), 2 ranks
# each, a real horovodrun --gloo over ssh, traced by hvtrace; then the analysis. Needs root.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN_DIR=${RUN_DIR:-runs/demo-cluster}
STEPS=${STEPS:-30}
OFFSET=${OFFSET:-7.3}
rm -rf "$RUN_DIR"
mkdir -p "$RUN_DIR"
trap 'bash scripts/cluster.sh down' EXIT
echo "== cluster: scripts/cluster.sh up --hosts 2 --clock-offset-s $OFFSET =="
bash scripts/cluster.sh up --hosts 2 --clock-offset-s "$OFFSET"
echo "== training: scripts/cluster.sh run --np 4 (horovodrun -H hvc1:2,hvc2:2 --gloo) =="
PATH="$PWD/.venv/bin:$PATH" bash scripts/cluster.sh run --np 4 -- \
  "$PWD/.venv/bin/python" -m hvtrace.examples.train --steps "$STEPS" --width 256 --trace-dir "$RUN_DIR"
echo
echo "== analysis: .venv/bin/hvtrace analyze $RUN_DIR =="
.venv/bin/hvtrace analyze "$RUN_DIR" --json "$RUN_DIR/report.json"
