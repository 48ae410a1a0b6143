#!/usr/bin/env bash
# Install what scripts/cluster.sh needs (Debian packages: iproute2 for namespaces, links and tc;
# openssh-server and -client for horovodrun's ssh launch), when missing. Needs root, as the
# cluster itself does; prints what it did.
set -euo pipefail
if [ -x /usr/sbin/sshd ] && command -v ssh >/dev/null 2>&1 && command -v ip >/dev/null 2>&1 \
  && command -v tc >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "[setup] not root: the namespace cluster tests will be skipped" >&2
  exit 0
fi
echo "[setup] installing iproute2 + openssh-server + openssh-client (Debian packages)" >&2
apt-get update -qq >/dev/null
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
  iproute2 openssh-server openssh-client >/dev/null
