#!/usr/bin/env bash
# Install Debian's chromium and chromium-driver for the dashboard browser tests, when missing.
# Needs root (CI and the development machines run as root); prints what it did.
set -euo pipefail
if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" != 0 ] && ! command -v sudo >/dev/null 2>&1; then
  echo "[setup] chromium missing and not root: browser tests will be skipped" >&2
  exit 0
fi
SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
echo "[setup] installing chromium + chromium-driver (Debian packages)" >&2
$SUDO apt-get update -qq >/dev/null
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium chromium-driver >/dev/null
