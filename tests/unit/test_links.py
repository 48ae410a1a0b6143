"""Host-to-host links from the ranks' TCP counters (hvtrace.analysis.links), on made-up files."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from hvtrace.analysis.links import (
    connection_rows,
    limiting_link,
    link_table,
    link_words,
)

MB = 10**6


def conn(local: str, peer: str, sent: int, busy_s: float, rwnd_s: float = 0.0, **kw) -> dict:
    return {
        "local": local,
        "peer": peer,
        "sent_bytes": sent,
        "recv_bytes": 0,
        "busy_us": int(busy_s * 1e6),
        "rwnd_limited_us": int(rwnd_s * 1e6),
        "sndbuf_limited_us": 0,
        "min_rtt_us": 40,
        "retrans": 0,
        **kw,
    }


def ring(rates_mb_s: dict[tuple[int, int], float], sent: int = 600 * MB) -> tuple[dict, dict]:
    """One rank per host ``h{k}`` at 10.0.0.k; each (src, dst) sends ``sent`` bytes at a rate."""
    tcp: dict[int, list] = {}
    for (s, d), rate in rates_mb_s.items():
        tcp.setdefault(s, []).append(
            conn(f"10.0.0.{s}:{5000 + d}", f"10.0.0.{d}:{6000 + s}", sent, sent / (rate * MB))
        )
        # the controller's small messages: slow per byte, too little to count
        tcp[s].append(conn(f"10.0.0.{s}:{7000 + d}", f"10.0.0.{d}:80", 2 * MB, 5.0))
    files = {s - 1: SimpleNamespace(tcp=v) for s, v in tcp.items()}
    return files, {s - 1: f"h{s}" for s in tcp}


def test_the_slow_links_of_one_host_name_that_host() -> None:
    files, hosts = ring({(1, 2): 24, (2, 3): 25, (3, 1): 160})
    links = link_table(connection_rows(files, hosts))
    assert links["rate_gbps"].notna().sum() == 3
    assert links.iloc[0]["rate_gbps"] == pytest.approx(0.024, rel=1e-3)  # slowest first
    lim = limiting_link(links, busbw_gbps=0.022)
    assert lim["host"] == "h2" and lim["stands_out"] and lim["limits"]
    assert sorted(map(tuple, lim["links"])) == [("h1", "h2"), ("h2", "h3")]
    assert lim["busbw_share"] == pytest.approx(0.022 / 0.024)
    assert link_words(lim) == "host h2's link (h1->h2, h2->h3)"
    assert not limiting_link(links, busbw_gbps=0.008)["limits"]  # held back by something else


def test_two_hosts_name_the_link_by_both_ends() -> None:
    files, hosts = ring({(1, 2): 24, (2, 1): 23})
    lim = limiting_link(link_table(connection_rows(files, hosts)), busbw_gbps=0.021)
    assert lim["host"] is None and not lim["stands_out"]
    assert lim["limits"]  # 91 % of the slowest: saturated
    assert link_words(lim) == "the link between h1 and h2"


def test_links_that_run_alike_limit_only_when_saturated() -> None:
    files, hosts = ring({(1, 2): 160, (2, 3): 190, (3, 1): 200})
    links = link_table(connection_rows(files, hosts))
    assert not limiting_link(links, busbw_gbps=0.10)["limits"]  # 63 % of 0.16 GB/s
    assert limiting_link(links, busbw_gbps=0.15)["limits"]


def test_time_waiting_for_the_receiver_is_not_the_links() -> None:
    files = {0: SimpleNamespace(tcp=[conn("10.0.0.1:1", "10.0.0.2:2", 100 * MB, 10.0, 6.0)])}
    files[1] = SimpleNamespace(tcp=[conn("10.0.0.2:2", "10.0.0.1:1", 100 * MB, 4.0)])
    links = link_table(connection_rows(files, {0: "a", 1: "b"}))
    assert list(links["rate_gbps"]) == pytest.approx([0.025, 0.025])


def test_within_a_host_loopback_and_strangers_are_left_out() -> None:
    tcp = [
        conn("10.0.0.1:1", "10.0.0.1:2", 100 * MB, 1.0),  # to a rank on its own host
        conn("127.0.0.1:1", "127.0.0.1:3", 100 * MB, 1.0),
        conn("10.0.0.1:4", "192.168.9.9:80", 100 * MB, 1.0),  # a file server: no rank's address
    ]
    files = {0: SimpleNamespace(tcp=tcp), 1: SimpleNamespace(tcp=[])}
    assert connection_rows(files, {0: "a", 1: "b"}).empty
    lt = link_table(connection_rows(files, {0: "a", 1: "b"}))
    assert lt.empty and limiting_link(lt, 0.1) is None


def test_an_address_two_hosts_claim_names_neither() -> None:
    files = {
        0: SimpleNamespace(tcp=[conn("172.17.0.2:1", "172.17.0.2:9", 100 * MB, 1.0)]),
        1: SimpleNamespace(tcp=[conn("172.17.0.2:9", "172.17.0.2:1", 100 * MB, 1.0)]),
    }
    assert connection_rows(files, {0: "a", 1: "b"}).empty


@pytest.mark.parametrize(
    "bad",
    [
        {"local": "10.0.0.1:1", "peer": "10.0.0.2:x"},
        {"local": "not an address:1", "peer": "10.0.0.2:2"},
        {"local": "10.0.0.1:1", "peer": "10.0.0.2:2", "sent_bytes": -5},
        {"local": "10.0.0.1:1", "peer": "10.0.0.2:2", "sent_bytes": True},
        {"local": "10.0.0.1:1", "peer": "10.0.0.2:2", "busy_us": "1e9"},
        {"local": "10.0.0.1:1", "peer": "10.0.0.2:2", "busy_us": 1 << 70},
        {"local": "\x1b[31m" * 20 + ":1", "peer": "10.0.0.2:2"},
    ],
)
def test_malformed_entries_are_skipped(bad: dict) -> None:
    good = conn("10.0.0.2:2", "10.0.0.1:1", 100 * MB, 4.0)
    entry = {**conn("10.0.0.1:1", "10.0.0.2:2", 100 * MB, 4.0), **bad}
    own = conn("10.0.0.1:3", "10.0.0.9:3", 100 * MB, 4.0)  # says where rank 0 is
    files = {0: SimpleNamespace(tcp=[entry, "junk", None, own]), 1: SimpleNamespace(tcp=[good])}
    rows = connection_rows(files, {0: "a", 1: "b"})
    assert list(rows["rank"]) == [1]  # rank 0's entry is unusable, rank 1's kept


def test_a_pair_that_carried_little_is_not_measured() -> None:
    files, hosts = ring({(1, 2): 24, (2, 1): 24})
    files[0].tcp.append(conn("10.0.0.1:9", "10.0.0.3:9", 600 * MB, 25.0))
    files[2] = SimpleNamespace(tcp=[conn("10.0.0.3:9", "10.0.0.1:9", 1 * MB, 1.0)])
    hosts[2] = "h3"
    links = link_table(connection_rows(files, hosts))
    small = links[(links["src_host"] == "h3")]
    assert len(small) == 1 and np.isnan(small["rate_gbps"].iloc[0])


def test_a_pair_with_only_side_traffic_is_not_the_limit() -> None:
    """The parameter broadcast and the controller's messages (68 MB, queued behind the bulk data
    on host 2's slow link, so slow per byte) go h1->h2, the ring's data the other way round."""
    files, hosts = ring({(2, 1): 24, (3, 2): 25, (1, 3): 160})
    files[0].tcp.append(conn("10.0.0.1:8000", "10.0.0.2:8000", 68 * MB, 14.0))
    links = link_table(connection_rows(files, hosts))
    side = links[(links["src_host"] == "h1") & (links["dst_host"] == "h2")]
    assert len(side) == 1 and np.isnan(side["rate_gbps"].iloc[0])
    lim = limiting_link(links, busbw_gbps=0.022)
    assert lim["host"] == "h2" and lim["rate_gbps"] == pytest.approx(0.024, rel=1e-3)


def test_no_link_is_the_limit_when_the_job_beats_the_measured_rates() -> None:
    """TCP held back by a busy CPU counts as busy: such "rates" can fall below what the ring
    achieved, and then they say nothing about a link's capacity."""
    files, hosts = ring({(1, 2): 103, (2, 3): 300, (3, 1): 320})
    lim = limiting_link(link_table(connection_rows(files, hosts)), busbw_gbps=0.128)
    assert lim["stands_out"] and lim["busbw_share"] > 1.2 and not lim["limits"]


def test_one_hosts_link_is_bounded_by_its_best_reading() -> None:
    """A shaped host's link measured in and out (a quiet 3-host run, 200 Mbit/s: 0.0171 and
    0.0191 GB/s) and the ring's bus bandwidth 1.16 times the lower: the link's two readings are
    of one link, and the ring beats neither by more than the slack. Links that are not one
    host's keep the slowest as the bound; a bus bandwidth far above the best reading still shows
    the rates are not capacities (a busy run: 0.053-0.059 GB/s, bus bandwidth 0.0747)."""
    files, hosts = ring({(3, 2): 17.1, (2, 1): 19.1, (1, 3): 179})
    lim = limiting_link(link_table(connection_rows(files, hosts)), busbw_gbps=0.01975)
    assert lim["host"] == "h2" and lim["busbw_share"] > 1.15 and lim["limits"]
    files, hosts = ring({(1, 2): 53, (2, 3): 59, (3, 1): 298})
    lim = limiting_link(link_table(connection_rows(files, hosts)), busbw_gbps=0.0747)
    assert lim["host"] == "h2" and not lim["limits"]
    files, hosts = ring({(1, 2): 100, (2, 3): 130, (3, 1): 140})  # alike: no host, no stand-out
    lim = limiting_link(link_table(connection_rows(files, hosts)), busbw_gbps=0.118)
    assert lim["host"] is None and not lim["limits"]  # 1.18 x the slowest
    assert limiting_link(link_table(connection_rows(files, hosts)), busbw_gbps=0.112)["limits"]


def test_links_a_little_apart_do_not_stand_out() -> None:
    files, hosts = ring({(1, 2): 100, (2, 3): 200, (3, 1): 210})
    lim = limiting_link(link_table(connection_rows(files, hosts)), busbw_gbps=0.07)
    assert not lim["stands_out"] and lim["host"] is None and not lim["limits"]


def test_a_slow_link_on_a_host_starved_of_cpu_is_not_the_limit() -> None:
    """A link that stands out, at a host whose ranks wait for a CPU far longer than the other
    hosts': the CPU, not the link. Hosts all short of CPU alike: the link still stands out."""
    files, hosts = ring({(1, 2): 24, (2, 3): 25, (3, 1): 160})
    links = link_table(connection_rows(files, hosts))
    lim = limiting_link(links, 0.022, {"h1": 0.2, "h2": 0.6, "h3": 0.25})
    assert lim["cpu_short_hosts"] == ["h2"] and not lim["limits"]
    lim = limiting_link(links, 0.022, {"h1": 0.5, "h2": 0.55, "h3": 0.45})
    assert lim["cpu_short_hosts"] == [] and lim["limits"] and lim["host"] == "h2"


def test_links_alike_on_hosts_short_of_cpu_are_not_the_limit() -> None:
    files, hosts = ring({(1, 2): 100, (2, 3): 105, (3, 1): 110})
    links = link_table(connection_rows(files, hosts))
    lim = limiting_link(links, 0.095, {"h1": 0.12, "h2": 0.05, "h3": 0.05})
    assert lim["cpu_short_hosts"] == ["h1"] and not lim["limits"]
    assert limiting_link(links, 0.095, {"h1": 0.05, "h2": 0.05, "h3": 0.05})["limits"]


@pytest.fixture(scope="module")
def comm_bound_analysis(tmp_path_factory):
    """A synthetic 4-rank run, with every step marked communication-bound."""
    from helpers import synth_module

    from hvtrace.analysis.summary import analyze
    from hvtrace.load import open_run

    d = tmp_path_factory.mktemp("synth")
    synth_module().write_synth_run(d, ranks=4, steps=12, tensors=4, slow_rank=-1)
    a = analyze(open_run(d))
    a.per_step = a.per_step.assign(comm_bound=True, exposed_share=0.8)
    return a


def _comm_message(a, lim) -> tuple[str, dict]:
    from hvtrace.analysis.findings import make_findings

    a.limiting_link = lim
    a.comm = dict(a.comm, busbw_gbps=0.022)
    (f,) = [f for f in make_findings(a) if f.kind == "comm_bound"]
    return f.message, f.data


def test_the_comm_bound_finding_says_what_the_links_say(comm_bound_analysis) -> None:
    files, hosts = ring({(1, 2): 24, (2, 3): 25, (3, 1): 160})
    links = link_table(connection_rows(files, hosts))
    msg, data = _comm_message(comm_bound_analysis, limiting_link(links, 0.022))
    assert "The network is the limit: host h2's link (h1->h2, h2->h3)" in msg
    assert "0.024 GB/s (192 Mbit/s)" in msg and data["limiting_link"]["host"] == "h2"
    msg, data = _comm_message(comm_bound_analysis, limiting_link(links, 0.022, {"h2": 0.6}))
    assert "network is the limit" not in msg and "(h1, h2, h3)" not in msg
    assert "slowest links' ends (h2) wait for a CPU" in msg and data["limiting_link"] is None
    msg, data = _comm_message(comm_bound_analysis, limiting_link(links, 0.005))
    assert "The links are not the limit" in msg and "only 21%" in msg
    msg, _ = _comm_message(comm_bound_analysis, None)
    assert "link" not in msg


def test_a_pair_too_briefly_busy_has_no_rate() -> None:
    """A pair whose connections were busy for less than a few scheduler ticks: no rate (and no
    error), the other pair keeps its own."""
    files = {
        0: SimpleNamespace(tcp=[conn("10.0.0.1:1", "10.0.0.2:2", 100 * MB, 4.0)]),
        1: SimpleNamespace(tcp=[conn("10.0.0.2:2", "10.0.0.1:1", 90 * MB, 0.004)]),
    }
    links = link_table(connection_rows(files, {0: "a", 1: "b"})).set_index("src_host")
    assert links.loc["a", "rate_gbps"] == pytest.approx(0.025)
    assert np.isnan(links.loc["b", "rate_gbps"]) and links.loc["b", "bytes"] == 90 * MB
