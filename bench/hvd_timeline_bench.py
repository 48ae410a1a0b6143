"""Reading a Horovod timeline of any size: the streaming reader beside the whole-file one.

Writes (or reuses, ``--dir``) a synthetic Horovod timeline of N steps laid out as Horovod 0.28
writes one (``HOROVOD_TIMELINE`` with ``HOROVOD_TIMELINE_MARK_CYCLES=1``, as a real 2-rank Gloo
run of ``hvtrace.examples.train`` wrote it): ``[``, the start-time metadata, per tensor a
``process_name`` and ``process_sort_index`` metadata event, then per step and tensor a
``NEGOTIATE_ALLREDUCE`` begin as its gradient is ready (with one readiness event per rank on the
first step, outside Horovod's response cache, or on every step with ``--readiness all``, what
``HOROVOD_CACHE_CAPACITY=0`` gives), the negotiations' ends, then the fused operation in blocks of
all tensors: ``ALLREDUCE``, ``MEMCPY_IN_FUSION_BUFFER``, ``GLOO_ALLREDUCE``,
``MEMCPY_OUT_FUSION_BUFFER`` begins and ends, the operation's end with its ``dtype``/``shape``,
and ``CYCLE_START`` instant events between them; events comma-separated on few lines, as Horovod
writes them (it ends a line only after registering a tensor). With the defaults (20 tensors, 30
cycle marks per step) a step is about 12 KB, what the issue measured on a real job.

Then, each in a fresh child process, side by side in one invocation: the reader of this tree
(``new``: :func:`hvtrace.analysis.hvd_timeline.read_timeline` and ``merge``, what ``hvtrace
analyze`` does with a timeline) and the whole-file reader it replaced (``old``: the same module
at ``--baseline-rev``, taken from git into a temporary directory). For each: seconds, the child's
peak RSS (``getrusage``) and its RSS after its imports, the activities kept, and whether the
merged section is identical to the other reader's (a digest of its JSON).

    python bench/hvd_timeline_bench.py                                 # 2,000 / 20,000 steps
    python bench/hvd_timeline_bench.py --steps 2000,20000 --json hvd_timeline.json
    python bench/hvd_timeline_bench.py --steps 20000 --readers new --cut   # a killed job's file

``--variants N`` instead compares the two readers on N damaged copies of a timeline
(``--timeline PATH``, default a small synthetic one): cut anywhere, then some mutated with
hostile values (NaN, 1e300, deep nesting, an integer too long, bytes that are not UTF-8, stray
brackets and keys), each read by the new reader with buffers of 7 bytes, 64 bytes and 1 MiB: the
same activities, readiness, events, problems, partial reason and merged section as the old
reader's, or the copy is kept and counted (exit 1).

    python bench/hvd_timeline_bench.py --variants 300 --timeline horovod-timeline-RUN.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
#: The last commit whose reader read the whole file into memory (``f.read()``, every event a dict).
BASELINE_REV = "4433cc4bb79f2d93871cb0c09027e95ce65066ae"
START_US = 1_795_824_461_551_917


def write_timeline(
    path: Path,
    steps: int,
    tensors: int = 20,
    ranks: int = 8,
    cycles: int = 30,
    readiness: str = "first",
    step_us: int = 20_000,
    cut: bool = False,
    seed: int = 0,
) -> int:
    """Write a synthetic Horovod timeline of ``steps`` steps to ``path``; return its bytes."""
    rng = random.Random(seed)
    shapes = [("[256, 256]", "[256]")[k % 2] for k in range(tensors)]
    with open(path, "w") as f:
        f.write("[\n")
        f.write(
            '{"name": "process_name", "ph": "M", "pid": 0, "args": '
            f'{{"start_time_since_epoch_in_micros":{START_US}}}}},\n'
            '{"name": "process_sort_index", "ph": "M", "pid": 0, "args": {"sort_index": 0}},\n'
        )
        for k in range(tensors):
            pid = k + 1
            layer, kind = divmod(k, 2)
            name = f"allreduce.net.{2 * layer}.{('weight', 'bias')[kind]}"
            f.write(
                f'{{"name": "process_name", "ph": "M", "pid": {pid}, "args": '
                f'{{"name": "{name}"}}}},\n'
                f'{{"name": "process_sort_index", "ph": "M", "pid": {pid}, "args": '
                f'{{"sort_index": {pid}}}}},\n'
            )
        pids = range(1, tensors + 1)
        for s in range(steps):
            t = 2_500_000 + s * step_us + rng.randrange(200)
            out: list[str] = []
            every = max(1, step_us // max(cycles, 1))
            for c in range(cycles // 2):  # the forward's cycles, before any gradient
                out.append(f'{{"ph": "i", "name": "CYCLE_START", "ts": {t + c * every}, "s": "g"}}')
            t += (cycles // 2) * every
            with_ready = readiness == "all" or s == 0
            for pid in pids:  # gradients ready one after another in the backward
                t += rng.randrange(20, 60)
                out.append(f'{{"ph": "B", "name": "NEGOTIATE_ALLREDUCE", "ts": {t}, "pid": {pid}}}')
                if with_ready:
                    for r in range(ranks):
                        out.append(
                            f'{{"ph": "X", "name": "{r}", "ts": {t + r * rng.randrange(1, 40)}, '
                            f'"pid": {pid}, "dur": 0}}'
                        )
            for c in range(cycles - cycles // 2 - 1):
                out.append(f'{{"ph": "i", "name": "CYCLE_START", "ts": {t + c}, "s": "g"}}')
            t += rng.randrange(500, 3000)
            for phase in (None, "ALLREDUCE", "MEMCPY_IN_FUSION_BUFFER", None, "GLOO_ALLREDUCE",
                          None, "MEMCPY_OUT_FUSION_BUFFER", None):  # fmt: skip
                for pid in pids:
                    t += rng.randrange(0, 3)
                    if phase is None:
                        out.append(f'{{"ph": "E", "ts": {t}, "pid": {pid}}}')
                    else:
                        out.append(f'{{"ph": "B", "name": "{phase}", "ts": {t}, "pid": {pid}}}')
                t += rng.randrange(50, 2000) if phase == "GLOO_ALLREDUCE" else rng.randrange(5, 100)
            for pid in pids:
                t += rng.randrange(1, 5)
                out.append(
                    f'{{"ph": "E", "ts": {t}, "pid": {pid}, "args": {{"dtype": "float32", '
                    f'"shape": "{shapes[pid - 1]}"}}}}'
                )
            out.append(f'{{"ph": "i", "name": "CYCLE_START", "ts": {t + 20}, "s": "g"}}')
            f.write(",".join(out))
            f.write("," if s < steps - 1 or cut else "")
        if not cut:
            f.write("]")
        else:  # a killed job: half an event, no closing bracket
            f.write('{"ph": "B", "name": "NEGOTIATE_ALL')
    return path.stat().st_size


#: The child: imports a reader, reads and merges the timeline, prints one JSON line.
CHILD = r"""
import hashlib, importlib.util, json, resource, sys, time
def rss_mb():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) / 1024
src, path = sys.argv[1], sys.argv[2]
if src == "new":
    from hvtrace.analysis import hvd_timeline as m
else:
    spec = importlib.util.spec_from_file_location("old_hvd_timeline", src)
    m = sys.modules["old_hvd_timeline"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
base = rss_mb()
t = time.perf_counter()
tl = m.read_timeline(path)
read_s = time.perf_counter() - t
out = m.merge(tl, {"mono_anchor_ns": 5_000_000_000, "wall_anchor_ns": 1_795_824_461_000_000_000},
              None)
s = time.perf_counter() - t
digest = hashlib.sha256(json.dumps(out, sort_keys=True, default=str).encode()).hexdigest()[:12]
print(json.dumps({"s": s, "read_s": read_s, "peak_mb": resource.getrusage(
    resource.RUSAGE_SELF).ru_maxrss / 1024, "base_mb": base, "activities": len(tl.activities),
    "ready": len(tl.ready), "events": tl.events, "partial": tl.partial, "digest": digest}))
"""


def old_reader(rev: str, into: Path) -> Path:
    """The reader at ``rev``, written to a file under ``into``."""
    src = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{rev}:hvtrace/analysis/hvd_timeline.py"],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    p = into / "old_hvd_timeline.py"
    p.write_text(src)
    return p


def measure(reader: str, path: Path, timeout: float) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.run(
        [sys.executable, "-c", CHILD, reader, str(path)],
        capture_output=True, text=True, env=env, timeout=timeout,
    )  # fmt: skip
    if p.returncode:
        return {"error": (p.stderr.strip().splitlines() or ["?"])[-1][:200]}
    return json.loads(p.stdout.strip().splitlines()[-1])


#: Text put into a timeline by :func:`variants` (hostile values, JSON punctuation, bytes that
#: are not UTF-8, half a character, deep nesting, an integer too long, Horovod's own keys).
TOKENS = [
    b"NaN", b"Infinity", b"1e300", b"-1", b'"x"', b"{", b"}", b"[", b"]", b",", b"\xff",
    b"\xe2\x82", b"9" * 5000, b'{"a":' * 3000, b'"pid": 3', b'"ph": "E"', b'"ph": "B"', b"\n",
    b"  ", b'"process_name"', b'"name": "NEGOTIATE_X"', b"\\u005f", b"0.5", b"true", b"null",
]  # fmt: skip


def variants(data: bytes, n: int, seed: int = 1) -> Iterator[tuple[str, bytes]]:
    """``n`` damaged copies of a timeline: cut anywhere, and cut then mutated (tokens of
    :data:`TOKENS` inserted, bytes deleted or changed), some given a closing bracket."""
    rng = random.Random(seed)
    yield "whole", data
    for k in range(n):
        b = bytearray(data[: rng.randrange(1, len(data))])
        if k % 3:
            for _ in range(rng.randrange(1, 6)):
                i = rng.randrange(len(b))
                r = rng.random()
                if r < 0.4:
                    b[i:i] = rng.choice(TOKENS)
                elif r < 0.7:
                    del b[i : i + rng.randrange(1, 20)]
                else:
                    b[i] = rng.randrange(256)
            if rng.random() < 0.3:
                b += b"]"
        yield f"variant {k}", bytes(b)


def compare_variants(old_src: Path, data: bytes, n: int, where: Path) -> int:
    """Read :func:`variants` of ``data`` with the old reader and with this tree's (buffers of
    7 bytes, 64 bytes and the default): the same activities, readiness, event count, partial
    reason, problems, start time and merged section. Returns the number that differ."""
    import importlib.util

    import pandas as pd

    from hvtrace.analysis import hvd_timeline as new

    spec = importlib.util.spec_from_file_location("old_hvd_timeline", old_src)
    old = sys.modules["old_hvd_timeline"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)  # type: ignore[union-attr]
    anchors = {"mono_anchor_ns": 5, "wall_anchor_ns": 7}

    def result(mod: Any, path: Path) -> Any:
        try:
            tl = mod.read_timeline(path)
        except mod.TimelineError as exc:
            return ("error", str(exc))
        merged = json.dumps(mod.merge(tl, anchors, None), sort_keys=True, default=str)
        return tl, merged

    def same(a: Any, b: Any) -> bool:
        if isinstance(a[0], str) or isinstance(b[0], str):
            return a == b
        try:
            pd.testing.assert_frame_equal(a[0].activities, b[0].activities)
            pd.testing.assert_frame_equal(a[0].ready, b[0].ready)
        except AssertionError:
            return False
        keys = ("start_epoch_us", "events", "partial", "problems")
        return [getattr(a[0], k) for k in keys] == [getattr(b[0], k) for k in keys] and (
            a[1] == b[1]
        )

    path, differ, default = where / "variant.json", 0, new.READ_BYTES
    try:
        for k, (label, blob) in enumerate(variants(data, n)):
            path.write_bytes(blob)
            want = result(old, path)
            for buffer in (7, 64, default):
                new.READ_BYTES = buffer
                if not same(want, result(new, path)):
                    differ += 1
                    keep = where / f"differs-{k}.json"
                    keep.write_bytes(blob)
                    print(f"{label} (buffer {buffer}): differs; kept as {keep}")
                    break
    finally:
        new.READ_BYTES = default
    print(f"{n + 1} timelines compared, {differ} differ")
    return differ


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", default="2000,20000", help="comma-separated step counts")
    ap.add_argument("--tensors", type=int, default=20)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--cycles", type=int, default=30, help="CYCLE_START marks per step")
    ap.add_argument("--readiness", choices=("first", "all"), default="first")
    ap.add_argument("--cut", action="store_true", help="no closing bracket, half an event")
    ap.add_argument("--readers", default="old,new", help="old, new or both")
    ap.add_argument("--baseline-rev", default=BASELINE_REV)
    ap.add_argument("--dir", type=Path, help="where the timelines are written (kept)")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--json", type=Path)
    ap.add_argument(
        "--variants",
        type=int,
        default=0,
        metavar="N",
        help="instead: compare the old and new readers on N damaged copies of --timeline",
    )
    ap.add_argument(
        "--timeline",
        type=Path,
        help="for --variants: a timeline (default: 40 steps of 6 tensors written here)",
    )
    args = ap.parse_args(argv)
    if args.variants:
        with tempfile.TemporaryDirectory(prefix="hvtl-variants-") as tmp:
            where = args.dir or Path(tmp)
            where.mkdir(parents=True, exist_ok=True)
            src = args.timeline
            if src is None:
                src = where / "timeline.json"
                write_timeline(src, 40, tensors=6, ranks=4, cycles=6)
            old = old_reader(args.baseline_rev, Path(tmp))
            return 1 if compare_variants(old, src.read_bytes(), args.variants, where) else 0
    readers = [r.strip() for r in args.readers.split(",") if r.strip()]
    rows = []
    with tempfile.TemporaryDirectory(prefix="hvtl-bench-") as tmp:
        where = args.dir or Path(tmp)
        where.mkdir(parents=True, exist_ok=True)
        src = {"new": "new", "old": str(old_reader(args.baseline_rev, Path(tmp)))}
        print(
            f"{'steps':>7} {'MB':>7} {'reader':>6} {'s':>7} {'read s':>7} {'peak MB':>8} "
            f"{'base MB':>8} {'activities':>10} {'same':>5}  partial"
        )
        for steps in (int(x) for x in args.steps.split(",")):
            path = where / (
                f"timeline-{steps}x{args.tensors}-{args.readiness}{'-cut' if args.cut else ''}.json"
            )
            if not path.exists():
                t = time.perf_counter()
                write_timeline(path, steps, args.tensors, args.ranks, args.cycles,
                               args.readiness, cut=args.cut)  # fmt: skip
                print(f"# wrote {path} in {time.perf_counter() - t:.1f} s", file=sys.stderr)
            mb = path.stat().st_size / 1e6
            got = {r: measure(src[r], path, args.timeout) for r in readers}
            digests = {g.get("digest") for g in got.values()}
            for r, g in got.items():
                row = {"steps": steps, "mb": round(mb, 1), "reader": r, **g}
                rows.append(row)
                if "error" in g:
                    print(f"{steps:>7} {mb:>7.1f} {r:>6}  error: {g['error']}")
                    continue
                same = "yes" if len(digests) == 1 and len(got) > 1 else "-"
                print(
                    f"{steps:>7} {mb:>7.1f} {r:>6} {g['s']:>7.2f} {g['read_s']:>7.2f} "
                    f"{g['peak_mb']:>8.0f} {g['base_mb']:>8.0f} {g['activities']:>10} "
                    f"{same:>5}  {g['partial'][:40]}"
                )
            if not args.dir:
                path.unlink()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
