"""What an analysis produces: the :class:`Analysis` of a run, the :class:`RankState` of each
rank's recording and the :class:`Finding` lines.

Data only: :mod:`hvtrace.analysis.summary` fills an Analysis, :mod:`hvtrace.analysis.findings`
reads it to make its findings, and the renderers (report, dashboard) show it. So the imports run
one way, model <- findings <- summary, and none of them needs the other at type-checking time.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from hvtrace.analysis.steps import analyzed_steps
from hvtrace.format.schema import LIGHTNING_PREFIX
from hvtrace.selection import StepRange


@dataclass(frozen=True)
class FindingKind:
    """What one kind of finding says about a job: when it is raised (``means``), what its
    ``cost`` figure is, and what to do about it (``action``). The documentation's list of findings
    (``docs/findings.md``) is generated from :data:`FINDING_KINDS`, and a test checks that every
    kind the analysis can raise is in it."""

    title: str
    severity: str
    means: str
    cost: str
    action: str


#: Every kind of :class:`Finding` the analysis raises, in the order the report lists them when
#: all are present (correctness first), with what each means, costs and asks for.
FINDING_KINDS: dict[str, FindingKind] = {
    "hang": FindingKind(
        "A hang",
        "warning",
        "Ranks waited in synchronize() (or in a collective) for HVTRACE_STALL_S seconds or more "
        "and the job never got past it: the run's files end in the wait. The finding names the "
        "ranks that waited, the ranks that never arrived (stopped, deadlocked, or skipped a "
        "collective the others issued), the step and the first tensor waited for; where one "
        "rank issued a collective the others did not (or skipped one they issued), it says "
        "which and in what phase.",
        "None in time: the job stopped. `data.waited_s` is how long the ranks had waited.",
        "Look at what the ranks that never arrived were doing (their last spans in the timeline, "
        "a stack dump of the process); a collective issued by some ranks only (a metric "
        "averaged on rank 0 alone, a callback that runs on one rank) must be issued by every "
        "rank, in the same order.",
    ),
    "stall": FindingKind(
        "A stall the job got past",
        "warning",
        "Ranks waited HVTRACE_STALL_S seconds or more in synchronize() for the others, and the "
        "job went on afterwards.",
        "The time waited (`value`, seconds).",
        "Find what the late ranks did at that step (checkpoint, evaluation, data loading on one "
        "rank, a slow file system); do it on every rank at once or off the training loop.",
    ),
    "lockstep": FindingKind(
        "Ranks out of lockstep",
        "warning",
        "The ranks stopped taking the same steps: a rank whose file was closed cleanly stopped "
        "at an earlier step than the others (and, if it called hvd.join, left them training "
        "alone), or, at the first step every rank recorded whole, a rank issued a different "
        "number of gradient allreduces or other collectives (a step with no backward and no "
        "allreduce is a skipped step). Horovod does not check this: from there on the ranks' "
        "collectives pair with other steps' and their models part, often with exit 0.",
        "None in time: the training is wrong from that step on. `data.step` is the step, "
        "`data.ranks` the ranks that did differently.",
        "Take every decision that changes the step sequence (stop early, skip a batch, "
        "accumulate) on every rank, from a value reduced across ranks (an averaged metric), "
        "never on one rank's own view.",
    ),
    "accumulation": FindingKind(
        "Gradient accumulation that does not accumulate",
        "warning",
        "The optimizer was built to accumulate gradients over N backward passes "
        "(backward_passes_per_step; Lightning's accumulate_grad_batches), but its steps held "
        "fewer: it updated, and allreduced every gradient, after each micro-batch. Under "
        'pytorch-lightning 1.9\'s strategy="horovod" accumulate_grad_batches always does this.',
        "`value`: how many times the allreduces and updates of accumulating the job did; "
        "`data.lost_ms_per_step`: the median wait and update time of the extra updates, per "
        "step.",
        "Call optimizer.step() once every N backward passes (plain Horovod); under Lightning's "
        "Horovod strategy use accumulate_grad_batches=1 and a larger batch per rank.",
    ),
    "callback_decision": FindingKind(
        "A Lightning callback that decided on one rank's view",
        "warning",
        "EarlyStopping or a monitored ModelCheckpoint read a metric that differs across ranks "
        "(not averaged), the ranks' own decisions differed, and Lightning's combined decision "
        "(stop when any rank says so, save when every rank does) rested on some ranks' values.",
        "None in time: the job stopped, or kept or dropped a checkpoint, on part of the ranks' "
        "view. `data.ranks`: the ranks whose own decision it was, `data.values` each rank's "
        "value.",
        "Average the monitored value across ranks (hvd.allreduce) before logging it.",
    ),
    "best_checkpoint": FindingKind(
        "Ranks with different best checkpoints",
        "warning",
        "A monitored ModelCheckpoint ended with a different best_model_path on different ranks: "
        "each rank ranked the checkpoints by its own value of a metric that differs across "
        "ranks.",
        "None in time: loading the best checkpoint loads a different model on each rank. "
        "`data.files`: each rank's best file.",
        "Average the monitored value across ranks (hvd.allreduce) before logging it.",
    ),
    "divergence": FindingKind(
        "Ranks that stopped training the same model",
        "warning (info when only monitored values differ)",
        "The ranks' parameter fingerprints, learning rates, or values marked with "
        "`hvtrace.scalar(..., agree=True)` (Lightning: logged metrics, ReduceLROnPlateau's "
        "input) differ at a step. `data.step` is the first such step; `data.names` the tensors. "
        "Differing parameters at step 0 mean `hvd.broadcast_parameters` is missing.",
        "None in time: the job's result is wrong from that step on.",
        "Broadcast the parameters and the optimizer state from rank 0 before training; reduce "
        "metrics before a decision every rank takes (learning-rate schedules, early stopping); "
        "give every rank the same learning rate.",
    ),
    "unsharded_data": FindingKind(
        "Ranks that train on the same batches",
        "warning",
        "At step 0 and at each consistency check (`consistency_every`), every rank records a "
        "fingerprint of the batch its model's forward received (its first tensor argument: up "
        "to 64 elements at fixed positions, with the shape; needs `model=`). Ranks whose "
        "fingerprints are equal at every checked step after the first (two checks at least) "
        "trained on the same batches: each computed the same gradients, and the average of "
        "several ranks' gradients is one batch's. The usual cause is a DataLoader without a "
        "`DistributedSampler`, or synthetic data drawn from the same seed on every rank. Data "
        "meant to be the same on every rank cannot be told apart, so the finding names it as "
        "the likely cause. `data.groups` lists the groups of ranks with equal batches and the "
        "first step each was seen.",
        "The share of the job's compute spent on duplicate batches, `data.wasted_share` = 1 - "
        "(different batch sequences) / ranks: 4 ranks on the same batches did the work of 1, "
        "75 % wasted.",
        "Shard the data: `DistributedSampler(dataset, num_replicas=hvd.size(), rank=hvd.rank())` "
        "as the DataLoader's sampler, and `sampler.set_epoch(epoch)` at each epoch; for "
        "generated data, seed each rank's generator with its rank.",
    ),
    "incomplete": FindingKind(
        "An incomplete run",
        "warning",
        "A rank's file was cut off (crashed or killed) or not closed cleanly, or a rank has no "
        "usable file. The run is analyzed over the steps every rank completed.",
        "None in time: what is missing is said (rank, last step).",
        "Look at the stopped rank's log; `hvtrace compact RUN_DIR` turns the streams of killed "
        "ranks into Parquet files.",
    ),
    "dropped": FindingKind(
        "Spans dropped by the recorder",
        "warning",
        "A rank's writer thread fell behind and its buffer (HVTRACE_BUFFER_SPANS) filled: the "
        "spans that did not fit were dropped and counted. That rank's figures undercount.",
        "None in time; `value` is the number of spans dropped.",
        "Raise HVTRACE_BUFFER_SPANS, or lower HVTRACE_FLUSH_S so the writer drains more often; "
        "a rank short of CPU writes more slowly.",
    ),
    "reset": FindingKind(
        "An elastic reset",
        "warning when a worker left, info when workers only joined",
        "Under `hvd.elastic.run` the membership changed: which workers, ranks and hosts left or "
        "joined, at what step, the steps replayed from the last commit and how long training "
        "stood still.",
        "`data.lost_s`: the stall plus the replayed steps at the epoch's median step time.",
        "Commit the state more often (fewer replayed steps); find why the worker left (its log, "
        "the host).",
    ),
    "straggler": FindingKind(
        "A straggler",
        "warning; info when it costs under 2 % of the run",
        "A rank is the last to have its gradients ready in a clear majority of steps, by more "
        "than a balanced run's noise, and its own phases explain that lateness (or one of its "
        "phases is consistently slower than the other ranks'). The finding names the phase and "
        "the cause: **work** (more CPU time), **blocked** (sleep, I/O, a lock, a queue), or, as "
        "their own kinds, contention and a slower processor.",
        "What a what-if replay of every step with this rank working like the others saves "
        "(`data.lost_ms_per_step`, `data.lost_share`); 'up to' where its host is short of CPU.",
        "By cause: give every rank the same work (data shards, batch sizes); move blocking I/O "
        "off the training loop (prefetch, more DataLoader workers, checkpoints in another "
        "thread).",
    ),
    "slow_processor": FindingKind(
        "A rank that runs slower throughout",
        "warning; info when it costs under 2 % of the run",
        "A rank is late (as a straggler is) but the excess of its slow phase is the slowdown it "
        "shows in every other phase too, the update included (the same optimizer step on every "
        "rank), 5 % or more: the same work on a slower, shared or throttled processor, not more "
        "work. `data.speed_ratio`: the median ratio of its other phases' own time to the "
        "other ranks'.",
        "As for a straggler: the what-if replay with this rank working like the others.",
        "Compare its host and core with the others': steal time on a VM (top, vmstat), a busy "
        "SMT sibling, clocks and thermal throttling; move the rank to another core or host.",
    ),
    "slow_host": FindingKind(
        "A slow host",
        "warning; info when it costs under 2 % of the run",
        "All the ranks of one host arrive late: the host, not its ranks one by one, is named, "
        "with the slow phase.",
        "As for a straggler: the what-if replay with the host's ranks working like the others.",
        "Compare the host with the others: CPU model and frequency, other jobs on it, its "
        "data path (local disk, network file system), thermal throttling.",
    ),
    "contention": FindingKind(
        "CPU contention",
        "warning",
        "Ranks wait for a CPU (runnable, not running) 10 % or more of their time outside "
        "synchronize(): too many busy threads for the host's cores, or other jobs. Raised for "
        "the host, and for a rank whose lateness is mostly waiting for a CPU.",
        "The run-queue wait per step (`data.runq_ms`), or the rank's what-if cost.",
        "Run fewer busy threads than cores per rank (torch.set_num_threads / OMP_NUM_THREADS, "
        "fewer DataLoader workers), pin ranks to their own cores (horovodrun --binding-args, "
        "taskset), keep other jobs off the host. Where every rank of the host is already pinned "
        "to exactly as many CPUs as it runs torch threads, whatever else runs there (its other "
        "threads: Horovod's background thread, DataLoader workers; or another job) takes its "
        "time from those: keep other jobs off them and give each rank a CPU more, or, where "
        "HOROVOD_CYCLE_TIME was shortened below 1 ms, lengthen it.",
    ),
    "oversubscribed": FindingKind(
        "More threads than cores on a host",
        "warning; info when the run-queue wait measured there stayed under 2 % of the work",
        "The ranks of one host together ask torch for more intra-op threads than the cores "
        "they may run on (from the rank headers: `torch.get_num_threads()` when the optimizer "
        "was built, the CPU affinity, the host's CPU count), or one rank asks for more than its "
        "own affinity allows. Their busy threads then take turns on the cores. torch's default "
        "is one thread per core for every process, so several ranks per host oversubscribe it "
        "unless each is told its share.",
        "The run-queue wait measured on that host, per step (`data.runq_ms`: time runnable "
        "without a CPU outside synchronize, the same figure as the contention finding's), and "
        "its share of the ranks' work (`data.work_share`).",
        "`torch.set_num_threads(cores // ranks_on_host)` in each rank before training "
        "(`data.suggested_threads`; or `OMP_NUM_THREADS`), or fewer ranks per host.",
    ),
    "shared_gpu": FindingKind(
        "Ranks sharing one GPU",
        "warning",
        "Two ranks or more of one host train on the same CUDA device (the same UUID, else PCI "
        "bus id, in their headers): they take turns on it and share its memory while the "
        "host's other GPUs may idle. Usually `torch.cuda.set_device(hvd.local_rank())` is "
        "missing, or the device is hard-coded as `cuda:0`.",
        "Not priced in time: each rank gets about 1/n of the device (`value`: the ranks on it).",
        "Right after `hvd.init()`, `torch.cuda.set_device(hvd.local_rank())`, and build the "
        "model and tensors on `torch.device('cuda', hvd.local_rank())`.",
    ),
    "manual_averaging": FindingKind(
        "Gradients averaged by hand after the backward",
        "warning; info when that communication is under 2 % of the step",
        "A job without Horovod's distributed optimizer allreduces its gradients itself after "
        "loss.backward() returned (hvd.allreduce or hvd.allreduce_async_ on each p.grad, then "
        "a plain torch optimizer): allreduces recorded outside the optimizer, issued after the "
        "backward ended, whose sizes match the model's gradients (the header's "
        "`optimizer.param_bytes`: each gradient, or all of them in one buffer) and carry at "
        "least half their bytes, in at least half of a rank's steps. Needs the backward's span "
        "(the model found: tracing by environment finds it). The finding names the ranks and "
        "the first step. With Horovod's optimizer as well, the gradients are averaged twice.",
        "`data.lost_ms_per_step`: what a distributed optimizer would save of the communication "
        "after the backward (`data.comm_ms`): `data.hidden_ms`, hidden under the measured "
        "backward (`data.backward_ms`; each gradient's allreduce started when the backward "
        "produces it, gradients produced at an even rate per byte, last layer first, each "
        "allreduce taking its bytes' share of the measured time), plus, for blocking calls made "
        "one at a time, `data.fused_ms`: sent together they pay one negotiation, each call "
        "after the first the shortest call's time less (a lower bound; docs/consistency.md). "
        "Averaged twice: all of `data.comm_ms` is waste.",
        "Use `hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())` "
        "(or `hvtrace.DistributedOptimizer`): it starts each allreduce during the backward and "
        "fuses them. Averaged twice: remove the manual allreduces.",
    ),
    "sparse_as_dense": FindingKind(
        "A sparse gradient sent dense",
        "warning; info when the zeros' time is under 1 % of the step",
        "On the consistency checks' schedule each rank measures, for an embedding gradient of "
        "256 KiB or more that Horovod allreduces dense (`nn.Embedding(sparse=False)`, or "
        "`sparse=True` under `sparse_as_dense=True`), the share of its rows that were all zero "
        "in the averaged gradient (256 rows sampled; a sparse gradient's counted from its "
        "indices). A tensor with a median share of half or more is named: each step every rank "
        "sends its whole table, mostly zeros.",
        "`data.zero_bytes_per_step`: the bytes of the tensor that carried zeros each step (at "
        "least: a row zero on every rank); `data.zero_ms`: their share of the step's allreduced "
        "bytes times the step's measured allreduce time.",
        "`nn.Embedding(..., sparse=True)` and Horovod's default `sparse_as_dense=False` (Horovod "
        "0.28 then allgathers the rows each rank used), with an optimizer that takes sparse "
        "gradients (SGD, SparseAdam, Adagrad), when ranks x the share of rows used is well "
        "below the ring allreduce's 2 (N-1)/N (the finding computes it); else another design "
        "(a smaller table, hashed ids, a table sharded across ranks).",
    ),
    "rank0_blocking": FindingKind(
        "Rank 0 blocks between steps",
        "warning",
        "Rank 0's gap between steps is longer than the other ranks' by a mean that stands out "
        "of its own noise (three standard errors) and costs 5 % of the run or more: logging, "
        "checkpoints or evaluation done on rank 0 while the others wait. It says how often it "
        "came and, where a user span explains it, which.",
        "The mean excess of rank 0's input gap per step (`data.lost_ms_per_step`).",
        "Move the work off the training loop (another thread) or do it every N steps; save "
        "checkpoints asynchronously.",
    ),
    "collective_wait": FindingKind(
        "Ranks wait for one rank in a collective outside the optimizer",
        "warning from 5 % of the run, info from 1 %",
        "Ranks are blocked in a collective the job issues itself (a metric's allreduce, a "
        "broadcast, a Lightning callback's) for 1 % of the run or more, and most of that time "
        "is waiting for one late rank, which is named.",
        "The ranks' blocked time per step averaged over the run (`data.blocked_ms_per_step`, "
        "`data.run_share`).",
        "Find why that rank reaches the collective late (the phase before it); issue the "
        "collective less often.",
    ),
    "collective_cost": FindingKind(
        "A costly collective outside the optimizer",
        "warning from 5 % of the run, info from 1 %",
        "A collective the job issues itself blocks the ranks for 1 % of the run or more, and "
        "not because of one late rank: the operation itself costs.",
        "The ranks' blocked time per step averaged over the run, per call and as a share of the "
        "run.",
        "Issue it less often (every N steps), batch several values into one tensor, or use its "
        "asynchronous form; for Lightning's own, change how often the callback runs.",
    ),
    "comm_bound": FindingKind(
        "Communication-bound steps",
        "warning",
        "In at least half the steps the last rank to be ready still waits a share of the step "
        "for allreduces (exposed communication). The finding gives the current Horovod "
        "settings and, on several hosts, whether the network link is the limit.",
        "The exposed communication per step (`data.exposed_ms`).",
        "A larger batch per worker, `hvd.Compression.fp16`, HOROVOD_FUSION_THRESHOLD and "
        "HOROVOD_CYCLE_TIME; where a link is the limit, a faster link or fewer bytes.",
    ),
    "small_allreduces": FindingKind(
        "Many small allreduces",
        "info",
        "50 or more tensors per step with a median size under 256 KiB: each costs a negotiation "
        "round.",
        "Not priced: `value` is the number of tensors per step.",
        "Fuse more (HOROVOD_FUSION_THRESHOLD, HOROVOD_CYCLE_TIME) or group the tensors "
        "(`DistributedOptimizer(groups=...)`).",
    ),
    "late_unexplained": FindingKind(
        "A rank often last that is not named a straggler",
        "info",
        "A rank is last to be ready in a majority of steps, but its own phases do not explain "
        "the lateness (it starts its steps late: CPU contention, or clocks off by up to their "
        "uncertainty) or its extra work is below the margin a balanced run's noise reaches.",
        "Not priced: `value` is its median lateness in ms.",
        "Nothing to do unless it grows; look at its host's CPU if it starts its steps late.",
    ),
    "balanced": FindingKind(
        "No straggler",
        "info",
        "No rank is last in a clear majority of steps with a lateness its own work explains. It "
        "says which rank was most often last and by how much, for reference.",
        "None.",
        "None: the ranks keep pace.",
    ),
}


@dataclass
class Finding:
    """One line of advice. ``kind`` names the check (a key of :data:`FINDING_KINDS`, which says
    what each means); ``severity`` is ``warning`` or ``info``; ``value`` is the number behind
    the line, in ``unit``; ``data`` holds the other numbers (JSON-ready)."""

    kind: str
    severity: str
    message: str
    value: float | None = None
    unit: str = ""
    data: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """Return the finding as a JSON-ready dict."""
        return asdict(self)


@dataclass
class RankState:
    """How one rank's recording ended (from its file)."""

    rank: int
    complete: bool
    truncated: bool
    dropped: int
    last_step: int


#: The run-level figures (:attr:`Analysis.run_row`): medians over the analyzed steps of these
#: columns of ``per_step``.
RUN_FIGURES = ("step_ms", "comm_compute_ratio", "overlap", "exposed_ms", "exposed_share")


@dataclass
class Analysis:
    """Everything :func:`hvtrace.analysis.analyze` computes. DataFrames are documented where
    they are made:

    - ``steps``: :func:`hvtrace.analysis.steps.step_table` (per rank and step, ns);
    - ``per_rank``: :func:`hvtrace.analysis.steps.rank_summary` plus ``host`` (ms);
    - ``users`` / ``user_per_rank``: :func:`~hvtrace.analysis.engine.user_table` (ns) /
      :func:`~hvtrace.analysis.steps.user_summary` (ms);
    - ``per_step``: :func:`hvtrace.analysis.steps.step_summary` (one row per step, ms);
    - ``collectives`` / ``tensors`` / ``step_comm``: :mod:`hvtrace.analysis.bandwidth`;
    - ``verdicts``: :func:`hvtrace.analysis.stragglers.straggler_table` (every rank);
      ``stragglers``: the named ones; ``slow_hosts``: hosts whose ranks are all late (both with
      what they cost the job: ``lost_ms_per_step``, ``lost_share``, see
      :mod:`hvtrace.analysis.whatif`);
    - ``links`` / ``limiting_link``: :mod:`hvtrace.analysis.links` (host-to-host rates from the
      ranks' TCP counters; empty / None for a frame or a run on one host);
    - ``findings``: short actionable lines, each with the number behind it.

    ``step_range``: the steps selected (None: the whole run).
    """

    run_id: str
    size: int
    ranks: list[int]
    hosts: dict[int, str]
    skip_steps: int
    step_range: StepRange | None
    steps: pd.DataFrame
    per_rank: pd.DataFrame
    users: pd.DataFrame
    user_per_rank: pd.DataFrame
    per_step: pd.DataFrame
    collectives: pd.DataFrame
    tensors: pd.DataFrame
    step_comm: pd.DataFrame
    comm: dict[str, float]
    verdicts: pd.DataFrame
    stragglers: pd.DataFrame
    slow_hosts: pd.DataFrame
    findings: list[Finding] = field(default_factory=list)
    clock: str = ""
    clock_uncertainty_ns: dict[int, int] = field(default_factory=dict)
    #: Per rank: offset_ns, uncertainty_ns, method, estimates, drift_ppm
    #: (:meth:`hvtrace.load.Run.clock_table`); empty for a frame.
    clock_ranks: dict[int, dict[str, Any]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    rank_states: list[RankState] = field(default_factory=list)
    missing_ranks: list[int] = field(default_factory=list)
    horovod_env: dict[str, str] = field(default_factory=dict)
    optimizer: dict[str, Any] = field(default_factory=dict)
    timing: str = ""  # the header's timing: host_monotonic (CPU) or cuda_events
    run_dir: Path | None = None
    #: What the engine read: ``spans`` (spans read), ``spans_total`` (in the files opened),
    #: ``files`` (files opened), ``files_total`` (rank files of the run), ``row_groups`` /
    #: ``row_groups_total`` (Parquet row groups read / in the files opened); empty for a frame.
    read: dict[str, int] = field(default_factory=dict)
    #: The engine that ran the per-rank pass: ``{"name": "duckdb"}`` (this process) or
    #: ``{"name": "dask", "scheduler", "tasks", "tasks_by_worker"}``; empty for a frame.
    engine: dict[str, Any] = field(default_factory=dict)
    #: :func:`hvtrace.analysis.stragglers.host_contention` (empty without the cause counters).
    contention: pd.DataFrame = field(default_factory=pd.DataFrame)
    #: :func:`hvtrace.analysis.hangs.find_hangs` (empty for a frame or a run without stalls).
    hangs: list[dict[str, Any]] = field(default_factory=list)
    #: :func:`hvtrace.analysis.whatif.whatif_summary` (empty when it cannot be replayed).
    whatif: dict[str, Any] = field(default_factory=dict)
    links: pd.DataFrame = field(default_factory=pd.DataFrame)
    limiting_link: dict[str, Any] | None = None
    #: :func:`hvtrace.analysis.outside.outside_table`: collectives issued outside the optimizer,
    #: per source (empty when none).
    outside: pd.DataFrame = field(default_factory=pd.DataFrame)
    #: :func:`hvtrace.analysis.consistency.check`: what was compared across ranks (parameter
    #: fingerprints, learning rates, values that must agree) and the divergences found.
    consistency: dict[str, Any] = field(default_factory=dict)
    #: :func:`hvtrace.analysis.hvd_timeline.run_section`: Horovod's own timeline, merged (empty
    #: when the run has none).
    horovod_timeline: dict[str, Any] = field(default_factory=dict)
    #: Live straggler verdicts the job logged while it ran (:mod:`hvtrace.record.live`, from rank
    #: 0's file), in order: ``event`` (late / recovered), ``rank``, ``first_step``, ...
    live: list[dict[str, Any]] = field(default_factory=list)
    #: Ranks out of lockstep (:func:`hvtrace.analysis.lockstep.lockstep_breaks`): where a rank
    #: stopped taking the steps the others took (empty when they kept in step, or for a frame).
    lockstep: list[dict[str, Any]] = field(default_factory=list)
    #: What Lightning's Trainer counted and decided (:func:`hvtrace.analysis.framework.scan`:
    #: ``global_steps``, ``decisions``, ``best_checkpoints``, ``rows``; empty without them).
    trainer: dict[str, Any] = field(default_factory=dict)
    #: Gradient accumulation that does not accumulate
    #: (:func:`hvtrace.analysis.framework.accumulation`), else None.
    accumulation: dict[str, Any] | None = None
    #: Elastic Horovod: the membership epochs, each with its own analysis, when the run had
    #: more than one (:mod:`hvtrace.analysis.membership`; empty otherwise). The resets are
    #: ``reset`` findings.
    membership: list[dict[str, Any]] = field(default_factory=list)
    #: The per-(rank, step) summaries the metrics were computed from
    #: (:class:`hvtrace.analysis.engine.Summaries`; None for a frame): what a later analysis of
    #: the same, grown run reuses for the steps that can no longer change (``analyze(prior=)``).
    summaries: Any = field(default=None, repr=False)
    #: The run was being written when analyzed (:attr:`hvtrace.load.Run.live`): a rank whose file
    #: is still open is in progress, not stopped.
    in_progress: bool = False
    #: The training framework that built the optimizer, from the header (``{"name":
    #: "pytorch_lightning", "version": "1.9.5"}``; empty for a plain Horovod script or a frame).
    framework: dict[str, Any] = field(default_factory=dict)
    #: Horovod's controller, from the header: ``"mpi"`` (mpirun, horovodrun --mpi), ``"gloo"``
    #: (horovodrun --gloo, Ray, Spark), empty when not recorded.
    controller: str = ""
    #: What carried the collectives of CUDA tensors, from the header: ``"nccl"`` (Horovod built
    #: with NCCL), ``"host"`` (copied to host memory, sent by the controller's library), or ``""``
    #: (a CPU run, or not recorded).
    gpu_operations: str = ""
    #: Versions the header recorded: ``torch``, ``horovod``, ``hvtrace`` (None: not recorded).
    versions: dict[str, str | None] = field(default_factory=dict)
    #: :func:`hvtrace.analysis.antipatterns.batch_check`: the ranks' batch fingerprints compared
    #: (groups of ranks that trained on the same batches; empty without fingerprints).
    batches: dict[str, Any] = field(default_factory=dict)
    #: :func:`hvtrace.analysis.antipatterns.placement`: per host, torch threads against cores,
    #: and CUDA devices shared by ranks (empty for a frame or files without the fields).
    placement: dict[str, Any] = field(default_factory=dict)
    #: :func:`hvtrace.analysis.antipatterns.lr_summary`: the recorded learning rates beside the
    #: world size (information).
    scale: dict[str, Any] = field(default_factory=dict)
    #: How the job sends its gradients (:mod:`hvtrace.analysis.gradients`): ``manual``
    #: (:func:`~hvtrace.analysis.gradients.manual_check`: ranks that allreduce their gradients
    #: themselves after the backward) and ``zero_rows`` (:func:`~hvtrace.analysis.gradients.
    #: zero_rows_summary`: large embedding gradients sent dense, with their zero rows).
    gradients: dict[str, Any] = field(default_factory=dict)

    @property
    def lightning(self) -> str | None:
        """The run was traced under PyTorch Lightning: its version (the header's ``framework``),
        ``""`` when only the trace shows it (the logged metrics or a plateau scheduler's value
        that only :mod:`hvtrace.lightning` records, a collective Lightning issued for itself),
        None when the run is not known to be Lightning's."""
        fw = self.framework if isinstance(self.framework, dict) else {}
        if str(fw.get("name") or "") == "pytorch_lightning":
            return str(fw.get("version") or "")
        c = self.consistency if isinstance(self.consistency, dict) else {}
        if c.get("metrics") or any(
            d.get("what") == "metrics" or d.get("monitored")
            for d in c.get("divergences") or []
            if isinstance(d, dict)
        ):
            return ""
        t = self.outside
        names = t["name"] if t is not None and len(t) and "name" in t.columns else ()
        if len(names) and names.astype(str).str.startswith(LIGHTNING_PREFIX).any():
            return ""
        return None

    @property
    def run_steps(self) -> pd.DataFrame:
        """The rows of ``per_step`` the run-level figures are medians of: the steps after the
        warm-up (all of them when the run has no other)."""
        ps = self.per_step
        after = ps[ps["step"] >= self.skip_steps] if len(ps) else ps
        return after if len(after) else ps

    @property
    def run_row(self) -> dict[str, float | None]:
        """The run-level figures, defined once: the report, the findings, the dashboard's header
        and the elastic epoch table read them here. Each of :data:`RUN_FIGURES` is the median
        over :attr:`run_steps` of that per-step column (None without a value);
        ``busbw_gbps`` is the run's bus bandwidth (``comm``)."""
        p = self.run_steps
        out: dict[str, float | None] = {}
        for c in RUN_FIGURES:
            col = p[c] if c in p.columns else pd.Series(dtype=float)
            col = col.astype("float64")
            out[c] = float(col.median()) if col.notna().any() else None
        bus = self.comm.get("busbw_gbps") if isinstance(self.comm, dict) else None
        out["busbw_gbps"] = float(bus) if bus is not None and bus == bus else None
        return out

    @property
    def analyzed(self) -> pd.DataFrame:
        """The rows of ``steps`` the statistics use (complete, after the warm-up)."""
        return analyzed_steps(self.steps, self.skip_steps)

    @property
    def analyzed_step_numbers(self) -> tuple[int, int, int]:
        """``(first, last, count)`` of the analyzed step numbers (-1, -1, 0 when none)."""
        s = self.analyzed["step"]
        if s.empty:
            return -1, -1, 0
        return int(s.min()), int(s.max()), int(s.nunique())


__all__ = ["FINDING_KINDS", "Analysis", "Finding", "FindingKind", "RankState"]
