#!/usr/bin/env bash
# What scripts/gpu_check.sh needs on a GPU machine that has no network, fetched here into .gpu/
# (ignored; carried with the device call): Horovod 0.28.1's source archive, and the Python 3.12
# wheels missing from that machine's image (duckdb and perfetto for hvtrace; cffi and pycparser
# for Horovod). About 28 MB. A device run brings back the Horovod wheel it built (Release, for
# that machine's Python and PyTorch): copy it into .gpu/ and the next run installs it instead of
# building (about 110 s of device time saved).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
mkdir -p .gpu/wheels
"$PY" -m pip download -q --no-deps --no-binary :all: horovod==0.28.1 -d .gpu
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .gpu/wheels duckdb perfetto cffi pycparser
ls -la .gpu .gpu/wheels
du -sh .gpu
