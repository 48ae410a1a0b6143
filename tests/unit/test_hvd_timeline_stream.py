"""Horovod's timeline read streaming (issue 41): whatever the buffer, the same events as reading
the whole file; a cut, a hostile value or an oversized event gives one reason and keeps the
events before it; memory follows what is kept, not the file's size."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from hvtrace.analysis import hvd_timeline as hv
from hvtrace.analysis.hvd_timeline import merge, read_timeline

REPO = Path(__file__).resolve().parents[2]
#: Buffer sizes: a byte, a few bytes, less than one event, and the reader's own.
BUFFERS = (1, 3, 17, 64, hv.READ_BYTES)


def _bench():
    path = REPO / "bench" / "hvd_timeline_bench.py"
    spec = importlib.util.spec_from_file_location("hvd_timeline_bench", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _read(path: Path, buffer: int, monkeypatch: pytest.MonkeyPatch) -> hv.Timeline:
    monkeypatch.setattr(hv, "READ_BYTES", buffer)
    return read_timeline(path)


def _same(a: hv.Timeline, b: hv.Timeline) -> None:
    pd.testing.assert_frame_equal(a.activities, b.activities)
    pd.testing.assert_frame_equal(a.ready, b.ready)
    assert (a.events, a.partial, a.problems, a.start_epoch_us) == (
        b.events, b.partial, b.problems, b.start_epoch_us,
    )  # fmt: skip


def _events(text: str) -> int:
    """The JSON objects of an array's text up to the first that does not decode (a reference
    count, by decoding the whole text at once)."""
    dec, i, n = json.JSONDecoder(), text.index("[") + 1, 0
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return n
        try:
            obj, i = dec.raw_decode(text, i)
        except ValueError:
            return n
        n += isinstance(obj, dict)


@pytest.fixture(scope="module")
def real_like(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """120 steps of 6 tensors, 4 ranks, laid out as Horovod writes them (about 300 KB)."""
    path = tmp_path_factory.mktemp("tl") / "timeline.json"
    _bench().write_timeline(path, steps=120, tensors=6, ranks=4, cycles=10)
    return path


def test_a_timeline_longer_than_the_buffer_gives_every_activity(
    real_like: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    steps, tensors, ranks = 120, 6, 4
    text = real_like.read_text()
    whole = _read(real_like, hv.READ_BYTES, monkeypatch)
    # every activity of every step, paired as Horovod nested them; readiness on the first step
    counts = whole.activities["activity"].value_counts().to_dict()
    assert counts == {
        a: steps * tensors
        for a in ("NEGOTIATE_ALLREDUCE", "ALLREDUCE", "MEMCPY_IN_FUSION_BUFFER",
                  "GLOO_ALLREDUCE", "MEMCPY_OUT_FUSION_BUFFER")
    }  # fmt: skip
    assert len(whole.ready) == tensors * ranks and set(whole.ready["occ"]) == {1}
    # metadata: 2 + 2 per tensor; per step 10 cycle marks and 10 events per tensor
    assert whole.events == _events(text) == 2 + 2 * tensors + steps * (10 + 10 * tensors) + 24
    assert whole.partial == "" and whole.problems == []
    assert whole.activities.groupby("tensor")["occ"].max().eq(steps).all()
    assert (whole.activities["end_us"] >= whole.activities["start_us"]).all()
    for buffer in BUFFERS[:-1]:  # the buffer ends inside nearly every event
        _same(_read(real_like, buffer, monkeypatch), whole)


def test_horovods_own_layout_reads_as_json_does(tmp_path: Path) -> None:
    """The events as Horovod spaces them (read without building a dict) and the same events
    compact (decoded by json) give the same timeline."""
    ev = [json.loads(e) for e in _timeline_events()]
    spaced = tmp_path / "spaced.json"
    spaced.write_text("[\n" + ",".join(json.dumps(e) for e in ev) + "]")
    compact = tmp_path / "compact.json"
    compact.write_text("[" + ",".join(json.dumps(e, separators=(",", ":")) for e in ev) + "]")
    a, b = read_timeline(spaced), read_timeline(compact)
    assert len(a.activities) == 4 * 5 and len(a.ready) == 2
    _same(a, b)


def _timeline_events() -> list[str]:
    """Horovod's own text for one tensor reduced 4 times, readiness of 2 ranks on the first."""
    out = [
        '{"name": "process_name", "ph": "M", "pid": 0, "args": '
        '{"start_time_since_epoch_in_micros":1795824461551917}}',
        '{"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "allreduce.w"}}',
    ]
    for k in range(4):
        t = 1000 * k
        out += [
            f'{{"ph": "B", "name": "NEGOTIATE_ALLREDUCE", "ts": {t}, "pid": 1}}',
            *(
                [f'{{"ph": "X", "name": "{r}", "ts": {t + r}, "pid": 1, "dur": 0}}' for r in (0, 1)]
                if k == 0
                else []
            ),
            f'{{"ph": "i", "name": "CYCLE_START", "ts": {t + 2}, "s": "g"}}',
            f'{{"ph": "E", "ts": {t + 5}, "pid": 1}}',
            f'{{"ph": "B", "name": "ALLREDUCE", "ts": {t + 6}, "pid": 1}}',
            f'{{"ph": "B", "name": "MEMCPY_IN_FUSION_BUFFER", "ts": {t + 7}, "pid": 1}}',
            f'{{"ph": "E", "ts": {t + 8}, "pid": 1}}',
            f'{{"ph": "B", "name": "GLOO_ALLREDUCE", "ts": {t + 9}, "pid": 1}}',
            f'{{"ph": "E", "ts": {t + 40}, "pid": 1}}',
            f'{{"ph": "B", "name": "MEMCPY_OUT_FUSION_BUFFER", "ts": {t + 41}, "pid": 1}}',
            f'{{"ph": "E", "ts": {t + 42}, "pid": 1}}',
            f'{{"ph": "E", "ts": {t + 50}, "pid": 1, '
            '"args": {"dtype": "float32", "shape": "[256, 256]"}}',
        ]
    return out


def test_a_cut_anywhere_keeps_every_whole_event_before_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A killed job's file, cut at every byte of its events: what was written whole is read
    (as many events as decoding the prefix at once gives), with any buffer, and the cut is
    named (the events written before the cut are the same whichever buffer read them)."""
    text = "[\n" + ",".join(_timeline_events()) + "]"
    full = len(text.encode())
    p = tmp_path / "cut.json"
    for cut in range(text.index("{"), full - 1, 7):
        p.write_bytes(text.encode()[:cut])
        got = _read(p, 1 << 20, monkeypatch)
        assert got.partial.startswith("cut off (the job was killed?): "), (cut, got.partial)
        assert got.events == _events(text[:cut]), cut
        for buffer in (1, 5):
            _same(_read(p, buffer, monkeypatch), got)


@pytest.mark.parametrize(
    "bad",
    ["NaN", "Infinity", "-Infinity", "1e300", "-5", '"soon"', "1.006e3", "123456789012345678"],
)
def test_a_hostile_time_split_by_the_buffer_is_one_problem(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bad: str
) -> None:
    """A time that is not a plausible µs count, wherever the buffer splits it: that event left
    out and counted, the rest read (1.006e3 is a plausible time: kept, as µs 1006)."""
    ev = _timeline_events()
    i = next(k for k, e in enumerate(ev) if '"ts": 1006' in e)  # the 2nd ALLREDUCE begin
    ev[i] = ev[i].replace('"ts": 1006', f'"ts": {bad}')
    p = tmp_path / "t.json"
    p.write_text("[\n" + ",\n".join(ev) + "]")
    ref = _read(p, 1 << 20, monkeypatch)
    plausible = bad == "1.006e3"
    assert ref.partial == ""
    # the begin left out, the end that was its own has no begin
    assert ref.problems == (
        [] if plausible else [
            "1 end events without a begin",
            "1 events with an implausible time (not a number from 0 to 1e+15 µs: NaN, "
            "Infinity, negative?) left out",
        ]
    ), ref.problems  # fmt: skip
    assert ref.events == len(ev)
    assert len(ref.activities) == 4 * 5 - (0 if plausible else 1)
    assert 1006 in set(ref.activities["start_us"]) or not plausible
    for buffer in BUFFERS[:-1]:
        _same(_read(p, buffer, monkeypatch), ref)


@pytest.mark.parametrize(
    "hostile, why, longest",
    [
        ('{"a": ' * 50_000 + "1" + "}" * 50_000, "cannot be decoded", hv.MAX_EVENT_CHARS),
        ('{"ph": "X", "ts": ' + "9" * 5000 + "}", "cannot be decoded", hv.MAX_EVENT_CHARS),
        ('{"ph": "B", "name": "' + "x" * 3000 + '", "ts": 1, "pid": 1}', "longer than 1000", 1000),
        # a comma missing: known at once, not read on to the longest event
        ('{"ph": "B" "name": "x", "ts": 1, "pid": 1}', "an incomplete event", 200),
    ],
    ids=["nested-too-deep", "integer-too-long", "event-too-long", "malformed"],
)
def test_an_event_past_the_bounds_ends_the_read_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hostile: str, why: str, longest: int
) -> None:
    """JSON nested 50,000 deep, an integer of 5,000 digits, an event longer than the longest
    one decoded, a malformed one: the read ends there with the reason, the 10 events before it
    kept."""
    monkeypatch.setattr(hv, "MAX_EVENT_CHARS", longest)
    ev = _timeline_events()
    p = tmp_path / "t.json"
    p.write_text("[\n" + ",\n".join([*ev[:10], hostile, *ev[10:]]) + "]")
    for buffer in (64, 4096, 1 << 20):
        tl = _read(p, buffer, monkeypatch)
        assert tl.partial.startswith("cut off (the job was killed?): an ") and why in tl.partial
        assert tl.partial.endswith("after 10 events") and tl.events == 10
        assert list(tl.activities["activity"]) == [
            "NEGOTIATE_ALLREDUCE", "MEMCPY_IN_FUSION_BUFFER",
        ]  # fmt: skip
        assert merge(tl, None, None)["tensors"][0]["count"] == 1


def test_the_bounds_on_what_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Activities kept, nesting, tensors and activity names each stop at their bound, which
    the result names; the rest is read."""
    ev = [json.loads(e) for e in _timeline_events()]
    p = tmp_path / "t.json"
    p.write_text(json.dumps(ev))
    monkeypatch.setattr(hv, "MAX_KEPT", 7)
    tl = read_timeline(p)
    assert tl.partial.startswith("stopped after ") and "7 activities and readiness" in tl.partial
    assert len(tl.activities) + len(tl.ready) <= 7
    monkeypatch.setattr(hv, "MAX_KEPT", 10**6)

    deep = [ev[0], ev[1], *({"ph": "B", "name": f"L{d}", "ts": d, "pid": 1} for d in range(40))]
    deep += [{"ph": "E", "ts": 100, "pid": 1} for _ in range(40)]
    p.write_text(json.dumps(deep))
    tl = read_timeline(p)
    assert len(tl.activities) == hv.MAX_DEPTH and tl.activities["depth"].max() == 31
    assert tl.problems == ["8 activities nested deeper than 32 left out"]

    monkeypatch.setattr(hv, "MAX_TENSORS", 2)  # pid 1 and 2 kept; 3 and 4 left out
    many = [ev[0]]
    for pid in (1, 2, 3, 4):
        many += [
            {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"t{pid}"}},
            {"ph": "B", "name": "ALLREDUCE", "ts": 1, "pid": pid},
            {"ph": "E", "ts": 2, "pid": pid},
        ]
    p.write_text(json.dumps(many))
    tl = read_timeline(p)
    assert list(tl.activities["tensor"]) == ["t1", "t2"]
    assert tl.problems == ["6 events of tensors beyond the first 2 left out"]

    monkeypatch.setattr(hv, "MAX_ACTIVITY_NAMES", 3)
    names = [ev[0], ev[1]]
    for k in range(5):
        names += [
            {"ph": "B", "name": f"A{k}", "ts": k, "pid": 1},
            {"ph": "E", "ts": k, "pid": 1},
        ]
    p.write_text(json.dumps(names))
    tl = read_timeline(p)
    assert list(tl.activities["activity"]) == ["A0", "A1", "A2", "(other)", "(other)"]
    assert tl.problems == ["2 activities named beyond the first 3 names shown as '(other)'"]


def test_names_apply_as_if_the_whole_file_were_read_first(tmp_path: Path) -> None:
    """Events before their tensor's ``process_name``, a tensor renamed later, and a pid never
    named: as reading every event before pairing them would give."""
    ev = [
        {"ph": "B", "name": "ALLREDUCE", "ts": 1, "pid": 1},  # before pid 1 is named
        {"ph": "E", "ts": 2, "pid": 1},
        {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "first"}},
        {"ph": "B", "name": "ALLREDUCE", "ts": 3, "pid": 1},
        {"ph": "E", "ts": 4, "pid": 1},
        {"ph": "B", "name": "ALLREDUCE", "ts": 5, "pid": 9},  # pid 9: never named
        {"ph": "E", "ts": 6, "pid": 9},
        {"ph": "E", "ts": 7, "pid": 9},  # an end without a begin, of a pid never named
        {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "renamed"}},
    ]
    p = tmp_path / "t.json"
    p.write_text(json.dumps(ev))
    tl = read_timeline(p)
    assert list(tl.activities["tensor"]) == ["renamed", "renamed"]
    assert list(tl.activities["start_us"]) == [1, 3] and tl.problems == []


def test_memory_follows_what_is_kept_not_the_file(tmp_path: Path) -> None:
    """A 30 MB timeline (2,200 steps of 20 tensors) read and merged in a child process: its
    resident memory grows by less than the file's size (reading the whole file into dicts took
    about 18 times its size)."""
    path = tmp_path / "big.json"
    size = _bench().write_timeline(path, steps=2200, tensors=20, ranks=8)
    assert size > 25e6
    child = (
        "import resource, sys\n"
        "from hvtrace.analysis.hvd_timeline import read_timeline, merge\n"
        "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "tl = read_timeline(sys.argv[1])\n"
        "out = merge(tl, None, None)\n"
        "peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "print(len(tl.activities), (peak - base) * 1024)\n"
    )
    got = subprocess.run(
        [sys.executable, "-c", child, str(path)], capture_output=True, text=True, timeout=300
    )
    assert got.returncode == 0, got.stderr[-2000:]
    acts, grown = (int(x) for x in got.stdout.split())
    assert acts == 2200 * 20 * 5
    assert grown < size, (grown, size)
