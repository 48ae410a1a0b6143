"""Horovod's own timeline (``HOROVOD_TIMELINE``), read and merged with hvtrace's analysis.

Horovod's coordinator (rank 0) writes a Chrome-trace JSON array: per tensor (a ``pid``, named
by a ``process_name`` metadata event such as ``allreduce.net.0.weight``) a ``NEGOTIATE_<OP>``
activity (from when the coordinator saw the first rank ready to when every rank was), with one
instant event per rank named by the rank when it became ready (only for negotiations outside
Horovod's response cache: the first time a tensor is reduced, or every time with
``HOROVOD_CACHE_CAPACITY=0``), then the operation (``ALLREDUCE``, ...) with nested activities:
the fusion-buffer copies (``MEMCPY_IN_FUSION_BUFFER``, ``MEMCPY_OUT_FUSION_BUFFER``) and the
transfer itself (``GLOO_ALLREDUCE``, ``NCCL_ALLREDUCE``, ``MPI_ALLREDUCE``, ...). Timestamps are
µs since the timeline started; the first metadata event holds that start as µs since the epoch.

:func:`read_timeline` reads such a file, also one cut off by a killed job (no closing bracket, a
half-written last event: everything before it is kept and the result says it is partial).
:func:`merge` puts it on rank 0's clock (the epoch start through rank 0's header anchors:
``CLOCK_REALTIME`` and ``CLOCK_MONOTONIC`` sampled together) and sums it per tensor: the
**negotiation** (waiting until the last rank was ready, and which rank that was) and the
**transfer**. It also compares the ranks' readiness order with hvtrace's own arrival (each rank's
enqueue of the same tensor, same occurrence).
"""

from __future__ import annotations

import codecs
import json
import math
import re
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Final

import numpy as np
import pandas as pd

#: Most bytes of a timeline read (a larger file is read up to this much and marked partial).
MAX_BYTES: Final = 2 << 30
#: Bytes read at a time: the text held while reading is about this much (plus the event at hand).
READ_BYTES: Final = 1 << 20
#: Longest one event may be (Horovod's are under 200 characters): a longer one ends the read
#: there, as an event that cannot be decoded does, and the events before it are kept.
MAX_EVENT_CHARS: Final = 16 << 20
#: Most activities, readiness events and activities still open kept from one timeline (each a
#: few packed integers while reading): a timeline with more is read up to there, marked partial.
#: A real one holds about 50 per step of a 10-tensor model: this is some 200,000 such steps.
MAX_KEPT: Final = 10_000_000
#: Most tensors (Horovod's ``pid``) tracked; the events of any further ones are left out, counted.
MAX_TENSORS: Final = 1 << 16
#: Most activities nested in one another on one tensor (Horovod nests 2 deep); deeper ones are
#: left out, counted (each deeper begin's end is the next end on that tensor).
MAX_DEPTH: Final = 32
#: Most distinct activity names (Horovod has a few dozen); further ones are shown as
#: :data:`OTHER_ACTIVITY`, counted.
MAX_ACTIVITY_NAMES: Final = 1 << 12
OTHER_ACTIVITY: Final = "(other)"
#: Activities that are the transfer itself (nested in the operation).
_TRANSFER = re.compile(r"^(GLOO|NCCL|MPI|CCL|DDL|ADASUM|ROCM|GPU)_")
#: Horovod notes a rank ready when its coordinator receives the rank's request, in cycles of
#: ``HOROVOD_CYCLE_TIME`` (a few ms): which rank was last is only comparable with hvtrace's
#: arrival when the ranks' enqueues are at least this far apart (``clear_*`` in the comparison).
CLEAR_SPREAD_NS: Final = 5_000_000
#: Longest tensor name kept.
MAX_NAME: Final = 300
#: Latest event time taken (µs since the timeline's start: about 31 years); a later, negative,
#: NaN or infinite ``ts`` (JSON allows ``NaN``, ``Infinity``, ``1e300``) is implausible.
MAX_TS_US: Final = 10**15


def _ts_us(value: Any) -> int | None:
    """An event's ``ts`` as whole µs, or None when it is not a plausible time."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return int(value) if 0 <= value <= MAX_TS_US else None


def _pid(value: Any) -> int | str | None:
    """An event's ``pid`` when it can name a track (an integer or a string), else None."""
    return value if isinstance(value, int | str) and not isinstance(value, bool) else None


class TimelineError(ValueError):
    """The file is not a Horovod timeline (the message names the file and what is wrong)."""


@dataclass
class Timeline:
    """A Horovod timeline, as read: ``activities`` (``tensor``, ``occ``: the k-th negotiation of
    that tensor, ``activity``, ``depth``: 0 for the negotiation and the operation, 1 for their
    parts, ``start_us``, ``end_us``) and ``ready`` (``tensor``, ``occ``, ``rank``, ``ts_us``: when
    each rank was ready, where Horovod recorded it). ``start_epoch_us``: the timeline's start.
    """

    path: Path
    start_epoch_us: int | None
    activities: pd.DataFrame
    ready: pd.DataFrame
    events: int
    partial: str = ""  # why the file was not read whole ("" when it was)
    problems: list[str] = field(default_factory=list)


def read_timeline(path: str | Path, max_bytes: int = MAX_BYTES) -> Timeline:
    """Read a Horovod timeline file; raise :class:`TimelineError` when it is not one.

    The file is read streaming, :data:`READ_BYTES` at a time: memory holds one buffer of text and
    what the analysis keeps (each activity and readiness as a few packed integers, see
    :class:`_Builder`), never the file's events as Python objects."""
    path = Path(path)
    try:
        f = open(path, "rb")  # noqa: SIM115 (closed below, also when reading fails)
    except OSError as exc:
        raise TimelineError(f"{path}: cannot read: {exc.strerror or exc}") from None
    build = _Builder()
    stream = _EventStream(f, max_bytes)
    partial = ""
    try:
        with f:
            for e in stream:
                if type(e) is dict:
                    build.add(e)
                else:
                    build.add_match(e)  # type: ignore[arg-type]
                if build.full:
                    partial = (
                        f"stopped after {stream.dicts} events: {MAX_KEPT} activities and "
                        "readiness events kept, the most one timeline keeps"
                    )
                    break
    except OSError as exc:
        raise TimelineError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if not partial and stream.truncated:
        partial = f"read the first {max_bytes} bytes only"
    if stream.cut and not partial:
        partial = "cut off (the job was killed?): " + stream.cut
    if not stream.dicts and stream.lead != "[":
        raise TimelineError(f"{path}: not a Horovod timeline (no JSON array of events)")
    return build.timeline(path, stream.dicts, partial)


#: Separators skipped between the events of the array.
_SEP = re.compile(r"[ \t\r\n,]*")
#: A JSON string without escapes (nor the control characters JSON forbids in one).
_STR = r'"([^"\\\x00-\x1f]*)"'
_SKIPPED_STR = r'"[^"\\\x00-\x1f]*"'
#: An event exactly as Horovod writes most of them (``{"ph": "E", "ts": 6041255, "pid": 23}``,
#: begins with a ``name``, readiness with ``"dur": 0``, cycle marks with ``"s": "g"``, an
#: operation's end with its ``dtype`` and ``shape``; times and pids as plain integers). Such an
#: event is read from the match (groups: ph, name, ts, pid) without building a dict; whatever
#: the pattern does not match exactly is decoded by :mod:`json`, so both give the same events.
_PLAIN = re.compile(
    r'\{"ph": ' + _STR
    + r'(?:, "name": ' + _STR + r")?"
    + r', "ts": (0|[1-9][0-9]{0,15})'
    + r'(?:, "pid": (0|[1-9][0-9]{0,17}))?'
    + r'(?:, "dur": 0)?'
    + r'(?:, "s": ' + _SKIPPED_STR + r")?"
    + r'(?:, "args": \{"dtype": ' + _SKIPPED_STR + r', "shape": ' + _SKIPPED_STR + r"\})?"
    + r"\}"
)  # fmt: skip


class _EventStream:
    """The events of a JSON array in a file, decoded one at a time from a bounded buffer.

    Iterating yields each event that is a JSON object (the array's other values are skipped);
    afterwards ``cut`` says why it stopped before the closing bracket ("" when it reached it),
    ``truncated`` whether the file is longer than ``max_bytes``, ``lead`` is its first character
    that is not white space and ``dicts`` the events yielded.
    The text is decoded as UTF-8 with undecodable bytes replaced, as a whole-file decode would
    be; an event is decoded from the buffer by :meth:`json.JSONDecoder.raw_decode`, and when the
    buffer ends inside it, the buffer grows (to :data:`MAX_EVENT_CHARS` at most) and the decode
    is tried again, so the events are exactly those of decoding the whole text at once."""

    def __init__(self, f: BinaryIO, max_bytes: int) -> None:
        self.f, self.left = f, max_bytes
        self.dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.buf, self.pos, self.eof = "", 0, False
        self.cut, self.truncated, self.lead = "", False, None
        self.dicts = 0

    def _fill(self, want: int = 0) -> None:
        """Append ``want`` (at least :data:`READ_BYTES`) more bytes of the file, decoded, to what
        is left of the buffer."""
        want = max(want, READ_BYTES)
        data = self.f.read(min(want, self.left)) if self.left > 0 else b""
        self.left -= len(data)
        if not data:
            self.eof = True
            if self.left <= 0:
                self.truncated = bool(self.f.read(1))
        text = self.dec.decode(data, final=self.eof)
        if self.lead is None:
            s = text.lstrip()
            self.lead = s[0] if s else None
        self.buf = self.buf[self.pos :] + text
        self.pos = 0

    def __iter__(self) -> Iterator[dict | re.Match]:
        decode, plain = json.JSONDecoder().raw_decode, _PLAIN.match
        while True:  # the array's opening bracket: the first one in the file
            i = self.buf.find("[", self.pos)
            if i >= 0:
                self.pos = i + 1
                break
            self.pos = len(self.buf)
            if self.eof:
                self.cut = "no opening bracket"
                return
            self._fill()
        while True:
            self.pos = _SEP.match(self.buf, self.pos).end()  # type: ignore[union-attr]
            if self.pos >= len(self.buf):
                if self.eof:
                    self.cut = "no closing bracket"
                    return
                self._fill()
                continue
            if self.buf[self.pos] == "]":
                return
            m = plain(self.buf, self.pos)
            if m is not None:  # most of Horovod's events: no dict built
                if m.end() - self.pos > MAX_EVENT_CHARS:
                    self.cut = self._too_long()
                    return
                self.pos = m.end()
                self.dicts += 1
                yield m
                continue
            try:
                obj, end = decode(self.buf, self.pos)
            except json.JSONDecodeError as exc:
                held = len(self.buf) - self.pos
                # the buffer may end inside the event (the error is then at its end, or in a
                # string not yet closed): read on, to MAX_EVENT_CHARS
                if not self.eof and (
                    len(self.buf) - exc.pos <= 32 or exc.msg.startswith("Unterminated string")
                ):
                    if held >= MAX_EVENT_CHARS:
                        self.cut = self._too_long()
                        return
                    self._fill(held)
                    continue
                self.cut = f"an incomplete event after {self.dicts} events"
                return
            except (ValueError, RecursionError):  # an integer too long, nesting too deep
                self.cut = f"an event that cannot be decoded after {self.dicts} events"
                return
            if end >= len(self.buf) and not self.eof:
                self._fill()  # a value ending where the buffer does may go on (a number)
                continue
            if end - self.pos > MAX_EVENT_CHARS:
                self.cut = self._too_long()
                return
            self.pos = end
            if isinstance(obj, dict):
                self.dicts += 1
                yield obj

    def _too_long(self) -> str:
        return f"an event longer than {MAX_EVENT_CHARS} characters after {self.dicts} events"


#: An event without the key.
_MISSING: Final = object()


def _text(value: Any, limit: int | None = None) -> str | None:
    """``str(value)[:limit]``, or None where a hostile value cannot be made a string."""
    if isinstance(value, str):
        return value[:limit]
    try:
        return str(value)[:limit]
    except (ValueError, RecursionError):  # nesting too deep for its repr
        return None


class _Builder:
    """Pairs each tensor's begin/end events into activities and collects the ranks' readiness,
    one event at a time (:meth:`add`), keeping each as packed integers (``array``): a tensor
    code, the occurrence, an activity-name code, the depth and the times.

    The events of a ``pid`` are paired whether or not its name was seen yet (each pid's pairing
    depends on its own events only); :meth:`timeline` then keeps the pids that some
    ``process_name`` event named, under the last name given, as reading the whole file first
    would. Bounds, each reported when reached: :data:`MAX_TENSORS` pids, :data:`MAX_DEPTH`
    nested activities per pid, :data:`MAX_ACTIVITY_NAMES` activity names, :data:`MAX_KEPT`
    activities, readiness events and open activities together (``full``: stop reading)."""

    def __init__(self) -> None:
        self.codes: dict[Any, int] = {}  # pid -> tensor code
        self.names: list[str | None] = []  # per code: the tensor's name (None: never named)
        self.stacks: list[list[tuple[int, int]]] = []  # per code: open (activity code, begin)
        self.occ: list[int] = []
        self.over: list[int] = []  # per code: begins past MAX_DEPTH still open
        # per code: ends without a begin, implausible times, ends before begins, too deep
        self.bad: list[int] = []
        self.implausible: list[int] = []
        self.backwards: list[int] = []
        self.deep: list[int] = []
        self.act_codes: dict[str, int] = {}
        self.acts_names: list[str] = []
        self.negotiate: list[bool] = []
        self.a_pid, self.a_occ, self.a_act = array("i"), array("i"), array("i")
        self.a_depth, self.a_start, self.a_end = array("h"), array("q"), array("q")
        self.r_pid, self.r_occ, self.r_rank, self.r_ts = (
            array("i"), array("i"), array("i"), array("q")
        )  # fmt: skip
        self.start_epoch: int | None = None
        self.room = MAX_KEPT  # activities, readiness and open activities that may still be kept
        self.full = False
        self.dropped_tensors = 0
        self.dropped_names = 0

    def _code(self, pid: int | str) -> int | None:
        code = self.codes.get(pid)
        if code is None:
            if len(self.names) >= MAX_TENSORS:
                self.dropped_tensors += 1
                return None
            code = self.codes[pid] = len(self.names)
            self.names.append(None)
            self.stacks.append([])
            for counts in (
                self.occ, self.over, self.bad, self.implausible, self.backwards, self.deep
            ):  # fmt: skip
                counts.append(0)
        return code

    def _activity(self, name: str) -> int:
        code = self.act_codes.get(name)
        if code is None:
            if len(self.acts_names) >= MAX_ACTIVITY_NAMES:
                self.dropped_names += 1
                name = OTHER_ACTIVITY
                code = self.act_codes.get(name)
                if code is not None:
                    return code
            code = self.act_codes[name] = len(self.acts_names)
            self.acts_names.append(name)
            self.negotiate.append(name.startswith("NEGOTIATE_"))
        return code

    def add(self, e: dict) -> None:
        """Take one event of the file (a decoded JSON object), in the file's order."""
        ph = e.get("ph")
        if ph == "M":
            if e.get("name") == "process_name":
                self._meta(e)
            return
        if isinstance(ph, str) and ph in ("B", "E", "X"):
            self.span(ph, _pid(e.get("pid")), _ts_us(e.get("ts")), e.get("name", _MISSING))

    def add_match(self, m: re.Match) -> None:
        """Take one event matched by :data:`_PLAIN` (what :meth:`add` does with its object)."""
        ph, name, ts, pid = m.groups()
        if ph in ("B", "E", "X"):
            ts = int(ts)
            self.span(
                ph,
                None if pid is None else int(pid),
                ts if ts <= MAX_TS_US else None,
                _MISSING if name is None else name,
            )

    def span(self, ph: str, pid: int | str | None, ts: int | None, name: Any) -> None:
        """A begin (``B``), end (``E``) or complete (``X``: a rank's readiness) event of a pid
        at ``ts`` (None: implausible); ``name``: its ``name`` value, or ``_MISSING``."""
        if pid is None:
            return
        c = self.codes.get(pid)
        if c is None:
            c = self._code(pid)
            if c is None:
                return
        if ts is None:  # NaN, Infinity, 1e300, negative, a string: left out, counted
            self.implausible[c] += 1
            return
        stack = self.stacks[c]
        if ph == "B":
            if len(stack) >= MAX_DEPTH:  # its end is then the first end that comes
                self.over[c] += 1
                self.deep[c] += 1
                return
            text = "?" if name is _MISSING else _text(name, 64)
            if text is None:
                text = "?"
            act = self.act_codes.get(text)
            if act is None:
                act = self._activity(text)
            if self.negotiate[act] and not stack:
                self.occ[c] += 1
            stack.append((act, ts))
            self.room -= 1
        elif ph == "E":
            if self.over[c]:
                self.over[c] -= 1
                return
            if not stack:
                self.bad[c] += 1
                return
            act, t0 = stack.pop()
            if ts < t0:  # an end before its begin: kept out of every figure
                self.room += 1
                self.backwards[c] += 1
                return
            self.a_pid.append(c)
            self.a_occ.append(self.occ[c])
            self.a_act.append(act)
            self.a_depth.append(len(stack))
            self.a_start.append(t0)
            self.a_end.append(ts)
        elif stack and self.negotiate[stack[-1][0]]:  # a rank's readiness
            text = None if name is _MISSING else _text(name)
            try:
                rank = int(text if text is not None else "?")
            except ValueError:
                return
            if 0 <= rank < 1 << 20:
                self.r_pid.append(c)
                self.r_occ.append(self.occ[c])
                self.r_rank.append(rank)
                self.r_ts.append(ts)
                self.room -= 1
        self.full = self.room <= 0

    def _meta(self, e: dict) -> None:
        args = e.get("args") if isinstance(e.get("args"), dict) else {}
        pid = _pid(e.get("pid"))
        if "name" in args and pid is not None:
            name = _text(args["name"], MAX_NAME)
            c = self._code(pid)
            if c is not None and name is not None:
                self.names[c] = name
        v = args.get("start_time_since_epoch_in_micros")
        if isinstance(v, int) and not isinstance(v, bool) and 0 < v < 1 << 62:
            self.start_epoch = v

    def timeline(self, path: Path, events: int, partial: str) -> Timeline:
        """The activities and readiness of the named pids, and the problems seen."""
        named = np.array([n is not None for n in self.names], dtype=bool)

        def total(counts: list[int]) -> int:
            return int(np.asarray(counts, dtype=np.int64)[named].sum()) if counts else 0

        problems: list[str] = []
        bad, implausible, backwards = (
            total(self.bad), total(self.implausible), total(self.backwards)
        )  # fmt: skip
        open_ = sum(len(s) + o for s, o, n in zip(self.stacks, self.over, named) if n)
        if bad:
            problems.append(f"{bad} end events without a begin")
        if implausible:
            problems.append(
                f"{implausible} events with an implausible time (not a number from 0 to "
                f"{MAX_TS_US:.0e} µs: NaN, Infinity, negative?) left out"
            )
        if backwards:
            problems.append(f"{backwards} activities ending before they began left out")
        if open_ and not partial:
            problems.append(f"{open_} activities never ended")
        deep = total(self.deep)
        if deep:
            problems.append(f"{deep} activities nested deeper than {MAX_DEPTH} left out")
        if self.dropped_tensors:
            problems.append(
                f"{self.dropped_tensors} events of tensors beyond the first {MAX_TENSORS} left out"
            )
        if self.dropped_names:
            problems.append(
                f"{self.dropped_names} activities named beyond the first {MAX_ACTIVITY_NAMES} "
                f"names shown as {OTHER_ACTIVITY!r}"
            )
        tensors = np.array([n or "" for n in self.names], dtype=object)
        activities = np.array(self.acts_names, dtype=object)
        a = self._frame(
            [("tensor", "a_pid"), ("occ", "a_occ"), ("activity", "a_act"), ("depth", "a_depth"),
             ("start_us", "a_start"), ("end_us", "a_end")],
            named, {"tensor": tensors, "activity": activities},
        )  # fmt: skip
        r = self._frame(
            [("tensor", "r_pid"), ("occ", "r_occ"), ("rank", "r_rank"), ("ts_us", "r_ts")],
            named, {"tensor": tensors},
        )  # fmt: skip
        return Timeline(path, self.start_epoch, a, r, events, partial, problems)

    def _frame(
        self, cols: list[tuple[str, str]], named: np.ndarray, lookup: dict[str, np.ndarray]
    ) -> pd.DataFrame:
        """The rows of named pids as a frame: per column, the attribute holding its packed
        values (the first: the tensor code), looked up in ``lookup`` (names) or as int64 (the
        dtypes pandas gives a list of tuples). Each packed array is let go once its column is
        made, so they and the frame are not held whole together."""
        code = np.frombuffer(getattr(self, cols[0][1]), dtype=np.int32)
        keep = named[code]
        if not keep.any():  # as pandas makes an empty frame of tuples: object columns
            return pd.DataFrame([], columns=[c for c, _ in cols])
        rows = None if keep.all() else np.flatnonzero(keep)
        del code, keep
        out: dict[str, np.ndarray] = {}
        for col, attr in cols:
            packed = getattr(self, attr)
            v = np.frombuffer(packed, dtype=np.dtype(packed.typecode))
            if rows is not None:
                v = v[rows]
            out[col] = lookup[col][v] if col in lookup else v.astype(np.int64)
            del v, packed
            setattr(self, attr, None)
        return pd.DataFrame(out)


def find_timeline(run_dir: Path, run_id: str) -> Path | None:
    """The Horovod timeline of a run: the one hvtrace started (``horovod-timeline-RUNID.json``),
    else a ``*.json`` file in the run directory that starts like one (a user's
    ``HOROVOD_TIMELINE`` pointed there). Symbolic links are not followed."""
    own = run_dir / f"horovod-timeline-{run_id}.json"
    if own.is_file() and not own.is_symlink():
        return own
    try:
        cands = sorted(p for p in run_dir.glob("*.json") if p.is_file() and not p.is_symlink())
    except OSError:
        return None
    for p in cands:
        try:
            with open(p, "rb") as f:
                head = f.read(512).decode("utf-8", errors="replace")
        except OSError:
            continue
        if head.lstrip().startswith("[") and "start_time_since_epoch_in_micros" in head:
            return p
    return None


def _tensor_key(horovod_name: str) -> str:
    """hvtrace's tensor name for Horovod's (``allreduce.net.0.weight`` -> ``net.0.weight``)."""
    for prefix in ("allreduce.", "grouped_allreduce.", "adasum."):
        if horovod_name.startswith(prefix):
            return horovod_name[len(prefix) :]
    return horovod_name


def merge(
    tl: Timeline,
    anchors: dict[str, int] | None,
    rank_starts: pd.DataFrame | Callable[[pd.DataFrame], pd.DataFrame] | None,
) -> dict:
    """Sum the timeline per tensor and compare its readiness with hvtrace's arrival.

    ``anchors``: rank 0's header ``mono_anchor_ns`` / ``wall_anchor_ns`` (None: the timeline
    stays on its own clock and is not compared); ``rank_starts``: hvtrace's gradient allreduce
    enqueues, columns ``rank``, ``name``, ``occ`` (k-th of that tensor on that rank),
    ``start_ns`` (rank 0's clock), or a function that returns them for the (``name``, ``occ``)
    pairs it is given (those whose last-ready rank Horovod noted). Returns the JSON-ready
    ``horovod_timeline`` section: ``merged``, ``file``, ``events``, ``partial``, ``clock``,
    ``offset_ns`` (add to a timeline µs × 1000 to get rank 0's monotonic ns), ``tensors`` (per
    tensor: ``name``, ``count``, ``negotiate_ms`` and ``transfer_ms`` medians, ``op_ms``,
    ``memcpy_ms``, ``last_rank`` and ``last_share`` where Horovod recorded readiness),
    ``arrival`` (``compared``, ``agree_share``: the share of negotiations whose last rank is
    hvtrace's last-arriving rank too; ``clear_compared`` and ``clear_agree_share``: the same
    over those whose enqueues were at least :data:`CLEAR_SPREAD_NS` apart; ``horovod_last`` and
    ``hvtrace_last``: rank -> count) and ``queue_ms`` (median time from rank 0's enqueue to
    Horovod's coordinator seeing it ready).
    """
    out: dict[str, Any] = {
        "merged": True,
        "file": tl.path.name,
        "events": tl.events,
        "partial": tl.partial,
        "problems": list(tl.problems),
    }
    offset = None
    if anchors and tl.start_epoch_us is not None:
        offset = (
            int(anchors["mono_anchor_ns"])
            - int(anchors["wall_anchor_ns"])
            + tl.start_epoch_us * 1000
        )
        out["clock"] = "aligned to rank 0 through its clock anchors (realtime and monotonic)"
    else:
        out["clock"] = "not aligned (no start time in the timeline, or no rank 0 header)"
    out["offset_ns"] = offset
    a = tl.activities
    top, negotiate = a["depth"] == 0, a["activity"].str.startswith("NEGOTIATE_")
    neg = _part(a, top & negotiate, ["activity"])
    ops = _part(a, top & ~negotiate)
    xfer = _part(a, (a["depth"] >= 1) & a["activity"].str.match(_TRANSFER.pattern))
    mem = _part(a, (a["depth"] >= 1) & a["activity"].str.startswith("MEMCPY_"), ["occ"])
    del top, negotiate
    ready = tl.ready.copy(deep=False)
    ready["name"] = _tensor_keys(ready["tensor"])
    last = _last_ready(ready)
    if callable(rank_starts):
        wanted = last[["name", "occ"]].drop_duplicates()
        rank_starts = rank_starts(wanted) if len(wanted) else None
    transfer_ms, op_ms = _medians(xfer), _medians(ops)
    memcpy_ms = _medians(mem.groupby(["name", "occ"])["dur_ms"].sum().reset_index())
    rows = []
    for name, g in neg.groupby("name", sort=False):
        lr = last[last["name"] == name]
        top = lr["rank"].value_counts()
        rows.append(
            {
                "name": name,
                "op": str(g["activity"].iloc[0]).removeprefix("NEGOTIATE_").lower(),
                "count": len(g),
                "negotiate_ms": float(g["dur_ms"].median()),
                "transfer_ms": transfer_ms.get(name),
                "op_ms": op_ms.get(name),
                "memcpy_ms": memcpy_ms.get(name),
                "last_rank": int(top.index[0]) if len(top) else None,
                "last_share": float(top.iloc[0] / len(lr)) if len(top) else None,
            }
        )
    rows.sort(key=lambda r: -(r["negotiate_ms"] * r["count"]))
    out["tensors"] = rows
    out["arrival"], out["queue_ms"] = _compare(last, ready, rank_starts, offset)
    return out


def _part(a: pd.DataFrame, rows: pd.Series, cols: Sequence[str] = ()) -> pd.DataFrame:
    """The activities of ``rows``: hvtrace's tensor ``name``, ``cols`` and ``dur_ms`` (only
    these columns are copied, and only for those rows)."""
    sub = a.loc[rows, ["tensor", *cols, "start_us", "end_us"]]
    return pd.DataFrame(
        {
            "name": _tensor_keys(sub["tensor"]),
            **{c: sub[c] for c in cols},
            "dur_ms": (sub["end_us"] - sub["start_us"]) / 1e3,
        }
    )


def _medians(df: pd.DataFrame) -> dict[str, float]:
    """The median ``dur_ms`` of each ``name`` (one pass over the rows, not one per name)."""
    if df.empty:
        return {}
    dur = df["dur_ms"]
    return {
        name: float(dur.iloc[idx].median())
        for name, idx in df.groupby("name", sort=False).indices.items()
    }


def _tensor_keys(tensors: pd.Series) -> pd.Series:
    """:func:`_tensor_key` of each row, computed once per distinct name."""
    return tensors.map({t: _tensor_key(t) for t in pd.unique(tensors)})


def _last_ready(ready: pd.DataFrame) -> pd.DataFrame:
    """Per (tensor, occurrence) with 2 or more ranks' readiness: the last rank and its time."""
    if ready.empty:
        return pd.DataFrame(columns=["name", "occ", "rank", "ts_us"])
    g = ready.groupby(["name", "occ"])
    many = g["rank"].transform("size") >= 2
    r = ready[many]
    if r.empty:
        return pd.DataFrame(columns=["name", "occ", "rank", "ts_us"])
    idx = r.groupby(["name", "occ"])["ts_us"].idxmax()
    return r.loc[idx.to_numpy(), ["name", "occ", "rank", "ts_us"]].reset_index(drop=True)


def _compare(
    last: pd.DataFrame, ready: pd.DataFrame, starts: pd.DataFrame | None, offset: int | None
) -> tuple[dict, float | None]:
    """Horovod's last-ready rank against hvtrace's last enqueue, per (tensor, occurrence)."""
    if starts is None or starts.empty or last.empty:
        return {"compared": 0}, None
    hv = starts.sort_values("start_ns")
    g = hv.groupby(["name", "occ"])
    idx = g["start_ns"].idxmax()
    hv_last = hv.loc[idx.to_numpy(), ["name", "occ", "rank"]].rename(columns={"rank": "hv_rank"})
    n_ranks = g["rank"].nunique().rename("n").reset_index()
    spread = (g["start_ns"].max() - g["start_ns"].min()).rename("spread_ns").reset_index()
    m = last.merge(hv_last, on=["name", "occ"]).merge(n_ranks, on=["name", "occ"])
    m = m.merge(spread, on=["name", "occ"])
    m = m[m["n"] >= 2]
    queue = None
    if offset is not None:
        r0 = ready[ready["rank"] == 0].merge(
            starts[starts["rank"] == 0][["name", "occ", "start_ns"]], on=["name", "occ"]
        )
        if len(r0):
            lag = (r0["ts_us"].to_numpy(np.float64) * 1000 + offset - r0["start_ns"]) / 1e6
            queue = float(np.median(lag))
    if m.empty:
        return {"compared": 0}, queue
    agree = (m["rank"] == m["hv_rank"]).to_numpy()
    clear = m["spread_ns"].to_numpy(np.float64) >= CLEAR_SPREAD_NS
    return (
        {
            "compared": len(m),
            "agree_share": float(agree.mean()),
            "clear_compared": int(clear.sum()),
            "clear_agree_share": float(agree[clear].mean()) if clear.any() else None,
            "horovod_last": {str(k): int(v) for k, v in m["rank"].value_counts().items()},
            "hvtrace_last": {str(k): int(v) for k, v in m["hv_rank"].value_counts().items()},
        },
        queue,
    )


def run_section(run: Any, sources: list, explicit: str | Path | None = None) -> dict:
    """The ``horovod_timeline`` section of a run's analysis ({} when it has none).

    ``explicit``: a timeline file given by the user (``hvtrace analyze --horovod-timeline``),
    else the run's own (:func:`find_timeline`). Problems reading it are in the section's
    ``problems`` (an unreadable file: ``merged`` false and the reason)."""
    path = Path(explicit) if explicit is not None else find_timeline(run.run_dir, run.run_id)
    if path is None:
        return {}
    try:
        tl = read_timeline(path)
    except TimelineError as exc:
        return {"merged": False, "file": path.name, "problems": [str(exc)]}
    h0 = run.files[0].header if 0 in run.files else None
    anchors = (
        {"mono_anchor_ns": h0["mono_anchor_ns"], "wall_anchor_ns": h0["wall_anchor_ns"]}
        if h0
        else None
    )
    out = merge(tl, anchors, lambda wanted: _hvtrace_starts(sources, wanted))
    out["path"] = str(path)
    return out


def _hvtrace_starts(sources: list, wanted: pd.DataFrame) -> pd.DataFrame:
    """hvtrace's enqueue of the (tensor, occurrence) pairs ``wanted`` on every rank, on rank 0's
    clock (one DuckDB query over the rank files: only those pairs come back)."""
    from hvtrace.analysis.engine import KIND_CODE_SQL, Engine, span_offsets
    from hvtrace.load import span_relation

    with Engine(threads=1) as eng:
        src, params, registered = span_relation(eng.con, sources, eng._names)
        eng.con.register("hv_wanted", wanted.astype({"occ": np.int64}))
        try:
            df = eng.con.execute(
                f"""WITH a AS (SELECT rank, step, name::VARCHAR AS name, start_ns,
                        row_number() OVER (PARTITION BY rank, name ORDER BY start_ns) AS occ
                    FROM ({src}) WHERE kind = 'allreduce')
                SELECT a.rank, a.step, a.name, a.occ, a.start_ns FROM a
                JOIN hv_wanted w ON a.name = w.name AND a.occ = w.occ""",
                params,
            ).df()
            # the spans of those (rank, step) cells, for the one alignment rule's anchors
            eng.con.register("hv_cells", df[["rank", "step"]].drop_duplicates())
            cells = eng.con.execute(
                f"""SELECT s.rank, s.step, {KIND_CODE_SQL} AS k, s.start_ns FROM ({src}) s
                JOIN hv_cells c ON s.rank = c.rank AND s.step = c.step""",
                params,
            ).df()
        finally:
            eng.con.unregister("hv_wanted")
            eng.con.unregister("hv_cells")
            eng._unregister(registered)
    _, offsets = span_offsets(
        sources, cells["rank"], cells["step"], cells["start_ns"], cells["k"].to_numpy()
    )
    off = df[["rank", "step"]].astype(np.int64).merge(offsets, on=["rank", "step"], how="left")
    df["start_ns"] = df["start_ns"].to_numpy(np.int64) - off["off_ns"].fillna(0).to_numpy(np.int64)
    return df.drop(columns=["step"])


def aligned_activities(path: str | Path, offset_ns: int) -> pd.DataFrame:
    """The timeline's activities on rank 0's clock (``offset_ns`` from :func:`merge`): columns
    ``tensor``, ``depth``, ``activity``, ``start_ns``, ``end_ns`` (for the merged timeline)."""
    a = read_timeline(path).activities
    return pd.DataFrame(
        {
            "tensor": a["tensor"],
            "depth": a["depth"],
            "activity": a["activity"],
            "start_ns": a["start_us"].to_numpy(np.int64) * 1000 + int(offset_ns),
            "end_ns": a["end_us"].to_numpy(np.int64) * 1000 + int(offset_ns),
        }
    )


@dataclass
class HorovodTracks:
    """Horovod's activities laid out as timeline tracks (for the exports, which only draw them):
    per tensor, in order of its first activity, a track ``horovod <tensor>`` (depth 0: the
    negotiation and the operation) and a child track ``parts`` (depth 1: fusion copies, the
    transfer). ``tensors``: the tensor names in that order; per slice ``tensor_idx``, ``depth``,
    ``activity``, ``start_ns`` and ``end_ns``, sorted by track then time. On one track a slice
    starts at the previous one's end at the earliest, so none overlap (times before 0 are drawn
    at 0)."""

    tensors: list[str]
    tensor_idx: np.ndarray
    depth: np.ndarray
    activity: list[str]
    start_ns: np.ndarray
    end_ns: np.ndarray

    def __len__(self) -> int:
        return len(self.start_ns)


def horovod_tracks(acts: pd.DataFrame, origin_ns: int = 0) -> HorovodTracks:
    """Lay out :func:`aligned_activities` (times minus ``origin_ns``) as :class:`HorovodTracks`."""
    if acts is None or acts.empty:
        z = np.zeros(0, np.int64)
        return HorovodTracks([], z, z.copy(), [], z.copy(), z.copy())
    first = acts.groupby("tensor", sort=False)["start_ns"].min().sort_values(kind="stable")
    tensors = [str(t) for t in first.index]
    idx = pd.Series(np.arange(len(tensors)), index=first.index)
    t_idx = idx.loc[acts["tensor"]].to_numpy(np.int64)
    depth = np.minimum(acts["depth"].to_numpy(np.int64), 1)
    begin = np.maximum(acts["start_ns"].to_numpy(np.int64) - int(origin_ns), 0)
    end = np.maximum(acts["end_ns"].to_numpy(np.int64) - int(origin_ns), begin)
    order = np.lexsort((begin, depth, t_idx))
    t_idx, depth, begin, end = t_idx[order], depth[order], begin[order], end[order]
    activity = acts["activity"].astype(str).to_numpy()[order].tolist()
    # per track, each slice starts at the latest end before it at the earliest
    track = t_idx * 2 + depth
    new = np.ones(len(track), bool)
    new[1:] = track[1:] != track[:-1]
    prev_end = np.concatenate([[0], end[:-1]])
    prev_end[new] = 0
    starts = np.flatnonzero(new)
    run_max = np.empty_like(prev_end)
    for a, b in zip(starts.tolist(), np.append(starts[1:], len(track)).tolist()):
        run_max[a:b] = np.maximum.accumulate(prev_end[a:b])  # one track (a few per tensor)
    begin = np.maximum(begin, run_max)
    end = np.maximum(end, begin)
    return HorovodTracks(tensors, t_idx, depth, activity, begin, end)
