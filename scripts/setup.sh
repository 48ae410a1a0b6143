#!/usr/bin/env bash
# Set up .venv with torch (CPU), a patched Horovod 0.28.1 (PyTorch + Gloo) and hvtrace itself.
# HVTRACE_EXTRAS (default dev,dashboard,lightning): hvtrace's extras; with spark, a Java runtime too.
# HOROVOD_WITH_MPI=1 builds Horovod with Open MPI as well (Debian's openmpi-bin/libopenmpi-dev), for
# `horovodrun --mpi` and `mpirun`; that build serves Gloo too, and is cached apart from the Gloo-only one.
# Idempotent: a second run reuses .venv and the cached Horovod wheel and takes seconds.
# The Horovod wheel is cached per machine in $HVTRACE_WHEEL_CACHE (default ~/.cache/hvtrace/wheels);
# when absent it is built from the PyPI sdist (about 7 minutes on 2 cores), never assumed present.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
VENV=${VENV:-.venv}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
HOROVOD_VERSION=0.28.1
CACHE=${HVTRACE_WHEEL_CACHE:-$HOME/.cache/hvtrace/wheels}
EXTRAS=${HVTRACE_EXTRAS:-dev,dashboard,lightning}
WITH_MPI=${HOROVOD_WITH_MPI:-0}
[ "$WITH_MPI" = 1 ] || WITH_MPI=0
log() { printf '[setup] %s\n' "$*" >&2; }

if [ "$WITH_MPI" = 1 ] && ! command -v mpirun >/dev/null 2>&1; then
  log "installing Open MPI (Debian packages openmpi-bin, libopenmpi-dev)"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq >/dev/null && \
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq openmpi-bin libopenmpi-dev >/dev/null
fi

if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV with $($PY --version)"
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
"$VPY" -m pip install -q --upgrade pip wheel setuptools >/dev/null 2>&1 || true

if ! "$VPY" -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '$TORCH_VERSION' else 1)" 2>/dev/null; then
  log "installing torch==$TORCH_VERSION (CPU build)"
  # On these machines the CPU wheel of torch 2.13.0 lies on disk (pip's find-links); elsewhere pip fetches it.
  "$VPY" -m pip install -q "torch==$TORCH_VERSION" numpy
fi

horovod_ok() {
  WITH_MPI=$WITH_MPI "$VPY" - <<'PY' 2>/dev/null
import os, sys
import horovod, horovod.torch as hvd
mpi = os.environ["WITH_MPI"] == "1"
sys.exit(0 if horovod.__version__ == "0.28.1" and hvd.gloo_built() and (hvd.mpi_built() or not mpi) else 1)
PY
}

if ! horovod_ok; then
  mkdir -p "$CACHE"
  TV=$("$VPY" -c "import torch; print(torch.__version__.split('+')[0])")
  WHEEL_DIR="$CACHE/torch-$TV"
  # Without MPI, Gloo does the CPU operations; with it, Horovod picks them by the launcher at run time
  # (MPI's under mpirun, Gloo's under horovodrun --gloo).
  MPI_FLAGS=(HOROVOD_WITHOUT_MPI=1 HOROVOD_CPU_OPERATIONS=gloo)
  if [ "$WITH_MPI" = 1 ]; then WHEEL_DIR="$WHEEL_DIR-mpi"; MPI_FLAGS=(HOROVOD_WITH_MPI=1); fi
  mkdir -p "$WHEEL_DIR"
  if ! ls "$WHEEL_DIR"/horovod-$HOROVOD_VERSION-*.whl >/dev/null 2>&1; then
    log "building Horovod $HOROVOD_VERSION wheel (PyTorch + Gloo$([ "$WITH_MPI" = 1 ] && echo ' + MPI')); this takes ~7 minutes once per machine"
    "$VPY" -m pip install -q "cmake<4" 2>/dev/null || "$VPY" -m pip install -q cmake
    SRC=$(mktemp -d)
    "$VPY" -m pip download -q --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$SRC"
    tar xzf "$SRC/horovod-$HOROVOD_VERSION.tar.gz" -C "$SRC"
    # Horovod 0.28.1 asks for C++14; torch >= 2.1 needs C++17 (upstream issue #3996, PR #3998).
    sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
      "$SRC/horovod-$HOROVOD_VERSION/CMakeLists.txt" "$SRC/horovod-$HOROVOD_VERSION/horovod/torch/CMakeLists.txt"
    env -u HOROVOD_WITH_MPI PATH="$PWD/$VENV/bin:$PATH" CMAKE_POLICY_VERSION_MINIMUM=3.5 HOROVOD_WITH_PYTORCH=1 \
      HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_WITH_GLOO=1 "${MPI_FLAGS[@]}" \
      MAKEFLAGS=-j"$(nproc)" "$VPY" -m pip wheel -q --no-deps --no-build-isolation "$SRC/horovod-$HOROVOD_VERSION" -w "$SRC/out"
    mv "$SRC"/out/horovod-*.whl "$WHEEL_DIR/"
    rm -rf "$SRC"
  fi
  log "installing Horovod from $(ls "$WHEEL_DIR"/horovod-$HOROVOD_VERSION-*.whl)"
  "$VPY" -m pip install -q --force-reinstall --no-deps "$WHEEL_DIR"/horovod-$HOROVOD_VERSION-*.whl
  "$VPY" -m pip install -q "$WHEEL_DIR"/horovod-$HOROVOD_VERSION-*.whl
  horovod_ok || { log "Horovod installed but not usable (no PyTorch/Gloo$([ "$WITH_MPI" = 1 ] && echo '/MPI') support)"; exit 1; }
fi

# Headless Chromium for the dashboard's browser tests (Debian packages; skipped if present).
bash scripts/setup_browser.sh
# iproute2 and sshd for the namespace cluster (scripts/cluster.sh) of the many-host tests.
bash scripts/setup_cluster.sh

# A Java runtime for Spark (the spark extra: horovod.spark.run on a local Spark), when asked.
case ",$EXTRAS," in
  *,spark,*)
    if ! command -v java >/dev/null 2>&1; then
      log "installing a Java runtime for Spark (Debian package openjdk-17-jre-headless)"
      SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
      $SUDO apt-get update -qq >/dev/null && \
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq openjdk-17-jre-headless >/dev/null
    fi ;;
esac

if [ -f pyproject.toml ]; then
  log "installing hvtrace[$EXTRAS] (editable)"
  "$VPY" -m pip install -q -e ".[$EXTRAS]"
fi
log "ready: $VENV ($("$VPY" -c 'import torch, horovod; print("torch", torch.__version__, "horovod", horovod.__version__)'))"
