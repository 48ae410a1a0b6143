"""The writer thread's TCP counters (hvtrace.record.netstat), on real loopback connections."""

from __future__ import annotations

import socket
import sys
import threading

import pytest

from hvtrace.format.status import merge_connections
from hvtrace.record import netstat

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="TCP_INFO and /proc are Linux's")


@pytest.fixture
def connection():
    """A connected pair over loopback; the client sends 4 MiB and the server reads it all."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    cli = socket.create_connection(srv.getsockname())
    peer, _ = srv.accept()
    done = threading.Event()

    def drain() -> None:
        n = 0
        while n < 4 << 20:
            n += len(peer.recv(1 << 20))
        done.set()

    t = threading.Thread(target=drain, daemon=True)
    t.start()
    cli.sendall(b"x" * (4 << 20))
    assert done.wait(10)
    yield cli, peer
    for s in (cli, peer, srv):
        s.close()


def _addr(a: tuple) -> str:
    return f"{a[0]}:{a[1]}"


def test_a_connection_that_moved_data_is_sampled_with_its_counters(connection) -> None:
    cli, peer = connection
    found = {(c["local"], c["peer"]): c for c in netstat.sample_connections(min_bytes=1 << 20)}
    mine = found[(_addr(cli.getsockname()), _addr(cli.getpeername()))]
    assert mine["sent_bytes"] == 4 << 20  # acknowledged, the SYN not counted
    theirs = found[(_addr(peer.getsockname()), _addr(peer.getpeername()))]
    assert theirs["recv_bytes"] == 4 << 20 and theirs["sent_bytes"] == 0
    assert mine["busy_us"] >= 0 and mine["rwnd_limited_us"] <= mine["busy_us"]
    # the duplicates were closed, the originals still work
    cli.sendall(b"ok")
    assert peer.recv(2) == b"ok"


def test_small_connections_are_left_out(connection) -> None:
    cli, _ = connection
    local = _addr(cli.getsockname())
    assert not [c for c in netstat.sample_connections(min_bytes=8 << 20) if c["local"] == local]


def test_the_sampler_waits_between_samples_but_always_samples_at_the_end(connection) -> None:
    s = netstat.ConnectionSampler(every_s=3600)
    assert s(final=False) is None
    assert s(final=True)  # the connection above
    s0 = netstat.ConnectionSampler(every_s=0)
    assert s0(final=False)
    assert s0(final=False) == []  # nothing moved since
    cli, peer = connection
    cli.sendall(b"y" * 1000)
    peer.recv(1000)
    moved = {c["local"] for c in s0(final=False)}
    assert {_addr(cli.getsockname()), _addr(peer.getsockname())} <= moved


def test_a_failing_sampler_stops_and_says_why(monkeypatch) -> None:
    def boom(min_bytes: int = 0) -> list:
        raise PermissionError("no /proc")

    monkeypatch.setattr(netstat, "sample_connections", boom)
    s = netstat.ConnectionSampler(every_s=0)
    assert s(final=True) is None and "PermissionError" in s.failed
    monkeypatch.undo()
    assert s(final=True) is None  # stays off


def test_merge_keeps_the_latest_sample_per_connection_and_drops_junk() -> None:
    a = {"local": "10.0.0.1:5", "peer": "10.0.0.2:7", "sent_bytes": 1}
    b = {"local": "10.0.0.1:6", "peer": "10.0.0.2:7", "sent_bytes": 9}
    a2 = dict(a, sent_bytes=5)
    out = merge_connections([a, b, "junk", {"local": 1}], [a2, None])
    assert sorted(c["sent_bytes"] for c in out) == [5, 9]
    assert merge_connections("not a list", None) == []
