"""Clock offsets to rank 0: Horovod barrier rounds, then timed TCP round trips (NTP's bound).

:func:`handshake` (at start: the run id and the first estimate) and :func:`sync_clocks` (later
estimates) are collectives every rank runs at the same point; :func:`sync_clocks` takes the
round-trip estimate when it is tighter than the barrier's and consistent with it
(:func:`better_estimate`).

Timed TCP round trips to rank 0:

A Horovod collective takes milliseconds (negotiation, the background thread's cycle), so barrier
rounds bound a rank's offset to rank 0 only within milliseconds on a loaded machine. A round trip
on a socket takes tens of microseconds: rank *i* notes ``t1``, asks rank 0 for its clock, gets
``t2`` (rank 0's monotonic time when it answered) and notes ``t3``. Rank 0 answered between
``t1`` and ``t3`` on rank *i*'s clock, so the offset (local minus rank 0's) lies in
``[t1 - t2, t3 - t2]``; intersecting the rounds' intervals bounds it
(:func:`hvtrace.clock.estimate_from_round_trips`).

:func:`ping_rank0` is a collective (every rank calls it at the same point): rank 0 serves on an
ephemeral TCP port while the others ping it, and a final ``allgather_object`` ends the serving. Any
failure (no route, a firewall, a timeout) leaves that rank with ``None`` (the caller keeps the
barrier estimate); the collectives themselves always run on every rank, so a failure cannot
deadlock the job.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import selectors
import socket
import struct
import time
from typing import Any

import numpy as np

from hvtrace.clock import ClockEstimate, estimate_from_round_trips, estimate_offsets
from hvtrace.record.threads import NamedThread
from hvtrace.record.timers import monotonic_ns

log = logging.getLogger(__name__)

_TIME = struct.Struct("<q")
#: Seconds a rank waits to connect to (or hear from) rank 0 before keeping the barrier estimate.
TIMEOUT_S = 1.0

#: Set when this rank could not reach rank 0: later estimates keep the barrier rounds at once
#: instead of waiting for the timeout again (a firewall does not open mid-run).
_unreachable = False


def _iface_ipv4(name: str) -> str | None:
    """IPv4 address of interface ``name`` (SIOCGIFADDR), or None."""
    with contextlib.suppress(OSError, ValueError), socket.socket(socket.AF_INET) as s:
        req = struct.pack("256s", name.encode()[:15])
        return socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, req)[20:24])
    return None


def _addresses() -> list[str]:
    """Where other ranks may reach this host: Gloo's interface, the host name, loopback."""
    out: list[str] = []
    iface = os.environ.get("HOROVOD_GLOO_IFACE")
    if iface:
        addr = _iface_ipv4(iface)
        if addr:
            out.append(addr)
    with contextlib.suppress(OSError):
        out.append(socket.gethostbyname(socket.gethostname()))
    out.append("127.0.0.1")
    return list(dict.fromkeys(out))


class _Server:
    """Rank 0's side: answer every 8-byte request with its monotonic time, until stopped."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("0.0.0.0", 0), backlog=128)
        self.sock.setblocking(False)
        self.port = self.sock.getsockname()[1]
        self._stop_r, self._stop_w = os.pipe()
        self._thread = NamedThread(target=self._serve, name="hvtrace-clock", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self.sock, selectors.EVENT_READ, "accept")
        sel.register(self._stop_r, selectors.EVENT_READ, "stop")
        try:
            while True:
                for key, _ in sel.select():
                    if key.data == "stop":
                        return
                    if key.data == "accept":
                        with contextlib.suppress(OSError):
                            conn, _ = self.sock.accept()
                            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                            conn.setblocking(False)
                            sel.register(conn, selectors.EVENT_READ, bytearray())
                        continue
                    conn, pending = key.fileobj, key.data
                    try:
                        data = conn.recv(4096)
                    except (BlockingIOError, InterruptedError):
                        continue
                    except OSError:
                        data = b""
                    if not data:
                        sel.unregister(conn)
                        conn.close()
                        continue
                    pending += data
                    while len(pending) >= 8:  # one answer per request, stamped as it is sent
                        del pending[:8]
                        with contextlib.suppress(OSError):
                            conn.sendall(_TIME.pack(monotonic_ns()))
        finally:
            for key in list(sel.get_map().values()):
                if isinstance(key.fileobj, socket.socket) and key.fileobj is not self.sock:
                    key.fileobj.close()
            sel.close()

    def stop(self) -> None:
        os.write(self._stop_w, b"x")
        self._thread.join(TIMEOUT_S)
        self.sock.close()
        os.close(self._stop_r)
        os.close(self._stop_w)


def _ping(addresses: list[str], port: int, rounds: int) -> np.ndarray | None:
    """``(rounds, 3)`` int64 ``t1, t2, t3`` from rank 0 at the first address that answers."""
    for addr in addresses:
        try:
            with socket.create_connection((addr, port), timeout=TIMEOUT_S) as s:
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                out = np.empty((rounds, 3), np.int64)
                for r in range(rounds):
                    t1 = monotonic_ns()
                    s.sendall(b"\0" * 8)
                    buf = b""
                    while len(buf) < 8:
                        chunk = s.recv(8 - len(buf))
                        if not chunk:
                            raise ConnectionError("rank 0 closed the connection")
                        buf += chunk
                    t3 = monotonic_ns()
                    out[r] = (t1, _TIME.unpack(buf)[0], t3)
                return out
        except OSError as exc:
            log.debug("hvtrace: clock ping to %s:%s failed: %s", addr, port, exc)
    return None


def ping_rank0(hvd: Any, rounds: int, tag: str) -> ClockEstimate | None:
    """Estimate this rank's offset to rank 0 from ``rounds`` TCP round trips (a collective).

    Returns None on rank 0 (its offset is zero by definition) and on a rank that could not
    reach rank 0; the estimate's ``method`` is ``"round-trip"``."""
    global _unreachable
    server = None
    info = None
    if hvd.rank() == 0:
        try:
            server = _Server()
            info = (_addresses(), server.port)
        except OSError as exc:
            log.debug("hvtrace: cannot serve clock pings: %s", exc)
    try:
        info = hvd.broadcast_object(info, root_rank=0, name=f"{tag}.addr")
        times = None
        if hvd.rank() != 0 and info is not None and not _unreachable:
            times = _ping(list(info[0]), int(info[1]), rounds)
            _unreachable = times is None
        hvd.allgather_object(times is not None, name=f"{tag}.done")  # rank 0 served everyone
    finally:
        if server is not None:
            server.stop()
    if times is None:
        return None
    return estimate_from_round_trips(times[:, 0], times[:, 1], times[:, 2])


#: TCP round trips per clock estimate (tens of microseconds each).
PING_ROUNDS = 32
#: The names of the clock collectives. One name for every estimate: Horovod matches collectives
#: by name, and a worker that joins an elastic job must issue the names the survivors issue,
#: whatever number of estimates each made before (names are reused only one estimate after
#: another, as the optimizer reuses its gradients' names every step).
CLOCK_TAG = "hvtrace.clock"


def sync_clocks(hvd: Any, rounds: int) -> ClockEstimate:
    """Run ``rounds`` barrier rounds on every rank; return this rank's offset to rank 0.

    A collective: every rank must call it at the same point. See :mod:`hvtrace.clock`.
    """
    import torch

    tag = CLOCK_TAG
    x = torch.zeros(1)
    hvd.allreduce(x, name=f"{tag}.warm", op=hvd.Sum)
    enter = np.empty(rounds, np.int64)
    exit_ = np.empty(rounds, np.int64)
    for r in range(rounds):
        enter[r] = monotonic_ns()
        hvd.allreduce(x, name=f"{tag}.{r}", op=hvd.Sum)
        exit_[r] = monotonic_ns()
    mine = torch.from_numpy(np.concatenate([enter, exit_])).unsqueeze(0)
    everyone = hvd.allgather(mine, name=f"{tag}.gather").numpy()
    barrier = estimate_offsets(everyone[:, :rounds], everyone[:, rounds:])[hvd.rank()]
    trips = ping_rank0(hvd, PING_ROUNDS, tag)
    return better_estimate(barrier, trips)


def better_estimate(barrier: ClockEstimate, trips: ClockEstimate | None) -> ClockEstimate:
    """The round-trip estimate when it is bounded, tighter than the barrier's and consistent
    with it (both are bounds on the same offset: their intervals must meet); else the barrier's."""
    if trips is None or not trips.bounded or trips.uncertainty_ns >= barrier.uncertainty_ns:
        return barrier
    gap = abs(trips.offset_ns - barrier.offset_ns)
    if barrier.bounded and gap > trips.uncertainty_ns + barrier.uncertainty_ns:
        log.debug("hvtrace: clock round trips %s contradict the barrier %s", trips, barrier)
        return barrier
    return trips


def handshake(hvd: Any, rounds: int) -> tuple[str, ClockEstimate]:
    """The run id (made by rank 0, broadcast) and the first clock estimate (a collective)."""
    run_id = time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)
    run_id = hvd.broadcast_object(run_id, root_rank=0, name="hvtrace.run_id")
    return str(run_id), sync_clocks(hvd, rounds)
