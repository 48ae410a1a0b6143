"""The one definition of hvtrace's trace format.

A trace file holds one rank's spans in one of two forms (see ``docs/format.md``):

* while recording, and after a crash: an Apache Arrow IPC *stream* (``.arrows``): a schema whose
  metadata key ``hvtrace`` carries the JSON header, then record batches appended by the writer
  thread every flush interval. A stream has no footer, so a file cut off at any byte still yields
  every complete batch before the cut.
* once closed cleanly (or compacted with ``hvtrace compact``): a Parquet file (``.parquet``) with
  the same columns, rows sorted by (step, start_ns), row groups of at most
  :data:`PARQUET_ROW_GROUP_ROWS` rows with min/max statistics, and the header and the merged batch
  status in the footer's key-value metadata (keys ``hvtrace`` and ``hvtrace.status``).

All times in a file are integers in nanoseconds on the rank's own monotonic clock
(``time.monotonic_ns()``; CUDA-timed spans are converted to that clock through an anchor event).
"""

from __future__ import annotations

from typing import Any, Final

import pyarrow as pa

FORMAT_NAME: Final = "hvtrace"
#: Version 2 added the ``cpu_ns`` and ``runq_ns`` columns; version 1 files are still read (those
#: columns are null there).
FORMAT_VERSION: Final = 2
#: Format versions this hvtrace reads.
READ_VERSIONS: Final[tuple[int, ...]] = (1, 2)
#: Suffix of the live (and crashed) form: an Arrow IPC stream.
FILE_SUFFIX: Final = ".arrows"
#: Suffix of the compacted form of a closed file: Parquet.
PARQUET_SUFFIX: Final = ".parquet"
#: Suffixes of every trace file form the loader reads.
TRACE_SUFFIXES: Final[tuple[str, ...]] = (FILE_SUFFIX, PARQUET_SUFFIX)
#: Most rows per Parquet row group (a reader skips whole row groups by their min/max ``step``).
PARQUET_ROW_GROUP_ROWS: Final = 32768
HEADER_KEY: Final = b"hvtrace"
#: Key of the JSON status that the writer attaches to each record batch (dropped counts, clock
#: samples, and ``final: true`` on the last batch of a cleanly closed file).
#: In a Parquet file the same key holds the status merged over all of the stream's batches.
BATCH_STATUS_KEY: Final = b"hvtrace.status"

#: Span kinds. The order is part of the format: files store the kind as a dictionary index.
KINDS: Final[tuple[str, ...]] = (
    "step",  # a whole optimizer step, from the end of the previous step to the end of this update
    "input",  # the gap before the first forward of a step (data loading, host work)
    "forward",  # the model's forward call (needs model=)
    "backward",  # from the gradient reaching the model output to the last gradient becoming ready
    "compute",  # forward+backward as one span when no model was given
    "allreduce",  # one gradient tensor: enqueued (gradient ready) -> reduced result observed
    "wait",  # time blocked in synchronize() waiting for allreduces (exposed communication)
    "update",  # the base optimizer's step()
    "user",  # hvtrace.span(name)
    "scalar",  # hvtrace.scalar(name, value): a point event, value in the value column
    "clock",  # a clock-offset estimate: value = offset to rank 0 in ns, bytes = uncertainty in ns
    # a Horovod collective issued outside the traced optimizer (hvd.allreduce, broadcast_object,
    # SyncBatchNorm, join, ...): name "<op>|<phase>|<tensor name>", value = ns blocked in it
    "collective",
)
KIND_CODE: Final[dict[str, int]] = {k: i for i, k in enumerate(KINDS)}
#: The phases of a step, in time order: the one list every part of hvtrace derives its own from.
#: They do not overlap each other (``compute`` stands for forward and backward without a model).
PHASE_KINDS: Final[tuple[str, ...]] = ("input", "forward", "backward", "compute", "wait", "update")
#: The spans of a step the recorder reads the training thread's counters over: the whole step,
#: then its phases in time order (``cpu_ns`` / ``runq_ns``; the analysis's cause phases).
STEP_PHASE_KINDS: Final[tuple[str, ...]] = ("step", *PHASE_KINDS)
#: One collective of the optimizer: the ``allreduce`` spans of one tensor (``name``) in one
#: ``step``, one on each rank (Horovod names a tensor's allreduce the same on every rank, and a
#: step issues it once). The one key every part of hvtrace pairs them by: the analysis' SQL and
#: its merges, the Chrome and Perfetto exports (:func:`collective_keys`).
COLLECTIVE_KEY: Final[tuple[str, str]] = ("step", "name")


def collective_keys(step: Any, tensor_code: Any) -> Any:
    """:data:`COLLECTIVE_KEY` as one int64 per span, for numpy readers: ``step`` and a code of
    its tensor's name that is the same on every rank (< 2**32). Keys sort by step, then code;
    equal keys are one collective."""
    import numpy as np

    s = np.asarray(step, dtype=np.int64)
    return s * np.int64(1 << 32) + np.asarray(tensor_code, dtype=np.int64)


#: Flag bits of the ``flags`` column.
FLAG_CUDA: Final = 1  # times come from CUDA events (device time), not the host clock
FLAG_END_UPPER_BOUND: Final = 2  # end is when the host observed completion, an upper bound
FLAG_OWN: Final = 4  # a collective hvtrace itself issued (clock handshake): not the user's
FLAG_AGREE: Final = 8  # a scalar that must be equal on every rank (hvtrace.scalar(agree=True))
#: Tensor name recorded for a collective that Lightning's Horovod strategy issued, unnamed, for
#: Lightning's own code: this prefix and the Lightning function (``lightning:ModelCheckpoint.
#: file_exists``; :func:`hvtrace.record.collectives.lightning_caller`).
LIGHTNING_PREFIX: Final = "lightning:"

#: Columns of a trace file, in order. ``name`` is dictionary-encoded with delta dictionaries.
FILE_SCHEMA: Final = pa.schema(
    [
        pa.field("step", pa.int32()),
        pa.field("micro", pa.int16()),  # backward pass within the step (backward_passes_per_step)
        pa.field("kind", pa.dictionary(pa.int8(), pa.string())),
        pa.field("name", pa.dictionary(pa.int32(), pa.string())),
        pa.field("start_ns", pa.int64()),
        pa.field("end_ns", pa.int64()),
        pa.field("bytes", pa.int64()),
        pa.field("dtype", pa.dictionary(pa.int8(), pa.string())),
        pa.field("value", pa.float64()),
        pa.field("flags", pa.uint8()),
        # The recording thread's CPU time during the span, and the time it was runnable but
        # waiting for a CPU (run queue), both in ns; null when not measured (allreduce, scalar and
        # clock rows; spans of version 1 files; a platform without per-thread scheduler counters).
        pa.field("cpu_ns", pa.int64()),
        pa.field("runq_ns", pa.int64()),
    ]
)
COLUMNS: Final[tuple[str, ...]] = tuple(FILE_SCHEMA.names)
#: The columns added by version 2 (absent from version 1 files: read as nulls).
V2_COLUMNS: Final[tuple[str, ...]] = ("cpu_ns", "runq_ns")
#: The columns of a version 1 file.
FILE_SCHEMA_V1: Final = pa.schema([f for f in FILE_SCHEMA if f.name not in V2_COLUMNS])

#: dtype names, in order (dictionary of the ``dtype`` column).
DTYPES: Final[tuple[str, ...]] = (
    "",
    "float32",
    "float16",
    "bfloat16",
    "float64",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "bool",
    "other",
)
DTYPE_CODE: Final[dict[str, int]] = {d: i for i, d in enumerate(DTYPES)}

#: Header fields every file must carry (more may be present).
REQUIRED_HEADER_FIELDS: Final[tuple[str, ...]] = (
    "format",
    "version",
    "run_id",
    "rank",
    "size",
    "host",
    "pid",
    "mono_anchor_ns",
    "wall_anchor_ns",
    "clock",
)


def dtype_name(torch_dtype: object) -> str:
    """Return the format's dtype name for a torch dtype (``"other"`` when not listed)."""
    name = str(torch_dtype).removeprefix("torch.")
    return name if name in DTYPE_CODE else "other"


#: Reserved scalar names (:mod:`hvtrace.record.consistency` records them, the analysis reads them
#: back): a parameter's fingerprint, a param group's learning rate, the value a plateau scheduler
#: is stepped with, a logged metric that must agree across ranks.
PARAM_PREFIX: Final = "hvtrace.param|"
LR_PREFIX: Final = "hvtrace.lr|"
MONITOR_PREFIX: Final = "hvtrace.monitor|"
METRIC_PREFIX: Final = "hvtrace.metric|"
#: A fingerprint of the batch the traced model's forward received, on the consistency checks'
#: schedule (:class:`hvtrace.record.consistency.BatchFingerprints`): ``hvtrace.batch|input``, the
#: first tensor argument. Unlike the names above, it must differ across ranks (each rank its own
#: shard): :mod:`hvtrace.analysis.antipatterns` compares it.
BATCH_PREFIX: Final = "hvtrace.batch|"
BATCH_NAME: Final = BATCH_PREFIX + "input"
#: Scalars whose value is a hash, not a quantity: no timeline draws them as a counter.
HASH_PREFIXES: Final = (PARAM_PREFIX, BATCH_PREFIX)
#: The share of a large embedding gradient's rows that were all zero, on the consistency checks'
#: schedule, for a gradient Horovod sends dense (:class:`hvtrace.record.consistency.ZeroRows`):
#: ``hvtrace.zero_rows|HOW|NAME``, ``HOW`` one of :data:`ZERO_ROWS_HOW`: ``dense`` (a dense
#: gradient, as ``nn.Embedding(sparse=False)`` makes: allreduced whole) or ``sparse_as_dense`` (a
#: sparse gradient that Horovod's optimizer turns dense, ``sparse_as_dense=True``). ``value``: the
#: share of the rows checked that were all zero in the averaged gradient, in [0, 1] (rows zero on
#: every rank: a lower bound of each rank's own); ``bytes``: the dense tensor's bytes, what each
#: rank sends for it every step. :mod:`hvtrace.analysis.gradients` reads them.
ZERO_ROWS_PREFIX: Final = "hvtrace.zero_rows|"
ZERO_ROWS_HOW: Final[tuple[str, ...]] = ("dense", "sparse_as_dense")
#: What :mod:`hvtrace.lightning` records of PyTorch Lightning's own state, as scalars (few rows:
#: the analysis reads them all, :mod:`hvtrace.analysis.framework`); every name starts with
#: :data:`LIGHTNING_ROWS`, and none is compared as a value that must agree:
#:
#: - :data:`LIGHTNING_STEP`: the Trainer's ``global_step`` as the step's ``training_step`` sees
#:   it, recorded where it is not the last row's value plus the hvtrace steps since (a row at the
#:   first step; one per global step with ``accumulate_grad_batches`` > 1; one after a checkpoint
#:   resumed): at hvtrace step ``s`` Lightning's step is ``value + s - step`` of the last row at
#:   or before ``s``.
#: - ``hvtrace.lightning|decision|CALLBACK|MONITOR``: a decision Lightning combines across ranks
#:   (``strategy.reduce_boolean_decision``: EarlyStopping's stop, any rank's; ModelCheckpoint's
#:   save of a monitored top-k, every rank's), one row per rank and decision: value the rank's
#:   own decision (1 or 0) plus 2 times the combined one, ``bytes`` the Trainer's ``global_step``;
#:   beside it ``hvtrace.lightning|decided_on|CALLBACK|MONITOR``, value the monitored value the
#:   rank's callback read.
#: - ``hvtrace.lightning|best|MONITOR|FILE``: a monitored ModelCheckpoint's best checkpoint on the
#:   rank when it changes (FILE the name of its ``best_model_path``), value ``best_model_score``,
#:   ``bytes`` the ``global_step``.
LIGHTNING_ROWS: Final = "hvtrace.lightning|"
LIGHTNING_STEP: Final = LIGHTNING_ROWS + "global_step"
DECISION_PREFIX: Final = LIGHTNING_ROWS + "decision|"
DECIDED_ON_PREFIX: Final = LIGHTNING_ROWS + "decided_on|"
BEST_CKPT_PREFIX: Final = LIGHTNING_ROWS + "best|"
#: The user span around one parameter check.
CHECK_SPAN: Final = "hvtrace.consistency"

#: Live detection's window matrix (what each rank reduces a window to and rank 0's judge reads,
#: :mod:`hvtrace.record.live`, :mod:`hvtrace.analysis.live`): one row per step of float64,
#: the step number, then per phase of :data:`LIVE_PHASES` its ns, CPU ns and run-queue ns, then
#: the step's arrival (its last gradient enqueued) in ns on rank 0's clock, then the step's counts
#: :data:`LIVE_COUNTS` (the step table's columns of the same names: the lockstep check's).
LIVE_PHASES: Final[tuple[str, ...]] = STEP_PHASE_KINDS
LIVE_ARRIVAL_COL: Final = 1 + 3 * len(LIVE_PHASES)
#: The counts of a step in the live matrix, from :data:`LIVE_COUNT_COL` on: the optimizer's
#: allreduces (tensors), the collectives issued outside it (hvtrace's own left out), the forward
#: and the backward passes.
LIVE_COUNTS: Final[tuple[str, ...]] = ("n_allreduce", "n_collective", "n_forward", "n_backward")
LIVE_COUNT_COL: Final = LIVE_ARRIVAL_COL + 1
LIVE_COLS: Final = LIVE_COUNT_COL + len(LIVE_COUNTS)
