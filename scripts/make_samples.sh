#!/usr/bin/env bash
# Regenerate sample_traces/ from real horovodrun --gloo runs of the built-in model, traced by
# hvtrace: a balanced 2-rank run, a 2-rank run with rank 1's forward slowed by 40 ms, and a
# 4-rank run with rank 2's input slowed by 30 ms. Small model so the files stay small.
# Each rank closes cleanly, so its stream is compacted into rank*.parquet (the committed samples
# predate that and are .arrows streams; both forms load, and the tests take either).
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"
OUT=sample_traces
COMMON=(--steps 40 --width 512 --layers 4 --batch-size 64)
run() {  # name np extra-args...
  local name=$1 np=$2; shift 2
  rm -rf "$OUT/$name"; mkdir -p "$OUT/$name"
  echo "== $name: horovodrun -np $np --gloo ... $*" >&2
  horovodrun -np "$np" -H "localhost:$np" --gloo \
    python -m hvtrace.examples.train "${COMMON[@]}" --trace-dir "$OUT/$name" "$@" >/dev/null
}
run balanced_2rank 2
run slow_rank1_forward_2rank 2 --slow-rank 1 --slow-ms 40 --slow-phase forward
run slow_rank2_input_4rank 4 --slow-rank 2 --slow-ms 30 --slow-phase input
ls -la "$OUT"/*/
