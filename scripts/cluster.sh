#!/usr/bin/env bash
# A cluster of Horovod hosts on one Linux machine, made of namespaces (needs root).
#
#   scripts/cluster.sh up --hosts N [--clock-offset-s S] [--link-mbit M] [--link-delay-ms D]
#                         [--link-hosts K,K...] [--cpu-pct K=PCT ...]
#   scripts/cluster.sh run --np P -- COMMAND ARGS...
#   scripts/cluster.sh down
#   scripts/cluster.sh status
#
# Host k (1..N) is a network namespace `hvc<k>` with its own address 10.231.0.<k> on a bridge, its
# own hostname `hvc<k>` (UTS namespace), its own CLOCK_MONOTONIC offset by (k-1) x S seconds (a
# time namespace; host 1 keeps the machine's clock) and an sshd. The links of hosts 2..N (or of
# the hosts --link-hosts lists) can be shaped (rate M Mbit/s: tbf; with a delay of D ms: netem;
# each direction), and host K's processes together
# limited to PCT % of one CPU (a cgroup v1 cpu quota: a slow host). `run` launches COMMAND with the
# real `horovodrun --gloo -H 10.231.0.1:p,10.231.0.2:p,...` from host 1 (ranks in host order, p
# per host), in the caller's working directory (one file system: namespaces share it), and exits
# with the job's status. `down` removes everything `up` made and is safe to run twice.
# State lives in $HVTRACE_CLUSTER_DIR (default /tmp/hvtrace-cluster).
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
STATE=${HVTRACE_CLUSTER_DIR:-/tmp/hvtrace-cluster}
PREFIX=hvc
BRIDGE=${PREFIX}br0
NET=10.231.0
CGROUP=/sys/fs/cgroup/cpu
HOROVODRUN=${HOROVODRUN:-$(command -v horovodrun || echo "$HERE/../.venv/bin/horovodrun")}
log() { printf '[cluster] %s\n' "$*" >&2; }
die() { printf '[cluster] error: %s\n' "$*" >&2; exit 2; }

need_root() { [ "$(id -u)" = 0 ] || die "needs root (network and time namespaces)"; }

hosts_up() { cat "$STATE/hosts" 2>/dev/null || echo 0; }

down() {
  local k
  for k in $(seq 1 8); do
    if [ -f "$STATE/sshd-$k.pid" ]; then
      kill "$(cat "$STATE/sshd-$k.pid")" 2>/dev/null || true
    fi
    if [ -d "$CGROUP/$PREFIX$k" ]; then
      xargs -r kill -9 < "$CGROUP/$PREFIX$k/cgroup.procs" 2>/dev/null || true
    fi
    if [ -f "$STATE/host-$k.pid" ]; then
      kill -- "-$(cat "$STATE/host-$k.pid")" 2>/dev/null || kill "$(cat "$STATE/host-$k.pid")" 2>/dev/null || true
    fi
    ip netns pids "$PREFIX$k" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
    ip netns del "$PREFIX$k" 2>/dev/null || true
    rm -rf "/etc/netns/$PREFIX$k"
    if [ -d "$CGROUP/$PREFIX$k" ]; then
      for _ in 1 2 3 4 5 6 7 8 9 10; do rmdir "$CGROUP/$PREFIX$k" 2>/dev/null && break; sleep 0.2; done
    fi
    ip link del "${PREFIX}v$k" 2>/dev/null || true
  done
  ip link del "$BRIDGE" 2>/dev/null || true
  rm -rf "$STATE"
}

up() {
  local n=2 offset=0 mbit="" delay="" cpu=() shaped=
  while [ $# -gt 0 ]; do
    case "$1" in
      --hosts) n=$2; shift 2 ;;
      --clock-offset-s) offset=$2; shift 2 ;;
      --link-mbit) mbit=$2; shift 2 ;;
      --link-delay-ms) delay=$2; shift 2 ;;
      --link-hosts) shaped=$2; shift 2 ;;
      --cpu-pct) cpu+=("$2"); shift 2 ;;
      *) die "up: unknown option $1" ;;
    esac
  done
  [[ "$n" =~ ^[1-8]$ ]] || die "--hosts must be 1..8"
  [[ "$shaped" =~ ^[1-8](,[1-8])*$ ]] || [ -z "$shaped" ] || die "--link-hosts: host numbers, e.g. 2,3"
  [ -n "$shaped" ] || shaped=$(seq -s, 2 "$n")
  need_root
  command -v sshd >/dev/null || [ -x /usr/sbin/sshd ] || die "no sshd (apt-get install openssh-server)"
  [ -x "$HOROVODRUN" ] || die "no horovodrun at $HOROVODRUN (make setup)"
  down
  mkdir -p "$STATE" /run/sshd
  chmod 700 "$STATE"
  echo "$n" > "$STATE/hosts"
  printf '%s\n' "$offset" > "$STATE/clock_offset_s"
  ssh-keygen -q -t ed25519 -N '' -f "$STATE/id" -C hvtrace-cluster
  ssh-keygen -q -t ed25519 -N '' -f "$STATE/host_key" -C hvtrace-cluster-host
  cp "$STATE/id.pub" "$STATE/authorized_keys"
  ip link add "$BRIDGE" type bridge
  ip addr add "$NET.254/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  local k off
  {
    echo "127.0.0.1 localhost"
    for k in $(seq 1 "$n"); do echo "$NET.$k $PREFIX$k"; done
  } > "$STATE/etc_hosts"
  for k in $(seq 1 "$n"); do
    ip netns add "$PREFIX$k"
    # `ip netns exec` bind-mounts /etc/netns/NAME/hosts over /etc/hosts: the hosts know each
    # other's names (Gloo looks them up), and the machine's own /etc/hosts is left alone
    mkdir -p "/etc/netns/$PREFIX$k"
    cp "$STATE/etc_hosts" "/etc/netns/$PREFIX$k/hosts"
    ip link add "${PREFIX}v$k" type veth peer name eth0 netns "$PREFIX$k"
    ip link set "${PREFIX}v$k" master "$BRIDGE" up
    ip -n "$PREFIX$k" addr add "$NET.$k/24" dev eth0
    ip -n "$PREFIX$k" link set eth0 up
    ip -n "$PREFIX$k" link set lo up
    if [[ ",$shaped," == *",$k,"* ]] && { [ -n "$mbit" ] || [ -n "$delay" ]; }; then
      # each direction of host k's link: out of its eth0, and into it (the bridge side's veth)
      local dev ns
      for dev in "eth0@$PREFIX$k" "${PREFIX}v$k@"; do
        ns=${dev#*@}
        dev=${dev%@*}
        if [ -n "$delay" ]; then  # netem: delay (and rate); not every kernel has it
          local shape=(delay "${delay}ms")
          [ -n "$mbit" ] && shape+=(rate "${mbit}mbit" limit 10000)
          ip ${ns:+-n "$ns"} link show "$dev" > /dev/null
          tc ${ns:+-n "$ns"} qdisc add dev "$dev" root netem "${shape[@]}" 2>/dev/null ||
            die "--link-delay-ms needs the netem qdisc, which this kernel lacks (CONFIG_NET_SCH_NETEM)"
        else  # rate alone: a token bucket (tbf)
          tc ${ns:+-n "$ns"} qdisc add dev "$dev" root tbf rate "${mbit}mbit" burst 64kb latency 100ms
        fi
      done
    fi
    cat > "$STATE/sshd-$k.conf" <<EOF
ListenAddress $NET.$k:22
HostKey $STATE/host_key
PidFile $STATE/sshd-$k.pid
AuthorizedKeysFile $STATE/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PrintMotd no
AcceptEnv *
EOF
    off=$(python3 -c "print(($k - 1) * float('$offset'))")
    local pct="" spec into="$STATE/no-cgroup"
    for spec in "${cpu[@]}"; do [ "${spec%%=*}" = "$k" ] && pct=${spec#*=}; done
    if [ -n "$pct" ]; then
      [[ "$pct" =~ ^[0-9]+$ ]] && [ "$pct" -ge 1 ] || die "--cpu-pct $k=$pct: PCT must be a whole percent"
      [ -d "$CGROUP" ] || die "--cpu-pct needs the cgroup v1 cpu controller at $CGROUP"
      mkdir -p "$CGROUP/$PREFIX$k"
      echo 100000 > "$CGROUP/$PREFIX$k/cpu.cfs_period_us"
      echo $((pct * 1000)) > "$CGROUP/$PREFIX$k/cpu.cfs_quota_us"
      into="$CGROUP/$PREFIX$k/cgroup.procs"
    fi
    # the host's processes: sshd (and every session it starts) in the host's network, time and
    # UTS namespaces
    # (into the host's cgroup first, when it has one: everything it starts inherits it)
    setsid sh -c 'echo $$ > "$1" 2>/dev/null; shift; exec "$@"' sh "$into" \
      ip netns exec "$PREFIX$k" python3 "$HERE/timens.py" "$off" -- \
      unshare --uts sh -c "hostname $PREFIX$k && exec /usr/sbin/sshd -D -e -f $STATE/sshd-$k.conf" \
      > "$STATE/sshd-$k.log" 2>&1 < /dev/null &
    echo $! > "$STATE/host-$k.pid"
  done
  # horovodrun calls `ssh`: this one uses the cluster's key and known-hosts file, never ~/.ssh
  mkdir -p "$STATE/bin"
  printf '#!/bin/sh\nexec /usr/bin/ssh -F %s "$@"\n' "$STATE/ssh_config" > "$STATE/bin/ssh"
  chmod +x "$STATE/bin/ssh"
  cat > "$STATE/ssh_config" <<EOF
Host $NET.*
  IdentityFile $STATE/id
  UserKnownHostsFile $STATE/known_hosts
  StrictHostKeyChecking no
  LogLevel ERROR
EOF
  for k in $(seq 1 "$n"); do
    local i
    for i in $(seq 1 100); do
      if ssh -F "$STATE/ssh_config" -o BatchMode=yes -o ConnectTimeout=2 "$NET.$k" true 2>/dev/null; then
        break
      fi
      [ "$i" = 100 ] && { cat "$STATE/sshd-$k.log" >&2; die "host $k's sshd did not come up"; }
      sleep 0.1
    done
  done
  log "up: $n host(s) ${PREFIX}1..${PREFIX}$n at $NET.1..$NET.$n; clock offset ${offset} s per host; link ${mbit:-unshaped} mbit ${delay:-0} ms (hosts ${shaped:-none}); cpu ${cpu[*]:-unlimited}"
}

run() {
  local np=""
  while [ $# -gt 0 ]; do
    case "$1" in
      --np) np=$2; shift 2 ;;
      --) shift; break ;;
      *) die "run: unknown option $1 (COMMAND goes after --)" ;;
    esac
  done
  [ $# -gt 0 ] || die "run: no COMMAND (after --)"
  need_root
  local n
  n=$(hosts_up)
  [ "$n" -ge 1 ] || die "no cluster: run 'scripts/cluster.sh up' first"
  [[ "$np" =~ ^[0-9]+$ ]] && [ "$np" -ge 1 ] || die "run: --np P is required"
  [ $((np % n)) = 0 ] || die "run: --np $np does not spread evenly over $n hosts"
  local per=$((np / n)) hosts="" k
  for k in $(seq 1 "$n"); do hosts="$hosts${hosts:+,}$NET.$k:$per"; done
  # horovodrun itself runs on host 1 (its ranks start there directly, the others through ssh)
  local cmd
  printf -v cmd '%q ' "$HOROVODRUN" -np "$np" -H "$hosts" --gloo --network-interfaces eth0 \
    --ssh-identity-file "$STATE/id" --start-timeout 60 "$@"
  export PATH="$STATE/bin:$PATH"
  ip netns exec "${PREFIX}1" unshare --uts sh -c "hostname ${PREFIX}1 && cd $(printf %q "$PWD") && exec $cmd"
}

status() {
  local n k
  n=$(hosts_up)
  echo "hosts: $n (state: $STATE)"
  for k in $(seq 1 "$n"); do
    ip netns exec "$PREFIX$k" sh -c "echo host $k: \$(ip -br addr show eth0)" 2>/dev/null || echo "host $k: missing"
  done
}

case "${1:-}" in
  up) shift; up "$@" ;;
  run) shift; run "$@" ;;
  down) need_root; down; log "down" ;;
  status) status ;;
  *) sed -n '2,16p' "$0" >&2; exit 2 ;;
esac
