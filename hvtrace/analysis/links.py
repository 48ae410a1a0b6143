"""Links between hosts: the rate each carried the job's data at, and the link that limits it.

Each rank's file holds the kernel's counters of its TCP connections (see
:mod:`hvtrace.record.netstat`). A connection's local address belongs to its rank's host, so the
ranks' files map addresses to hosts; a connection whose peer is another host's address is part
of the link from its host to that one. Per connection:

    rate = sent bytes / (busy time - time waiting for the receiver's window)

the rate the path carried its data at while it had data to carry (time spent waiting for the
receiver is the receiver's, not the link's). A ring allreduce runs at the pace of its slowest
link, so when the job's bus bandwidth comes close to the slowest link's rate, that link is the
limit: a slow link that stands out from the others limits the job from :data:`LINK_LIMIT_SHARE`
of its rate on, links that all run alike only when the job nearly saturates them
(:data:`SATURATED_SHARE`; TCP through a busy host's network stack is also slow on every link,
without a link being the limit), and never when the job's bus bandwidth beats the slowest
link's measured rate, or where the slow links are one host's, the best of them
(:data:`PLAUSIBLE_SHARE`: then the rates are not the links' capacity).
No link is named the limit either where a host at its ends is short of CPU (its ranks wait
for one; against a link that stands out, much longer than the other hosts' ranks): TCP through
a CPU-starved network stack is slow on any link. When the slow links all
touch one host, the host is named.
The two ends of a slow link cannot be told apart by its traffic: with two hosts, the link is
named by both ends.

A link's rate is the best rate one of its connections reached (connections sharing a link
each see their share while busy; none beats the link), and only host pairs that carried a good
part of the data (:data:`DATA_SHARE` of the busiest pair's bytes) get one: the limit is on the
path of the job's data. Connections to addresses that no rank's connections use locally (a
launcher, a file server) are left out; connections within a host too. Nothing in the files is
trusted: addresses are parsed, counters checked, and malformed entries skipped.
"""

from __future__ import annotations

import ipaddress
from typing import Any

import numpy as np
import pandas as pd

from hvtrace.analysis.stragglers import CONTENTION_STEP_SHARE

#: Columns of :func:`link_table`.
LINK_COLUMNS = [
    "src_host",
    "dst_host",
    "bytes",
    "busy_ms",
    "rate_gbps",
    "min_rtt_ms",
    "retrans",
    "connections",
    "ranks",
]
#: A host pair is on the path of the job's data when it carried at least this share of the
#: busiest pair's bytes (in a ring, every link carries the same).
DATA_SHARE = 0.5
#: A connection's rate counts once it was busy this long (the kernel counts in scheduler ticks).
MIN_BUSY_MS = 50.0
#: Links within this factor of the slowest one's rate are the slow links...
SLOW_LINK_FACTOR = 1.5
#: ... and they stand out when some measured link is this much faster than the slowest (TCP
#: rates through a CPU-starved network stack differ by up to 2x from link to link by chance).
STANDS_OUT_FACTOR = 2.5
#: A ring's bus bandwidth cannot beat its slowest link: a run whose bus bandwidth is above this
#: share of the slowest link's measured rate shows that the rates are not the links' capacity
#: (TCP held back by a busy CPU counts as busy), and no link is named the limit. Where the slow
#: links all run through one host (that host's link, in and out), each is a measurement of that
#: one link, and the bound is the best of them: two directions of a 200 Mbit/s link read 0.68
#: and 0.76 of it in one quiet run, the bus bandwidth 1.16 times the lower (29 Nov 2026).
PLAUSIBLE_SHARE = 1.15
#: A slow link that stands out (some measured link is :data:`SLOW_LINK_FACTOR` faster) limits
#: the job when the run's bus bandwidth reaches this share of its rate...
LINK_LIMIT_SHARE = 0.5
#: ... and where all links run alike, when it reaches this share (the links are saturated; below
#: it the allreduces are held back by something else: CPU, negotiation, the cycle time).
SATURATED_SHARE = 0.85
#: A host is short of CPU when its ranks wait for one this share of the step (the contention
#: finding's threshold)...
CPU_SHORT_SHARE = CONTENTION_STEP_SHARE
#: ... and, against a link that stands out, this many times as long as the other hosts.
CPU_SHORT_RATIO = 2.0
_MAX_COUNTER = 1 << 62


def _ip(addr: Any) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address part of ``ip:port`` or ``[ip6]:port``, or None when it is not one."""
    if not isinstance(addr, str) or len(addr) > 64:
        return None
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        return None
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def _counters(c: dict[str, Any]) -> tuple[int, int, int] | None:
    """``(sent_bytes, busy_us, rwnd_limited_us)`` of one entry, or None when implausible."""
    out = []
    for k in ("sent_bytes", "busy_us", "rwnd_limited_us"):
        v = c.get(k)
        if type(v) is not int or not 0 <= v < _MAX_COUNTER:
            return None
        out.append(v)
    return out[0], out[1], out[2]


def connection_rows(files: dict[int, Any], hosts: dict[int, str]) -> pd.DataFrame:
    """One row per (rank, connection) whose both ends are known rank hosts, different ones.

    ``files``: rank -> :class:`hvtrace.format.read.RankFile` (its ``tcp`` list); ``hosts``: rank ->
    host. Columns: ``rank``, ``src_host``, ``dst_host``, ``sent_bytes``, ``net_busy_us`` (busy
    time less the time waiting for the receiver), ``min_rtt_us``, ``retrans``.
    """
    parsed = []
    owner: dict[Any, set[str]] = {}
    for rank, f in files.items():
        host = hosts.get(rank)
        for c in getattr(f, "tcp", None) or []:
            if not isinstance(c, dict):
                continue
            local, peer, counts = _ip(c.get("local")), _ip(c.get("peer")), _counters(c)
            if local is None or peer is None or counts is None or host is None:
                continue
            parsed.append((rank, host, local, peer, counts, c))
            if not local.is_loopback:
                owner.setdefault(local, set()).add(host)
    # an address two hosts claim (NAT, containers with one address each) names no host
    where = {ip: next(iter(h)) for ip, h in owner.items() if len(h) == 1}
    rows = []
    for rank, host, _local, peer, (sent, busy, rwnd), c in parsed:
        dst = where.get(peer)
        if dst is None or dst == host or peer.is_loopback:
            continue
        rtt, retrans = c.get("min_rtt_us"), c.get("retrans")
        rows.append(
            (
                rank,
                host,
                dst,
                sent,
                max(busy - rwnd, 0),
                rtt if type(rtt) is int and 0 <= rtt < _MAX_COUNTER else np.nan,
                retrans if type(retrans) is int and 0 <= retrans < _MAX_COUNTER else 0,
            )
        )
    cols = ["rank", "src_host", "dst_host", "sent_bytes", "net_busy_us", "min_rtt_us", "retrans"]
    return pd.DataFrame(rows, columns=cols)


def link_table(conns: pd.DataFrame) -> pd.DataFrame:
    """One row per directed host pair that carried data (see the module docstring).

    ``conns``: :func:`connection_rows`. Columns: :data:`LINK_COLUMNS`. ``bytes``, ``retrans``
    and ``connections`` are over all the pair's connections. ``rate_gbps`` is the best rate one
    of its connections carried data at while busy (busy at least :data:`MIN_BUSY_MS`), and
    ``busy_ms`` that connection's busy time: connections that share a link each see their share
    of it while busy (a controller's small messages queued behind the bulk data see little), and
    none can beat the link. A pair that carried less than :data:`DATA_SHARE` of the busiest
    pair's bytes is not on the path of the job's data and gets no rate (NaN). Sorted by rate,
    slowest first.
    """
    if conns.empty:
        return pd.DataFrame({c: pd.Series(dtype=float) for c in LINK_COLUMNS})
    c = conns.assign(
        rate=np.where(
            conns["net_busy_us"] >= MIN_BUSY_MS * 1e3,
            conns["sent_bytes"] / (conns["net_busy_us"].clip(lower=1) * 1e3),
            np.nan,
        )
    )
    g = c.groupby(["src_host", "dst_host"], sort=True)
    # each pair's fastest connection (a pair whose connections were all too briefly busy: NaN)
    best = (
        c.sort_values("rate", ascending=False, na_position="last")
        .drop_duplicates(["src_host", "dst_host"])
        .set_index(["src_host", "dst_host"])
    )
    out = pd.DataFrame(
        {
            "bytes": g["sent_bytes"].sum().astype("int64"),
            "min_rtt_ms": g["min_rtt_us"].min() / 1e3,
            "retrans": g["retrans"].sum().astype("int64"),
            "connections": g.size().astype("int64"),
            "ranks": g["rank"].agg(lambda r: sorted({int(x) for x in r})),
        }
    )
    out["busy_ms"] = best["net_busy_us"].reindex(out.index) / 1e3
    out["rate_gbps"] = best["rate"].reindex(out.index)
    out = out.reset_index()
    data = out["bytes"] >= DATA_SHARE * float(out["bytes"].max())
    out["rate_gbps"] = out["rate_gbps"].where(data)
    out = out.sort_values(["rate_gbps", "bytes"], ascending=[True, False], na_position="last")
    return out[LINK_COLUMNS].reset_index(drop=True)


def limiting_link(
    links: pd.DataFrame, busbw_gbps: float, cpu_share: dict[str, float] | None = None
) -> dict[str, Any] | None:
    """The slowest measured link and whether it limits the job (None when none was measured).

    Keys: ``rate_gbps`` (the slowest link's), ``links`` (the slow ones, ``[src, dst]`` pairs:
    within :data:`SLOW_LINK_FACTOR` of it), ``stands_out`` (some measured link is
    :data:`STANDS_OUT_FACTOR` faster), ``host`` (the one host every slow link touches, when the
    slow links stand out; else None), ``busbw_share`` (the run's bus bandwidth over that rate)
    and ``limits`` (``busbw_share`` at least :data:`LINK_LIMIT_SHARE` where the slow links stand
    out, at least :data:`SATURATED_SHARE` where they do not, and the bus bandwidth at most
    :data:`PLAUSIBLE_SHARE` times the slowest link's rate, or the best of the slow links' where
    they are one host's), and ``cpu_short_hosts``: the slow links' hosts short of CPU, by
    ``cpu_share`` (host -> share of the step its ranks wait for a CPU:
    :func:`hvtrace.analysis.stragglers.host_contention`). TCP through a CPU-starved host is slow
    whatever the link, so with any such host no link ``limits``. Where the links run alike, a
    host is short of CPU from :data:`CPU_SHORT_SHARE` on; where slow links stand out, only when
    it also waits :data:`CPU_SHORT_RATIO` times as long as the other hosts (the median): hosts
    all short of CPU alike do not make one link slower than the others.
    """
    m = links[links["rate_gbps"].notna()] if len(links) else links
    if m.empty:
        return None
    slowest = float(m["rate_gbps"].min())
    slow = m[m["rate_gbps"] <= SLOW_LINK_FACTOR * slowest]
    common = set.intersection(*({s, d} for s, d in zip(slow["src_host"], slow["dst_host"])))
    stands_out = float(m["rate_gbps"].max()) >= STANDS_OUT_FACTOR * slowest
    host = next(iter(common)) if len(common) == 1 and stands_out else None
    share = busbw_gbps / slowest if np.isfinite(busbw_gbps) and slowest > 0 else float("nan")
    need = LINK_LIMIT_SHARE if stands_out else SATURATED_SHARE
    # the ring cannot beat the slow link: one host's link measured in and out, its best reading
    bound = PLAUSIBLE_SHARE * (float(slow["rate_gbps"].max()) if host is not None else slowest)
    ends = {h for s, d in zip(slow["src_host"], slow["dst_host"]) for h in (s, d)}
    starved = sorted(str(h) for h in ends if _cpu_short(h, cpu_share or {}, stands_out))
    return {
        "rate_gbps": slowest,
        "links": [[str(s), str(d)] for s, d in zip(slow["src_host"], slow["dst_host"])],
        "host": host,
        "stands_out": stands_out,
        "busbw_share": share,
        "cpu_short_hosts": starved,
        "limits": bool(
            np.isfinite(share) and need <= share and busbw_gbps <= bound and not starved
        ),
    }


def _cpu_short(host: str, share: dict[str, float], relative: bool) -> bool:
    mine = share.get(host, float("nan"))
    if not (np.isfinite(mine) and mine >= CPU_SHORT_SHARE):
        return False
    if not relative:
        return True
    others = [v for h, v in share.items() if h != host and np.isfinite(v)]
    return not others or mine >= CPU_SHORT_RATIO * float(np.median(others))


def link_words(lim: dict[str, Any]) -> str:
    """Where the slow link is, in words: "host hvc2's links (hvc1->hvc2, hvc2->hvc3)" or "the
    link between hvc1 and hvc2"."""
    pairs = lim["links"]
    if lim["host"] is not None:
        named = ", ".join(f"{s}->{d}" for s, d in pairs)
        return f"host {lim['host']}'s link ({named})"
    ends = sorted({h for p in pairs for h in p})
    if len(ends) == 2:
        return f"the link between {ends[0]} and {ends[1]}"
    return "the links " + ", ".join(f"{s}->{d}" for s, d in pairs)
