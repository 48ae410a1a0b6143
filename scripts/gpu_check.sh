#!/usr/bin/env bash
# The CUDA path on a GPU machine (issue 38), from a bare start: builds Horovod 0.28.1 with NCCL
# (the NCCL of the machine's PyTorch wheel, the project's patches) and hvtrace's compiled hot path,
# then runs scripts/gpu_check.py (hvtrace's CUDA-event spans against CUPTI, host syncs traced vs
# untraced, the in-run A/B on ResNet-50 and on a short-step MLP) and probes two ranks on one GPU.
#
#   bash scripts/gpu_check.sh             on the GPU machine; needs .gpu/ (scripts/gpu_fetch.sh)
#   bash scripts/gpu_check.sh --dry-run   here: the same checks on the CPU with the Horovod and
#                                         venv already set up (make setup), no build, no .gpu/
#
# Everything lands in $OUT (default ./gpu-out): log.txt, summary.txt, results.json, build.log, one
# gc_MODEL.tar.gz per model (profile + hvtrace run: `python scripts/gpu_check.py --compare DIR`
# re-reads it here) and the built Horovod wheel (carry it in .gpu/ and a rerun skips the build).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu-out}
mkdir -p "$OUT"
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
exec > >(tee -a "$OUT/log.txt") 2>&1
T0=$(date +%s)
say() { echo "[gpu_check +$(($(date +%s) - T0))s] $*"; }

if [ "$DRY" = 1 ]; then
  PY=${PYTHON:-$ROOT/.venv/bin/python}
  say "dry run with $PY (no build: the Horovod already installed)"
  "$PY" -c "import horovod.torch as hvd, hvtrace; print('horovod', hvd.__name__, 'ok')" || exit 1
  PYTHONPATH=$ROOT "$PY" scripts/gpu_check.py --dry-run --out "$OUT"
  exit $?
fi

PY=${PYTHON:-python3}
SITE=/tmp/gc-site
mkdir -p "$SITE"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
  "$PY" -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.nccl.version())"
  nvcc --version | tail -2
  cmake --version | head -1
  nproc
} 2>&1 | sed 's/^/[env] /'

say "installing the carried wheels (.gpu/wheels)"
"$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" .gpu/wheels/*.whl || exit 1
export PYTHONPATH=$SITE:$ROOT

# NCCL as PyTorch's wheel has it: nvidia/nccl/{include,lib} in site-packages (libnccl.so.2 only,
# so a libnccl.so link for the linker)
read -r NCCL_INC NCCL_LIB < <("$PY" - <<'PY'
import glob, os, site, sys
roots = site.getsitepackages() + [os.path.dirname(os.path.dirname(__import__("torch").__file__))]
for r in roots:
    h = glob.glob(os.path.join(r, "nvidia", "nccl", "include", "nccl.h"))
    if h:
        inc = os.path.dirname(h[0])
        print(inc, os.path.join(os.path.dirname(inc), "lib"))
        sys.exit(0)
print("none none")
PY
)
say "NCCL: include $NCCL_INC, lib $NCCL_LIB"
[ -f "$NCCL_INC/nccl.h" ] || { say "no nccl.h beside PyTorch"; exit 1; }
mkdir -p /tmp/gc-nccl && ln -sf "$NCCL_LIB/libnccl.so.2" /tmp/gc-nccl/libnccl.so
export LD_LIBRARY_PATH=$NCCL_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc)")")}
export CUDA_HOME
PYINC=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
[ -f "$PYINC/Python.h" ] || say "WARNING: no Python.h in $PYINC (Horovod and the hot path need it)"

WHEEL=$(ls .gpu/horovod-0.28.1-*.whl 2>/dev/null | head -1)
if [ -z "$WHEEL" ]; then
  say "building Horovod 0.28.1 with NCCL on $(nproc) cores (log: build.log)"
  rm -rf /tmp/gc-hb && mkdir -p /tmp/gc-hb
  tar xzf .gpu/horovod-0.28.1.tar.gz -C /tmp/gc-hb
  SRC=/tmp/gc-hb/horovod-0.28.1
  sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$SRC/CMakeLists.txt" "$SRC/horovod/torch/CMakeLists.txt"
  # Release, not RelWithDebInfo: no debug info, so a faster build and a wheel small enough to
  # come back from the device (under 15 MB): copied into .gpu/, it spares the next run the build
  sed -i "s/else 'RelWithDebInfo'/else 'Release'/" "$SRC/setup.py"
  # GCC 13 (the GPU machine's) no longer brings these in through other headers
  sed -i 's/#include <mutex>/#include <mutex>\n#include <string>/' "$SRC/horovod/common/group_table.h"
  sed -i '0,/#include </s//#include <stdexcept>\n#include </' "$SRC/horovod/common/common.h"
  B0=$(date +%s)
  CXXFLAGS="-include cstdint -include string -include stdexcept -include limits" \
    CMAKE_POLICY_VERSION_MINIMUM=3.5 HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 \
    HOROVOD_WITHOUT_MXNET=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_CPU_OPERATIONS=gloo \
    HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_NCCL_INCLUDE=$NCCL_INC HOROVOD_NCCL_LIB=/tmp/gc-nccl \
    HOROVOD_NCCL_LINK=SHARED HOROVOD_BUILD_CUDA_CC_LIST=90 HOROVOD_CUDA_HOME=$CUDA_HOME \
    MAKEFLAGS=-j$(nproc) timeout 420 "$PY" -m pip wheel -v --no-deps --no-build-isolation \
    -w /tmp/gc-hb/out "$SRC" >"$OUT/build.log" 2>&1
  rc=$?
  say "Horovod build rc=$rc in $(($(date +%s) - B0)) s"
  if [ $rc != 0 ]; then
    grep -E "error|Error|FAILED" "$OUT/build.log" | head -30
    tail -40 "$OUT/build.log"
    exit 1
  fi
  WHEEL=$(ls /tmp/gc-hb/out/horovod-*.whl | head -1)
  if [ "$(stat -c %s "$WHEEL")" -lt 15000000 ]; then
    cp "$WHEEL" "$OUT/"
  else
    say "the wheel ($(stat -c %s "$WHEEL") bytes) is too big to come back"
  fi
fi
"$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" "$WHEEL" || exit 1
export PATH=$SITE/bin:$PATH
"$PY" -c "import horovod.torch as hvd; print('[env] horovod nccl_built', hvd.nccl_built(), 'gloo', hvd.gloo_built(), 'cuda', hvd.cuda_built())"

say "building hvtrace's hot path"
EXT=$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
rm -f hvtrace/record/_hot.*.so
gcc -O2 -fPIC -I"$PYINC" -c hvtrace/record/_hot.c -o /tmp/gc-hot.o &&
  g++ -O2 -fPIC -I"$PYINC" -c hvtrace/record/_hvdpoll.cpp -o /tmp/gc-hvdpoll.o &&
  g++ -shared /tmp/gc-hot.o /tmp/gc-hvdpoll.o -ldl -o "hvtrace/record/_hot$EXT" ||
  say "WARNING: hot path not built: the pure-Python one runs"
"$PY" -c "from hvtrace.record import native; print('[env] hvtrace hot path:', native._hot is not None)"

say "checks (scripts/gpu_check.py)"
# GC_MODELS: a shorter rerun (say resnet50,mlp); GC_TWO_RANKS=0 skips the two-rank probe;
# GC_WRITER_PARTS=1 times the writer thread's parts (event queries, resolves, encoding) per step
timeout 330 "$PY" scripts/gpu_check.py --out "$OUT" ${GC_MODELS:+--models "$GC_MODELS"}
rc=$?
[ "${GC_TWO_RANKS:-1}" = 0 ] && { say "done (checks rc=$rc)"; exit $rc; }

say "two ranks on one GPU (NCCL)"
timeout 60 horovodrun -np 2 -H localhost:2 --gloo "$PY" -c "
import horovod.torch as hvd, torch
hvd.init(); torch.cuda.set_device(0)
print('rank', hvd.rank(), 'allreduce', hvd.allreduce(torch.ones(4, device='cuda') * hvd.rank()).tolist())
" 2>&1 | grep -v "^\s*$" | tail -80
say "done (checks rc=$rc)"
exit $rc
