"""The rank's TCP connections as the kernel counts them: bytes moved and time busy, per peer.

Horovod's collectives over Gloo (and its controller) run over TCP connections between ranks.
From the kernel's ``TCP_INFO`` of each connection (Linux >= 4.10) the writer thread notes, every
:data:`SAMPLE_EVERY_S` seconds and when the file closes, the cumulative counters of every
connection that has moved at least :data:`MIN_BYTES` in either direction:

- ``sent_bytes`` (``tcpi_bytes_acked``: sent and acknowledged) and ``recv_bytes``;
- ``busy_us``: time the connection had data to send or in flight (``tcpi_busy_time``), of which
  ``rwnd_limited_us`` it waited for the *receiver* to take data (``tcpi_rwnd_limited``) and
  ``sndbuf_limited_us`` for its own send buffer; the kernel counts these in scheduler ticks
  (1-10 ms), so they are accurate only summed over many transfers;
- ``min_rtt_us`` and ``retrans`` (segments retransmitted).

``sent_bytes / (busy_us - rwnd_limited_us)`` is the rate at which the path to that peer carried
data while there was data to carry: for a connection across a slow link, that link's rate; for
one that idles while its sender waits for someone else, still the path's rate, since idle time is
not busy time. The analyzer (:mod:`hvtrace.analysis.links`) turns these into host-to-host links.

How: each file descriptor of the process that is a socket (``/proc/self/fd``) is duplicated,
asked for ``TCP_INFO`` and its addresses, and the duplicate closed at once (never kept: a kept
duplicate would hold a connection open after its owner closed it). Nothing here runs on the
training thread, and any failure stops the sampling, never the recording.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from typing import Any

#: Seconds between samples (and one more when the file is closed).
SAMPLE_EVERY_S = 5.0
#: A connection is noted once it moved this many bytes (sent or received): the data links, not
#: the controller's small messages.
MIN_BYTES = 1 << 20
#: ``TCP_INFO`` is asked for this many bytes; the fields used end at byte 192.
_INFO_LEN = 232
_NEED_LEN = 192
_FD_DIR = "/proc/self/fd"


def _addr(a: Any) -> str:
    host, port = a[0], a[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def connection_info(sock: socket.socket) -> dict[str, Any] | None:
    """The counters of one connected TCP socket (see the module docstring), or None."""
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _INFO_LEN)
    if len(info) < _NEED_LEN:
        return None  # a kernel without the busy-time counters
    acked, received = struct.unpack_from("=QQ", info, 120)
    (retrans,) = struct.unpack_from("=I", info, 100)
    (min_rtt,) = struct.unpack_from("=I", info, 148)
    busy, rwnd, sndbuf = struct.unpack_from("=QQQ", info, 168)
    return {
        "local": _addr(sock.getsockname()),
        "peer": _addr(sock.getpeername()),
        "sent_bytes": max(int(acked) - 1, 0),  # the SYN counts as one byte acked
        "recv_bytes": int(received),
        "busy_us": int(busy),
        "rwnd_limited_us": int(rwnd),
        "sndbuf_limited_us": int(sndbuf),
        "min_rtt_us": int(min_rtt),
        "retrans": int(retrans),
    }


def sample_connections(min_bytes: int = MIN_BYTES) -> list[dict[str, Any]]:
    """The counters of this process's TCP connections that moved ``min_bytes`` or more."""
    out = []
    for name in os.listdir(_FD_DIR):
        try:
            fd = int(name)
            if not os.readlink(f"{_FD_DIR}/{name}").startswith("socket:"):
                continue
            dup = os.dup(fd)
        except (OSError, ValueError):
            continue  # closed meanwhile, or not ours to look at
        try:
            sock = socket.socket(fileno=dup)
        except OSError:
            os.close(dup)
            continue
        try:
            with sock as s:
                if s.type != socket.SOCK_STREAM or s.family not in (
                    socket.AF_INET,
                    socket.AF_INET6,
                ):
                    continue
                c = connection_info(s)
        except OSError:
            continue  # not connected, not TCP, or gone
        if c is not None and max(c["sent_bytes"], c["recv_bytes"]) >= min_bytes:
            out.append(c)
    return out


class ConnectionSampler:
    """Samples at most every ``every_s`` seconds (always when ``final``); stops after a failure.

    Each sample returns only the connections whose counters moved since the previous one (the
    statuses are merged with the latest sample per connection winning, so nothing is lost)."""

    def __init__(self, every_s: float = SAMPLE_EVERY_S) -> None:
        self.every_s = every_s
        self.next_at = time.monotonic() + every_s
        self.failed = ""
        self._last: dict[tuple[str, str], tuple[int, int, int]] = {}

    def __call__(self, final: bool) -> list[dict[str, Any]] | None:
        """The connections that moved, or None when it is not time yet (or sampling failed)."""
        now = time.monotonic()
        if self.failed or (now < self.next_at and not final):
            return None
        self.next_at = now + self.every_s
        try:
            conns = sample_connections()
        except Exception as exc:  # noqa: BLE001 - the spans matter more than these counters
            self.failed = f"{type(exc).__name__}: {exc}"
            return None
        moved = []
        for c in conns:
            key, seen = (c["local"], c["peer"]), (c["sent_bytes"], c["recv_bytes"], c["busy_us"])
            if self._last.get(key) != seen:
                self._last[key] = seen
                moved.append(c)
        return moved
