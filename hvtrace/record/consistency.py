"""Consistency across ranks, recorded: parameter fingerprints, learning rates, agreed values.

Horovod keeps ranks in step only as long as they start from the same weights and apply the same
updates; nothing checks it. A rank that starts from other weights (``broadcast_parameters`` left
out), changes its weights alone (a callback on one rank), or trains at another learning rate (a
scheduler fed a metric that differs across ranks) silently trains another model. This module
records, on each rank, the values that must be equal on every rank, as ``scalar`` rows under
reserved names (:mod:`hvtrace.analysis.consistency` compares them across ranks):

- ``hvtrace.lr|G``: the learning rate of param group ``G``, every step (a float read per group);
- ``hvtrace.param|NAME``: a fingerprint of parameter ``NAME``, every ``consistency_every`` steps
  (and at step 0, before any update). Fingerprints are equal for bit-identical tensors and differ
  almost surely otherwise:

  - CPU tensors: the CRC-32 of the tensor's bytes (``zlib.crc32``, about 3 GB/s; any change of up
    to 32 consecutive bits, such as one element, is always detected), read at once;
  - CUDA tensors: computed on the device, never synchronizing: the bytes viewed as integers
    (int64/int32/int16/uint8 by element size) widened to int64, ``s1 = sum(x)`` and
    ``s2 = sum(x[i] * x[i+1])`` (integer sums wrap modulo 2**64, so the result does not depend on
    the reduction order), folded into 52 bits (``(s1 * 1000003 + s2) mod 2**52``, exact as a
    float64). The fingerprints of one check are copied to pinned host memory with
    ``non_blocking=True`` behind a CUDA event, and written when a later check (or the end of the
    run) finds the event done, like the CUDA timers (:mod:`hvtrace.record.timers`);

- ``hvtrace.batch|input``: a fingerprint of the batch the traced model's forward received (its
  first tensor argument), on the same schedule as the parameters (step 0, then every
  ``consistency_every`` steps), at the first forward of the step (:class:`BatchFingerprints`). It
  must differ across ranks, each training on its own shard: ranks with equal fingerprints at
  every check trained on the same batches (:mod:`hvtrace.analysis.antipatterns`). Up to
  :data:`BATCH_SAMPLES` elements at fixed positions spread over the tensor, with its shape and
  dtype, hashed like a parameter (CRC-32 on the CPU, at once; the device sums on a GPU, read
  back lazily with the parameters' fingerprints);
- ``hvtrace.zero_rows|HOW|NAME``: for a large embedding gradient that Horovod sends dense (an
  ``nn.Embedding(sparse=False)``'s, or a sparse one under ``sparse_as_dense=True``), the share
  of its rows that were all zero, on the parameters' schedule, in ``step()`` (the averaged
  gradient: rows zero on every rank), with its dense bytes (:class:`ZeroRows`): a dense
  gradient's rows sampled (:data:`ZERO_ROWS_SAMPLES` of them, spread as the batch's elements
  are), a sparse one's counted from its indices; read at once on the CPU, lazily on a GPU (with
  the fingerprints). :mod:`hvtrace.analysis.gradients` names the tensors sent mostly zeros;
- values the user marks as ones that must agree: ``hvtrace.scalar(name, value, agree=True)``
  (flag bit 3, :data:`hvtrace.format.schema.FLAG_AGREE`), and in Lightning the logged metrics at
  epoch end (``hvtrace.metric|NAME``) and the value a ``ReduceLROnPlateau`` is stepped with
  (``hvtrace.monitor|NAME``, NAME the metric it monitors), both with that flag too.

The checks run in the optimizer's ``step()`` before the update (so a fingerprint at step ``s`` is
of the weights step ``s`` computed its gradients with); their time counts in the update phase of
the checked steps and is also a ``hvtrace.consistency`` user span (left out of the statistics).
A failure disables tracing with one warning, as anywhere in hvtrace.
"""

from __future__ import annotations

import logging
import zlib
from collections import deque
from typing import Any, Final

from hvtrace.format.schema import (
    BATCH_NAME,
    CHECK_SPAN,
    DTYPE_CODE,
    FLAG_AGREE,
    KIND_CODE,
    LR_PREFIX,
    PARAM_PREFIX,
    ZERO_ROWS_PREFIX,
    dtype_name,
)
from hvtrace.record.hot import LrRows
from hvtrace.record.timers import monotonic_ns
from hvtrace.record.torchpatch import ModuleHook

log = logging.getLogger("hvtrace")

#: Device checks whose results are not read back yet, at most (older ones are dropped, counted).
MAX_PENDING: Final = 8
_MASK52: Final = (1 << 52) - 1
_MULT: Final = 1000003

_K_SCALAR = KIND_CODE["scalar"]
_K_USER = KIND_CODE["user"]


def fingerprint_bytes(t: Any) -> float:
    """The CRC-32 of a CPU tensor's bytes, as a float (exact). Reads the tensor at once."""
    import torch

    x = t.detach()
    if not x.is_contiguous():
        x = x.contiguous()
    b = x.reshape(-1).view(torch.uint8).numpy()
    return float(zlib.crc32(b))


_INT_OF_SIZE: dict[int, Any] = {}


def fingerprint_device(tensors: list[Any]) -> Any:
    """Fingerprints of ``tensors`` (one device) as one int64 tensor on that device, each in
    ``[0, 2**52)``; only kernels are launched (nothing waits for the device)."""
    import torch

    if not _INT_OF_SIZE:
        _INT_OF_SIZE.update({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8})
    out = []
    for t in tensors:
        x = t.detach().reshape(-1)
        x = x.view(_INT_OF_SIZE[x.element_size()]).to(torch.int64)
        s1 = x.sum()
        s2 = (x[1:] * x[:-1]).sum() if x.numel() > 1 else torch.zeros_like(s1)
        out.append(torch.bitwise_and(s1 * _MULT + s2, _MASK52))
    if not out:
        return torch.zeros(0, dtype=torch.int64)
    return torch.stack(out)


class ConsistencyChecks(LrRows):
    """Records the consistency rows of one traced optimizer (see the module doc).

    ``tracer``: the :class:`hvtrace.record.optimizer.Tracer`; ``every``: steps between parameter
    fingerprints (0: learning rates only); ``device``: fingerprint on the device (lazily read)
    rather than hash the bytes on the host (default: when the tracer times with CUDA events).
    """

    def __init__(self, tracer: Any, every: int, device: bool | None = None) -> None:
        self.tracer = tracer
        self.rec = tracer.rec
        self.every = int(every)
        self.device = bool(tracer.is_cuda) if device is None else bool(device)
        self.groups = tracer.dist.param_groups  # live: lr changes, groups added later
        self._names = getattr(tracer.dist, "_parameter_names", {}) or {}
        self._params: list[tuple[str, Any]] = []
        self._n_groups = -1
        self._lr_names: list[str] = []
        self.pending: deque = deque()
        self.dropped = 0
        self.checks = 0
        self._warned: set[str] = set()
        #: The zero rows of large embedding gradients, measured with the fingerprints (None:
        #: that check failed and is off).
        self.zero_rows: ZeroRows | None = ZeroRows(self)

    def ask(self, step: int) -> None:
        """Fingerprint the parameters at step ``step`` too, off the schedule (live detection asks
        it after a lockstep break, at the same step on every rank). The compiled step writes
        the learning rates itself only while the param groups are as many as ``_n_groups``:
        forgetting it hands the next step to :meth:`on_step`, which counts them again (as for
        a param group added) and takes the check."""
        self.asked = int(step)
        self._n_groups = -1

    # -- per step: on_step (the learning-rate rows, hot path) is in hvtrace.record.hot.LrRows ------

    def _number(self, lr: Any) -> float | None:
        """A learning rate that is not a float: an int, or a one-element tensor (a CUDA one is
        not read: that would synchronize)."""
        if getattr(lr, "is_cuda", False):
            self._warn_once(
                "a CUDA tensor learning rate is not recorded (reading it would synchronize the "
                "device)"
            )
            return None
        return float(lr)

    def _refresh(self) -> None:
        """(Re)build the parameter list and the lr row names (param groups changed)."""
        self._n_groups = len(self.groups)
        self._lr_names = [f"{LR_PREFIX}{i}" for i in range(self._n_groups)]
        params, seen = [], set()
        for g in self.groups:
            for p in g["params"]:
                if id(p) in seen:
                    continue
                seen.add(id(p))
                name = self._names.get(p) or f"param.{len(params)}"
                params.append((PARAM_PREFIX + str(name), p))
        self._params = params

    # -- parameter fingerprints (every N steps) ------------------------------------------------
    def check_params(self, step: int) -> None:
        """Record a fingerprint of every parameter, as of now, for step ``step``."""
        rec = self.rec
        read = getattr(self.tracer, "read", None)  # the training thread's CPU counters
        t0 = monotonic_ns()
        c0 = read() if read is not None else None
        if self.device:
            self._launch(step, t0)
        else:
            add = rec.add
            for name, p in self._params:
                if p.is_cuda:  # a CUDA tensor in a host-timed run: never read it here
                    continue
                add(_K_SCALAR, name, t0, t0, value=fingerprint_bytes(p), step=step)
        zero = self.zero_rows
        if zero is not None:
            try:
                zero.measure(step, t0)
            except Exception as exc:  # noqa: BLE001 - this check only, never the others
                self.zero_rows = None
                self._warn_once(f"the zero-rows check (sparse gradients) is off: {exc}")
        self.checks += 1
        t1 = monotonic_ns()
        c1 = read() if read is not None else None
        rec.add(_K_USER, CHECK_SPAN, t0, t1, step=step, cpu_start=c0, cpu_end=c1)

    def _launch(self, step: int, t: int) -> None:
        """Launch the device fingerprints of one check and queue their copy to the host."""
        by_dev: dict[Any, list[tuple[str, Any]]] = {}
        for name, p in self._params:
            by_dev.setdefault(p.device, []).append((name, p))
        for items in by_dev.values():
            self.queue(step, t, [n for n, _ in items], fingerprint_device([p for _, p in items]))

    def queue(self, step: int, t: int, names: list[str], fps: Any, extra: Any = None) -> None:
        """Queue the copy to the host of ``fps`` (one value per name) behind a CUDA event (on
        another device, as they are); ``extra``: per name ``(bytes, dtype code)`` of its row, or
        None. The oldest entry is dropped past :data:`MAX_PENDING`."""
        import torch

        if fps.is_cuda:
            host = torch.empty(fps.shape, dtype=fps.dtype, pin_memory=True)
            host.copy_(fps, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
        else:
            host, ev = fps, None
        if len(self.pending) >= MAX_PENDING:
            old = self.pending.popleft()
            self.dropped += len(old[2])
            self._warn_once("consistency fingerprints dropped: the device is far behind")
        self.pending.append((step, t, names, host, ev, extra))

    def collect(self, wait: bool = False) -> None:
        """Write the device fingerprints whose copy finished (all of them with ``wait``, at
        the end of the run: that synchronizes)."""
        pending, add = self.pending, self.rec.add
        while pending:
            step, t, names, host, ev, extra = pending[0]
            if ev is not None:
                if wait:
                    ev.synchronize()
                elif not ev.query():
                    return
            pending.popleft()
            for i, (name, v) in enumerate(zip(names, host.tolist())):
                if extra is None:
                    add(_K_SCALAR, name, t, t, value=float(v), step=step)
                else:
                    add(_K_SCALAR, name, t, t, extra[i][0], extra[i][1], float(v), step=step)

    def close(self) -> None:
        """Write what is still pending (the end of the run)."""
        try:
            if self.rec.enabled:
                self.collect(wait=True)
        except Exception as exc:  # noqa: BLE001
            self.tracer.fail(f"consistency check: {type(exc).__name__}: {exc}")
        self.pending.clear()

    def _warn_once(self, msg: str) -> None:
        if msg not in self._warned:
            self._warned.add(msg)
            log.warning("hvtrace: %s", msg)


#: Elements of a batch sampled for its fingerprint, at most.
BATCH_SAMPLES: Final = 64
_SPREAD: Final = 2654435761  # Knuth's multiplicative hash: an offset in each bin that varies


def batch_positions(n: int, k: int = BATCH_SAMPLES) -> list[int]:
    """Positions of up to ``k`` elements of a flat tensor of ``n`` elements, the same for every
    tensor of that size: one in each of ``k`` equal bins, at an offset within the bin that varies
    from bin to bin (so a regular layout, an image's border column or a padded sequence's tail,
    is not sampled at the same place in every bin)."""
    if n <= k:
        return list(range(n))
    width = n // k
    return [i * n // k + (i * _SPREAD) % width for i in range(k)]


def _first_tensor(args: Any, kwargs: Any) -> Any:
    """The first tensor among a forward's arguments (positional, then keyword), looking one level
    into lists, tuples and dicts (a ``(x, y)`` batch, a ``**batch`` of tensors); None if none."""
    import torch

    is_tensor = torch.is_tensor
    for a in (*args, *((kwargs or {}).values())):
        if is_tensor(a):
            return a
        inner = a.values() if isinstance(a, dict) else a if isinstance(a, list | tuple) else ()
        for b in inner:
            if is_tensor(b):
                return b
    return None


class BatchFingerprints:
    """A forward pre-hook on the traced model that fingerprints the batch it receives (the first
    tensor argument) at the first forward (with gradients on) of each step the parameter checks
    of ``checks`` fingerprint: step 0 and every ``checks.every`` steps (see the module doc).

    Between those steps the hook costs one comparison of the step number; the fingerprint itself
    is the CRC-32 of :data:`BATCH_SAMPLES` elements on the CPU, or a few kernels queued on the
    device for a CUDA tensor (copied back with the parameters' fingerprints, never waited for).
    A failure turns this check off (one warning), nothing else: tracing and training go on.
    """

    def __init__(self, checks: ConsistencyChecks) -> None:
        import torch

        self.checks = checks
        self.rec = checks.rec
        self.every = int(checks.every)
        step = int(self.rec.step)
        #: The next step whose first forward is fingerprinted.
        self.target = step + (-step) % self.every if self.every > 0 else -1
        self.handle: Any = None
        self.recorded = 0
        self._grad_enabled = torch.is_grad_enabled
        self._index: dict[tuple[int, Any], Any] = {}  # (numel, device) -> positions tensor

    def install(self, model: Any) -> Any:
        """Hook ``model``'s forward (a module, or a stand-in with ``register_forward_pre_hook``)
        before the tracer's own pre-hook where it can, so the work counts in the input gap.
        Returns the hook's handle (None when ``every`` is 0: no checks, no hook)."""
        import torch

        if self.every <= 0 or model is None:
            return None
        hook = ModuleHook(self)  # a copy or pickle of the model gets an inert hook instead
        if isinstance(model, torch.nn.Module):
            self.handle = model.register_forward_pre_hook(hook, prepend=True, with_kwargs=True)
        else:
            self.handle = model.register_forward_pre_hook(hook)
        return self.handle

    def __call__(self, module: Any, args: Any, kwargs: Any = None) -> None:
        rec = self.rec
        step = rec.step
        if step < self.target:  # the common case: one comparison
            return None
        try:
            if not rec.enabled or not self._grad_enabled():  # evaluation: not a training batch
                return None
            if step > self.target:  # the scheduled step had no forward here: the next one
                self.target = step + (-step) % self.every
                if step != self.target:
                    return None
            self.target = step + self.every
            x = _first_tensor(args, kwargs)
            if x is not None:
                self.record(step, x)
        except Exception as exc:  # noqa: BLE001 - this check only, never training
            self.disable(f"{type(exc).__name__}: {exc}")
        return None

    def record(self, step: int, x: Any) -> None:
        """Record the fingerprint of tensor ``x`` as the batch of step ``step``."""
        t = monotonic_ns()
        n = int(x.numel())
        shape = zlib.crc32(f"{tuple(x.shape)}|{x.dtype}".encode())
        flat = x.detach().reshape(-1)
        key = (n, flat.device)
        idx = self._index.get(key)
        if idx is None:
            import torch

            idx = torch.tensor(batch_positions(n), dtype=torch.int64, device=flat.device)
            self._index = {key: idx}  # one size at a time (the last batch of an epoch)
        sample = flat.index_select(0, idx)
        if x.is_cuda:
            self._launch(step, t, sample, shape)
        else:
            value = float(zlib.crc32(_raw_bytes(sample), shape))
            self.rec.add(_K_SCALAR, BATCH_NAME, t, t, value=value, step=step)
        self.recorded += 1

    def _launch(self, step: int, t: int, sample: Any, shape: int) -> None:
        """Queue the fingerprint of a CUDA sample with the parameter checks' pending copies."""
        import torch

        fp = torch.bitwise_and(fingerprint_device([sample]) * _MULT + shape, _MASK52)
        self.checks.queue(step, t, [BATCH_NAME], fp)

    def disable(self, why: str) -> None:
        """Turn this check off (one warning); tracing goes on."""
        self.target = 1 << 62
        if self.handle is not None:
            try:
                self.handle.remove()
            except Exception:  # noqa: BLE001
                pass
            self.handle = None
        log.warning("hvtrace: the batch fingerprint (unsharded data check) is off: %s", why)


def _raw_bytes(t: Any) -> Any:
    """The bytes of a small CPU tensor, as a numpy array (a bool or integer view where numpy has
    no type for the dtype, such as bfloat16)."""
    import torch

    x = t.contiguous().reshape(-1)
    size = x.element_size()
    if x.dtype != torch.uint8:
        x = x.view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[size])
    return x.numpy().view("uint8")


def make_batch_check(checks: ConsistencyChecks | None, model: Any) -> BatchFingerprints | None:
    """The batch fingerprints for a traced ``model`` on the schedule of ``checks`` (None when there
    are no checks, no model or ``every`` is 0). A failure to install is one warning."""
    if checks is None or model is None or checks.every <= 0:
        return None
    batch = BatchFingerprints(checks)
    try:
        if batch.install(model) is None:
            return None
    except Exception as exc:  # noqa: BLE001
        batch.disable(f"{type(exc).__name__}: {exc}")
        return None
    return batch


#: Gradients whose zero rows are measured: two dimensions or more, at least this many bytes.
ZERO_ROWS_MIN_BYTES: Final = 256 * 1024
#: Rows of a dense gradient checked, at most.
ZERO_ROWS_SAMPLES: Final = 256


class ZeroRows:
    """The share of all-zero rows of the large embedding gradients Horovod sends dense,
    measured by the parameter checks of ``checks`` (:meth:`measure`, in ``step()`` before the
    update; see the module doc).

    Measured: a parameter of two dimensions or more and :data:`ZERO_ROWS_MIN_BYTES` or more
    whose gradient is either dense and of an ``nn.Embedding`` / ``nn.EmbeddingBag`` of the
    traced model (found when the model is known: ``model=``, or tracing by environment), or
    sparse while Horovod's optimizer has ``sparse_as_dense=True`` (it allreduces it dense). A
    sparse gradient Horovod sends sparse (its default) is not measured: its zeros are not sent.

    The gradient is the averaged one, so a row counts as zero when it was on every rank: the
    share is a lower bound of what each rank sent as zeros. A dense gradient's rows are sampled
    (:data:`ZERO_ROWS_SAMPLES`, at fixed positions spread over the rows: :func:`batch_positions`;
    each row read whole); a sparse gradient's are counted exactly from its indices.
    """

    def __init__(self, checks: ConsistencyChecks) -> None:
        self.checks = checks
        self.recorded = 0
        self._for: Any = None  # the checks' parameter list the candidates were made from
        self._candidates: list[tuple[str, Any, int, int]] = []  # name, param, bytes, dtype
        self._embeddings: dict[int, bool] | None = None  # id(weight) -> the module's sparse
        self._index: dict[tuple[int, Any], Any] = {}  # (rows, device) -> row positions

    def candidates(self) -> list[tuple[str, Any, int, int]]:
        """The parameters large enough to measure: ``(name, param, bytes, dtype code)``."""
        params = self.checks._params
        if params is not self._for:
            out = []
            for name, p in params:
                nbytes = int(p.numel() * p.element_size())
                if p.dim() >= 2 and nbytes >= ZERO_ROWS_MIN_BYTES:
                    out.append((name.removeprefix(PARAM_PREFIX), p, nbytes, _dtype_code(p)))
            self._for, self._candidates = params, out
        return self._candidates

    def embeddings(self) -> dict[int, bool]:
        """``id(weight) -> sparse`` of the traced model's embeddings (empty while the model is
        not known; looked up once it is)."""
        if self._embeddings is not None:
            return self._embeddings
        import torch

        model = getattr(self.checks.tracer, "model", None)
        if model is not None and not isinstance(model, torch.nn.Module):
            model = getattr(model, "model", None)  # the stand-in that finds it (autotrace)
        if not isinstance(model, torch.nn.Module):
            return {}
        kinds = (torch.nn.Embedding, torch.nn.EmbeddingBag)
        self._embeddings = {
            id(m.weight): bool(getattr(m, "sparse", False))
            for m in model.modules()
            if isinstance(m, kinds)
        }
        return self._embeddings

    def measure(self, step: int, t: int) -> None:
        """Record the zero-row share of each gradient sent dense (see the class doc)."""
        cands = self.candidates()
        if not cands:
            return
        emb = self.embeddings()
        as_dense = bool(getattr(self.checks.tracer.dist, "sparse_as_dense", False))
        add = self.checks.rec.add
        on_device: dict[Any, list[tuple[str, Any, tuple[int, int]]]] = {}
        for pname, p, nbytes, dtype in cands:
            g = p.grad
            if g is None:
                continue
            if g.is_sparse:
                if not as_dense:
                    continue  # Horovod allgathers its rows: no zeros sent
                how = "sparse_as_dense"
            elif id(p) in emb:
                how = "dense"
            else:
                continue
            share = self.share(g)
            name = f"{ZERO_ROWS_PREFIX}{how}|{pname}"
            if g.is_cuda:
                on_device.setdefault(g.device, []).append((name, share, (nbytes, dtype)))
            else:
                add(_K_SCALAR, name, t, t, nbytes, dtype, float(share), step=step)
            self.recorded += 1
        for items in on_device.values():
            import torch

            fps = torch.stack([share for _, share, _ in items])
            self.checks.queue(step, t, [n for n, _, _ in items], fps, [x for _, _, x in items])

    def share(self, g: Any) -> Any:
        """The share of ``g``'s rows that are all zero, as a 0-d float64 tensor on its device
        (nothing waits for a GPU)."""
        import torch

        rows = int(g.shape[0])
        if rows == 0:
            return torch.zeros((), dtype=torch.float64, device=g.device)
        if g.is_sparse:
            mark = torch.zeros(rows, dtype=torch.bool, device=g.device)
            mark[g._indices()[0]] = True
            return 1.0 - mark.sum(dtype=torch.float64) / rows
        key = (rows, g.device)
        idx = self._index.get(key)
        if idx is None:
            idx = torch.tensor(
                batch_positions(rows, ZERO_ROWS_SAMPLES), dtype=torch.int64, device=g.device
            )
            self._index[key] = idx
        sample = g.detach().index_select(0, idx).reshape(len(idx), -1)
        return 1.0 - sample.ne(0).any(dim=1).sum(dtype=torch.float64) / len(idx)


def _dtype_code(p: Any) -> int:
    return DTYPE_CODE[dtype_name(p.dtype)]


def record_agree(rec: Any, name: str, value: Any, step: int | None = None) -> None:
    """Record ``value`` as a scalar ``name`` that must be equal on every rank (flag
    :data:`~hvtrace.format.schema.FLAG_AGREE`) on recorder ``rec``. ``step``: default the step in
    progress, or the one just finished between steps (as :func:`hvtrace.scalar`). Raises on a
    value that is not a number (the callers catch it)."""
    if step is None:
        step = rec.step - 1 if rec.between_steps and rec.step > 0 else rec.step
    t = monotonic_ns()
    rec.add(_K_SCALAR, str(name), t, t, value=float(value), flags=FLAG_AGREE, step=step)


def make_checks(tracer: Any, every: int) -> ConsistencyChecks | None:
    """The checks for ``tracer`` (None when its recording is off)."""
    if not tracer.rec.enabled:
        return None
    return ConsistencyChecks(tracer, every)
