"""The engine: runs the compiled graph per physical batch, adds noise once per logical batch.

No hooks anywhere: the model is only read (parameters and buffers are passed to the graph
as inputs) and ``param.grad`` is written in ``finalize``.
"""
from __future__ import annotations

import contextlib
import copy
import gc
import logging
import warnings

import torch
import torch.distributed as dist
from torch import nn

from .._torch import GUARDS, FakeTensor, gloo_worker_threads, in_fake_world
from .._fixed_shape_forwards import for_capture
from ..capture import capture
from ..config import DPConfig
from ..data import LogicalBatch
from ..errors import UnsupportedModelError
from ..passes import Lowered, PassContext, format_log, lower, pipeline
from ..passes._graph import val
from .accounting import PrivacyAccountant
from .engine_checks import (check_no_forward_holds_a_module, check_units_apart, fixed_batch_shapes,
                            held_unit_slots)
from .engine_state import CheckpointState, new_ledger_branch
from .fsdp import Sharding
from .guards import describe_change, fingerprint
from .parallel import Parallel
from .traces import keep_trace, shared_trace, trace, trace_key

log = logging.getLogger(__name__)
_RECAPTURE_WARNING = 8  # the capture of one graph that warns of repeated recaptures (as dynamo's recompile_limit)
_ROW_COUNTS_WARNING = 17  # one more than pack_documents makes below 2**17 rows


def _threaded_gloo(mesh) -> bool:
    """Whether a group of ``mesh`` is gloo with more than one worker thread."""
    return mesh is not None and any(gloo_worker_threads(mesh.get_group(d)) > 1 for d in range(mesh.ndim))


@contextlib.contextmanager
def _fewer_gc_passes():
    """Python's cyclic garbage collector run less often while capturing and lowering. Dynamo,
    aot-autograd and the passes allocate millions of short-lived containers, and the default
    young-generation threshold (700 allocations) runs a collection every few hundred of them,
    each promoting survivors that later full collections traverse again: 5-10% of a capture's
    CPU. The thresholds are restored after; cycles made meanwhile go at the next collection."""
    thresholds = gc.get_threshold()
    gc.set_threshold(max(thresholds[0], 50_000), *thresholds[1:])
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)


class Engine(CheckpointState):
    """A compiled DP training step. Made by ``longshield_fx.compile``.

    Capture happens at the first call, with that batch's shapes; every later physical
    batch must have the same shapes (pad with a mask: ``longshield_fx.data.PoissonBatches``).
    Packed batches (``packed_units``) may differ in their number of rows, each row count
    captured once: ``packing.pack_documents`` ends a logical batch in batches of a half, a
    quarter, ... of its rows, so that its last batch is not mostly padding.
    A capture is traced once per model structure per process: another engine of the model, or
    of a rebuilt one alike, takes the trace (``runtime.traces``; ``traces`` counts its own).

    Capture guards. A captured graph has the Python state its forward read baked in, so
    before each run (``accumulate``, ``per_sample_grads``, ``lower``) the engine checks that
    state against the capture's and recaptures when it changed (counted in ``captures``; the
    reason is logged at INFO level by ``longshield_fx.runtime.engine``). It checks

    - its own fingerprint of the model: every module's ``training`` flag and plain
      attributes (int, float, bool, str, None, dtype, device or tuples of those; not
      ``_``-names), the same of a module's ``config``/``cfg`` object, and each parameter's
      and buffer's name, identity, shape, dtype, device and ``requires_grad``;
    - dynamo's guards of the capture: whatever else the trace read (nested config values,
      containers, globals, closures, global torch state such as the default device) and
      the batch tensors' metadata.

    Not covered: Python state read by code dynamo does not trace (the body of a custom op).
    Tensor values need no guard: parameters, buffers and the batch are graph inputs, read
    at every run. A change between ``accumulate`` and ``finalize`` of one logical batch is
    refused (a step never mixes two states of the model): make it between steps. Evaluating with
    ``model.eval()`` and going back to ``model.train()`` before the next step recaptures nothing.
    """

    def __init__(self, model: nn.Module, config: DPConfig | None, mesh=None, checkpoint=None,
                 disable_passes=(), inner_ring: int | None = None, fsdp=None, reshard_after_forward: bool = True,
                 packed_units: int = 0, inductor: bool = False):
        self.model = model
        self.inductor = inductor
        self._compiled: dict[tuple, tuple] = {}  # key -> (its lowering, that lowering through inductor)
        self.packed_units = packed_units
        self.checkpoint = checkpoint
        self.config = config
        self.parallel = Parallel.from_mesh(model, mesh, inner_ring, packed=bool(packed_units))
        # Sharded model states: the parameters become DTensor shards (see runtime.fsdp).
        self.sharding = Sharding.from_mesh(mesh, fsdp, reshard_after_forward)
        # The ordered passes of each graph: "train" (clipped sums) and "per_sample" (the
        # per-sample gradients behind ``per_sample_grads``). "train" has every pass of
        # "per_sample"; a disabled pass is left out of each graph that has it (overlap is
        # only in "train"), and a name that is in neither is an error (raised here).
        cp = self.parallel.sp  # the sequence-parallel degree decides the passes
        sharded = self.sharding is not None
        layout = dict(cp=cp, checkpointing=checkpoint, fsdp=sharded)
        train = pipeline(training=True, **layout, disable=disable_passes)
        if "overlap" in {p.__name__ for p in train} and _threaded_gloo(mesh):
            # Collectives in flight together race in torch's two-thread gloo groups (see
            # _torch.serial_gloo); without overlap each is waited before the next is issued.
            log.info("compile: the overlap pass is left out: the mesh's gloo groups run collectives on "
                     "several worker threads (torch's race in ProcessGroupGloo::runLoop)")
            train = [p for p in train if p.__name__ != "overlap"]
        in_per_sample = {p.__name__ for p in pipeline(training=False, **layout)}
        self.pipelines = {
            "train": train,
            "per_sample": pipeline(training=False, **layout, disable=set(disable_passes) & in_per_sample)}
        if sharded:  # last of the checks: from here on the model's parameters are DTensor shards
            self.sharding.shard_model(model)
        self.captures = 0  # number of graph captures; stays 1 with fixed physical shapes (packed: 1 per row count)
        self.traces = 0  # of those, the ones traced here, not taken from another engine (runtime.traces)
        self._pristine = None  # (model fingerprint, its rows, an unrewritten copy of the last capture)
        self.nonfinite_samples = 0  # real samples whose gradient was inf/nan (contributed 0)
        # Keyed by (graph, rows): one lowering per graph and row count of the batches it ran.
        self._lowered: dict[tuple[str, int], Lowered] = {}
        # key -> (model fingerprint, dynamo's guards) at its capture: see "Capture guards".
        self._captured_from: dict[tuple[str, int], tuple] = {}
        self._graph_captures: dict[tuple[str, int], int] = {}
        # (key, shapes) of this logical batch's first graph and batch: the model state a step runs
        self._step_graph = None
        self._shapes = None
        # A batch of one runs as two rows, the second a masked copy of the first, when the graph
        # of one sample is refused and that of two is not (``lower``).
        self._pad_one = False
        self._accum: dict[str, torch.Tensor] | None = None
        self._accumulated = 0  # real samples since the last finalize (this rank)
        self._nonfinite_step = 0
        self.accountant = self._noise = None
        if config is not None:
            self.accountant = PrivacyAccountant(config.accountant)
            self._noise = self._new_noise("noise")
        # This engine's branch of its run, for the run ledger (run_core.RunLedger): a fresh id
        # and the steps, from the branch's first, that a ledger has recorded as released.
        self.ledger_branch = new_ledger_branch(0)

    # --- compilation ----------------------------------------------------------------------
    def lower(self, *example_batch, graph: str = "train") -> Lowered:
        """Capture and rewrite the step for batches shaped like ``example_batch``, without
        running it; returns the rewritten graph and what its passes recorded.

        ``graph``: "train" (per physical batch: loss sum, norms, clipped sums; needs a DP
        config) or "per_sample" (the graph behind ``per_sample_grads``). Cached: the first
        call captures, later calls return the same graph (the physical shapes are fixed; packed
        batches: one graph per row count) unless the model changed since (see the class
        docstring: capture guards).
        Tensors may be fake (``FakeTensorMode``): nothing is computed.
        """
        if graph not in self.pipelines:
            raise ValueError(f"engine.lower: graph must be one of {sorted(self.pipelines)}, got {graph!r}")
        if graph == "train" and self.config is None:
            raise ValueError("engine: training needs a DP config: longshield_fx.compile(model, config=DPConfig(...))")
        self._check_shapes(example_batch)
        batch = self._padded(example_batch)
        key = (graph, batch[0].shape[0])
        lowered = self._cached(key, self.parallel.shard(batch))
        if lowered is None:
            try:
                lowered = self._lower(key, batch)
            except UnsupportedModelError:
                # At a batch of one a size-1 dim can hold the batch as well as the one the rules
                # guessed ((T, 1, H) -> (T*1, H) or (T, 1*H)): the two-sample graph decides, its
                # verdict (and refusal, if any) is the model's, and a batch of one runs in it.
                if batch[0].shape[0] != 1:
                    raise
                self._pad_one = True
                key = (graph, 2)
                try:
                    lowered = self._lower(key, self._padded(example_batch))
                except UnsupportedModelError:
                    self._pad_one = False
                    raise
            if graph == "train" and self.packed_units:
                self._check_units_apart(lowered, self._padded(example_batch))
            self._lowered[key] = lowered
            if sum(k[0] == graph for k in self._lowered) == _ROW_COUNTS_WARNING:
                warnings.warn(
                    f"engine: {_ROW_COUNTS_WARNING} row counts of packed batches so far, each a capture of the {graph} "
                    "graph; longshield_fx.packing.pack_documents makes batches of rows, rows/2, rows/4, ... only",
                    RuntimeWarning, stacklevel=2)
        return lowered

    def _check_units_apart(self, lowered: Lowered, batch: tuple) -> None:
        """Packed documents: the probe that a unit's gradient reads its own tokens only
        (``engine_checks.check_units_apart``), run on ``lowered``'s train graph.

        Whether the probe runs, and how often, depends on the batch's values. With sharded model
        states each run gathers parameters with ranks that hold other batches (a new row count is
        captured in the same round on every rank, one rank's batch real, another's blank): every
        rank probes rank 0's batch, and each decision is taken on the largest measure of any
        rank, so that all run the graph together, as often, and refuse together."""
        agree = None
        if self.sharding is not None and not in_fake_world() and not any(isinstance(t, FakeTensor) for t in batch):
            batch = tuple(t.clone() for t in batch)
            for t in batch:
                dist.broadcast(t, src=0)

            def largest_on_any_rank(x: float) -> float:  # GPU kernels' jitter can differ between ranks
                t = torch.tensor([x], dtype=torch.float64, device=batch[0].device)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                return float(t)
            agree = largest_on_any_rank
        check_units_apart(batch, lambda probe: self._probe_norms(lowered, probe), self._dtype(), agree)

    def _probe_norms(self, lowered: Lowered, batch: tuple) -> torch.Tensor:
        """The train graph's per-unit norms for ``batch``, every row counted, dropout drawn alike."""
        captured = lowered.captured
        cotangent = torch.ones(batch[0].shape[0], dtype=val(captured.cotangent_placeholder()).dtype,
                               device=batch[0].device)
        args = self._args(captured, self.parallel.shard(batch), cotangent)
        device = batch[0].device
        with torch.no_grad(), torch.random.fork_rng(**({} if device.type == "cpu" else {"device_type": device.type})):
            torch.manual_seed(0)
            _, norms, *_ = lowered.gm(*args)
        return norms.double()

    def _runner(self, key: tuple[str, int], lowered: Lowered):
        """What runs ``lowered``: its graph module, or (``compile(..., inductor=True)``) that
        module through inductor, compiled once per lowering."""
        if not self.inductor:
            return lowered.gm
        if self._compiled.get(key, (None,))[0] is not lowered:
            lowered.gm.code  # reading it makes a lazily recompiled module real: dynamo skips the lazy forward
            self._compiled[key] = (lowered, torch.compile(lowered.gm, fullgraph=True, dynamic=False))
        return self._compiled[key][1]

    def _padded(self, batch: tuple, mask: torch.Tensor | None = None):
        """``batch`` (and ``mask``) as the graph runs them: a batch of one as two rows, the second a
        copy of the first, masked out, where the graph is the two-sample one (``_pad_one``)."""
        if self._pad_one:
            batch = tuple(torch.cat([t, t]) for t in batch)
            mask = None if mask is None else torch.cat([mask, torch.zeros_like(mask)])
        return batch if mask is None else (batch, mask)

    def _cached(self, key: tuple[str, int], sharded_batch) -> Lowered | None:
        """The lowering of ``key`` (graph, rows) if the model is still what it was captured from,
        else None (dropped: the caller recaptures). A change inside a logical batch is refused."""
        graph = key[0]
        lowered = self._lowered.get(key)
        within_step = graph == "train" and self._accum is not None
        # Inside a step, a graph of other rows than the step's first batch (a new row count, or
        # one stale from before the step) is captured only if the model is still what the step
        # began with: the step's first graph still passes its own checks.
        if lowered is None:
            if within_step:
                self._refuse_a_change_since_the_step_began()
            return None
        change = self._change(key, sharded_batch)
        if change is None:
            return lowered
        if within_step:
            self._refuse_a_change_since_the_step_began()
        log.info("engine: recapturing the %s graph of %d rows: %s", graph, key[1], change)
        n = self._graph_captures[key]
        if n + 1 == _RECAPTURE_WARNING:
            warnings.warn(
                f"engine: the model changed again ({change}); this is capture {n + 1} of the {graph} graph, and "
                "each one traces the model anew. A Python attribute that changes every step (a schedule, a "
                "counter) belongs in a tensor buffer, which the graph reads as an input", RuntimeWarning, stacklevel=3)
        del self._lowered[key]
        return None

    def _refuse_a_change_since_the_step_began(self) -> None:
        """Raise if the model changed since this logical batch's first accumulate: its graph's
        fingerprint and guards, checked on a batch shaped like that first one."""
        key, specs = self._step_graph
        change = self._change(key, tuple(torch.empty_strided(shape, stride, **kw) for shape, stride, kw in specs))
        if change is not None:
            raise ValueError(
                f"engine: the model changed since this logical batch's first accumulate ({change}); "
                "its physical batches must all run the same model. Make such changes between steps (after "
                "engine.finalize), or undo the change to finish this logical batch")

    def _change(self, key: tuple[str, int], sharded_batch) -> str | None:
        """What changed, in words, since ``key``'s graph was captured; None if nothing did."""
        state, guards = self._captured_from[key]
        now = fingerprint(self.model)
        if now != state:
            return describe_change(state, now)
        if guards is None:
            return None
        failed = self._guard_failure(guards, sharded_batch)
        return None if failed is None else f"a guard of the capture failed: {failed}"

    def _guard_failure(self, guards, sharded_batch) -> str | None:
        """Dynamo's guards checked on the live model as ``capture`` saw it: in grad mode (the
        caller's does not matter: capture and runs set their own) and with the capture's
        fixed-shape forwards swapped in."""
        module = self.parallel.capture_module(self.model)
        with torch.enable_grad(), for_capture(module):
            return guards.failure(module, sharded_batch)

    @_fewer_gc_passes()
    def _lower(self, key: tuple[str, int], batch) -> Lowered:
        dtype = self._dtype()
        state = fingerprint(self.model)  # before capture: what the graph is traced from
        model = self.parallel.capture_module(self.model)
        if dtype is not None and dtype != next(model.parameters()).dtype and self.sharding is None:
            check_no_forward_holds_a_module(model)
            model = copy.deepcopy(model).to(dtype)  # capture only; the live model keeps its dtype
        batch = self.parallel.shard(batch)
        captured = self._shared_capture(state, key[1], batch)
        if captured is None:
            first = next(model.parameters())
            traced = (type(model), dtype or first.dtype, self.sharding is not None, type(first),
                      tuple((tuple(t.shape), t.dtype, t.device) for t in batch))
            traced_key = trace_key(self.model, state, traced)
            captured = shared_trace(traced_key, self.model, lambda guards: self._guard_failure(guards, batch))
            if captured is None:
                # the joint graph needs autograd, whatever mode the caller is in; a sharded model
                # is traced with full-shape fake parameters (in the compute dtype) in its shards' place
                full = self.sharding.full_parameters(model, dtype) if self.sharding else contextlib.nullcontext()
                with torch.enable_grad(), full:
                    captured, caught = trace(capture, model, batch)
                self.traces += 1
                keep_trace(traced_key, self.model, captured, caught)
            self.captures += 1
            self._pristine = (state, key[1], captured.copy())  # the other graph starts from this capture
        self._graph_captures[key] = self._graph_captures.get(key, 0) + 1
        self._captured_from[key] = (state, captured.gm.meta.get(GUARDS))
        B = batch[0].shape[0]
        loss_val = val(captured.gm.graph.output_node().args[0][0])
        if loss_val is None or tuple(loss_val.shape) != (B,):
            raise UnsupportedModelError(
                f"the model must return per-sample losses of shape ({B},), got "
                f"{None if loss_val is None else tuple(loss_val.shape)}; wrap a language model in "
                "longshield_fx.CausalLMLoss or return loss.sum(dim=1)-style per-sample values")
        par = self.parallel
        ctx = PassContext(captured, B, self.config, sp_size=par.sp, sp_group_name=par.sp_group_name,
                          sp_rank=par.sp_rank, cp_size=par.cp, cp_group_name=par.cp_group_name,
                          cp_inner=par.inner_ring, hp_size=par.hp, hp_group_name=par.hp_group_name,
                          checkpoint=self.checkpoint, packed_units=self.packed_units, **self._fsdp_context())
        # Passes first: a pass names a mixing op (batch norm) better than the mutation does.
        lowered = lower(ctx, self.pipelines[key[0]])
        if captured.mutations:
            raise UnsupportedModelError(
                f"the forward mutates model state ({', '.join(captured.mutations)}); the compiled step "
                "would drop those updates. Way out: keep buffers constant during the training step")
        return lowered

    def _fsdp_context(self) -> dict:
        sh = self.sharding
        if sh is None:
            return {}
        return {"fsdp_size": sh.n, "fsdp_group_name": sh.group_name, "fsdp_rank": sh.index,
                "fsdp_sp_ranks": tuple(self.parallel.sp_rank_of(r) for r in sh.members),
                "fsdp_replica_group_name": sh.replica_group_name,
                "reshard_after_forward": sh.reshard_after_forward}

    def _args(self, captured, sharded_batch, cotangent) -> list:
        local = self.sharding.local if self.sharding is not None else None
        return captured.gather_args(self.model, sharded_batch, cotangent, dtype=self._dtype(), local=local)

    def _shared_capture(self, state, rows: int, sharded_batch):
        """A copy of the last capture when the model is still what it was traced from and the
        rows are its rows: both graphs ("train", "per_sample") rewrite the same joint graph, so
        one trace serves both."""
        if self._pristine is None or self._pristine[:2] != (state, rows):
            return None
        captured = self._pristine[2]
        guards = captured.gm.meta.get(GUARDS)
        if guards is not None and self._guard_failure(guards, sharded_batch) is not None:
            return None
        return captured.copy()

    def _check_shapes(self, batch):
        self._shapes = fixed_batch_shapes(batch, self.parallel, self._shapes, rows_may_vary=bool(self.packed_units))

    def _check_units(self, units: torch.Tensor) -> int:
        """The samples of a packed physical batch (``engine_checks.held_unit_slots``)."""
        return held_unit_slots(units, self.packed_units)

    def _dtype(self):
        return None if self.config is None else self.config.compute_dtype

    # --- training -------------------------------------------------------------------------
    def accumulate(self, *batch, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Forward, backward and clip one physical batch; add its clipped sum to the accumulator.

        ``mask`` (B,) of 0/1 marks padding rows (0), which contribute exactly nothing.
        Returns the summed loss of the real samples.
        """
        self._check_shapes(batch)
        B = batch[0].shape[0]
        if B == 0:
            raise ValueError("engine.accumulate: an empty physical batch (0 rows); physical batches have a fixed "
                             "size and an empty Poisson draw is a batch of masked rows (LogicalBatch.physical)")
        if self.packed_units:
            if mask is not None:
                raise ValueError("engine.accumulate: packed batches take no mask: a unit slot no token maps to "
                                 "is no sample (longshield_fx.packing.pack_documents fills the slots)")
            real_units = self._check_units(batch[-1])
        if mask is None:
            mask = torch.ones(B)
        mask = torch.as_tensor(mask)
        if tuple(mask.shape) != (B,):
            raise ValueError(f"engine.accumulate: mask must have shape ({B},), got {tuple(mask.shape)}")
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError("engine.accumulate: mask must hold only 0 (padding) and 1 (real sample)")
        run, run_mask = self._padded(batch, mask)
        sharded = self.parallel.shard(run)
        lowered = self._cached(("train", run[0].shape[0]), sharded)
        if lowered is None:  # shapes checked above; a batch of one may turn out to run as two rows
            lowered = self.lower(*batch)
            run, run_mask = self._padded(batch, mask)
            sharded = self.parallel.shard(run)
        batch, mask = run, run_mask
        key = ("train", batch[0].shape[0])
        if self._accum is None:
            self._step_graph = key, [(t.shape, t.stride(), {"dtype": t.dtype, "device": t.device}) for t in sharded]
        captured, gm = lowered.captured, self._runner(key, lowered)
        loss_val = val(captured.cotangent_placeholder())
        cotangent = mask.to(device=batch[0].device, dtype=loss_val.dtype)
        args = self._args(captured, sharded, cotangent)
        with torch.no_grad(), self.parallel.collective_errors(), self.parallel.model_rng():
            loss_sum, norms, *sums = gm(*args)
            loss_sum = self.parallel.sum_over_sp(loss_sum)
        norms = norms[:self.packed_units or B]  # a padded copy (or the padding slot) is no sample
        nonfinite = int((~torch.isfinite(norms)).sum())
        self.nonfinite_samples += nonfinite
        self._nonfinite_step += nonfinite
        self._accumulated += real_units if self.packed_units else int(mask.sum())
        if self._accum is None:
            self._accum = {n: s.clone() for n, s in zip(captured.param_names, sums)}
        else:
            for n, s in zip(captured.param_names, sums):
                self._accum[n] += s
        self.last_norms = norms
        return loss_sum

    def finalize(self, batch: LogicalBatch) -> None:
        """Add N(0, σ²C²) once per coordinate, divide by the EXPECTED batch size, write .grad.

        ``batch`` is the ``longshield_fx.data.LogicalBatch`` whose physical batches were
        accumulated: its sampler's q is what the accountant records and its q·N is the
        divisor, so q has one source. Then any torch optimizer can step. The accumulator is
        cleared and one step is recorded with the privacy accountant.
        """
        if not isinstance(batch, LogicalBatch):
            raise TypeError("engine.finalize: pass the longshield_fx.data.LogicalBatch whose physical batches "
                            f"were accumulated (it carries the sampler's q), got {type(batch).__name__}")
        if self._accum is None:
            raise RuntimeError("engine.finalize: nothing accumulated since the last finalize; call "
                               "engine.accumulate(...) for each physical batch first (an empty logical "
                               "batch is one fully masked physical batch)")
        with self.parallel.collective_errors():
            accumulated = self.parallel.sum_over_dp(self._accumulated)
        if accumulated != batch.size:
            raise ValueError(f"engine.finalize: {accumulated} real samples were accumulated since the last "
                             f"finalize, but the logical batch has {batch.size}; accumulate every physical "
                             "batch of this logical batch (mask= marks its real rows), then finalize it")
        sigma_c = self.config.noise_multiplier * self.config.max_grad_norm
        params = dict(self.model.named_parameters())
        if self.sharding is not None:  # the accumulator holds this rank's (padded) shards
            sums = self._accum
        else:
            shard_dims = self._lowered[self._step_graph[0]].shard_dims  # the graph this step began with
            with self.parallel.collective_errors():
                sums = {name: self.parallel.full_clipped_sum(total, shard_dims[name]).contiguous()
                        for name, total in self._accum.items()}
        if sigma_c > 0:
            self._noise.add_noise(list(sums.values()), sigma_c)
        for name, total in sums.items():
            p = params[name]
            if self.sharding is not None:
                p.grad = self.sharding.to_param_grad(total / batch.expected_size, p)
            else:  # in place: the accumulator becomes the gradient, not a second copy of it
                p.grad = total.div_(batch.expected_size).to(device=p.device, dtype=p.dtype)
        self._accum = None
        self._accumulated = 0
        self.accountant.step(self.config.noise_multiplier, batch.sample_rate)
        if self._nonfinite_step:
            warnings.warn(
                f"engine.finalize: {self._nonfinite_step} real sample(s) of this logical batch had a non-finite "
                "gradient (inf/nan) and contributed exactly zero (the sensitivity stays ≤ C). This count "
                "comes from private data and is NOT covered by ε: do not publish it", RuntimeWarning)
            self._nonfinite_step = 0

    def epsilon(self, delta: float) -> float:
        """ε spent so far at ``delta`` (the accountant of ``config.accountant``, from dp-accounting).

        The unit is one dataset row as the sampler sees it (a document when each row is a
        document, as in the CLI); add/remove-one adjacency, Poisson sampling.
        """
        if self.config is None:
            raise ValueError("engine.epsilon: the engine has no DP config")
        return self.accountant.epsilon(delta)

    # --- inspection -----------------------------------------------------------------------
    def per_sample_grads(self, *batch) -> dict[str, torch.Tensor]:
        """name -> per-sample gradient (B, *param.shape), full and unsharded (for tests)."""
        B = batch[0].shape[0] if batch and isinstance(batch[0], torch.Tensor) and batch[0].dim() else None
        if B == 0:  # no sample, no gradient: nothing to capture
            return {n: torch.zeros(0, *p.shape, dtype=p.dtype, device=batch[0].device)
                    for n, p in self.model.named_parameters() if p.requires_grad}
        if self.packed_units:
            self._check_units(batch[-1])
        lowered = self.lower(*batch, graph="per_sample")
        captured, gm = lowered.captured, lowered.gm
        batch, cotangent = self._padded(batch, torch.ones(B, dtype=val(captured.cotangent_placeholder()).dtype,
                                                          device=batch[0].device))
        args = self._args(captured, self.parallel.shard(batch), cotangent)
        with torch.no_grad(), self.parallel.collective_errors(), self.parallel.model_rng():
            _, *grads = gm(*args)
            # Each cp rank holds the partial gradient of its tokens; the full one is their sum.
            grads = [self.parallel.sum_over_sp(g)[:self.packed_units or B] for g in grads]
        return dict(zip(captured.param_names, grads))

    def communication_bytes(self) -> dict[str, int]:
        """Bytes each kind of collective in the training graph moves per physical batch.

        From the graph's fake-tensor metadata: a reduce-scatter or all-reduce counts its
        input's bytes, an all-gather the gathered buffer; ring attention counts the K/V
        blocks it forwards ((cp-1) hops of K and V forward; K and V, and fp32 dK and dV,
        backward). The input-stationary per-sample gradient collectives do not depend on
        T; ring attention's and the output-stationary all-gathers do.
        """
        lowered = self._train_lowering()
        if lowered is None:
            raise RuntimeError("engine.communication_bytes: call engine.lower(*batch) or accumulate once first "
                               "(capture is lazy)")
        return self.parallel.communication_bytes(lowered.gm, self._group_ranks())

    def _train_lowering(self) -> Lowered | None:
        """The train graph's lowering of the most rows (packed batches may have several), or None."""
        keys = [k for k in self._lowered if k[0] == "train"]
        return self._lowered[max(keys, key=lambda k: k[1])] if keys else None

    def _group_ranks(self) -> dict[str, int]:
        """This rank's index in the groups ``Parallel`` does not hold (the fsdp group)."""
        return {} if self.sharding is None else {self.sharding.group_name: self.sharding.index}

    def __repr__(self) -> str:
        sharding = "" if self.sharding is None else f", {self.sharding}"
        lines = [f"Engine(config={self.config!r}, captures={self.captures}, {self.parallel}{sharding})"]
        for graph, passes in self.pipelines.items():
            lines.append(f" {graph} pipeline: " + " -> ".join(p.__name__ for p in passes))
            keys = sorted(k for k in self._lowered if k[0] == graph)
            if not keys:
                lines.append("  not lowered yet (capture happens at the first call, or engine.lower(*batch))")
            for key in keys:
                lowered = self._lowered[key]
                if len(keys) > 1:
                    lines.append(f"  batches of {key[1]} rows:")
                lines.append(format_log(lowered.log))
                lines.append("  per-sample rules: " + ", ".join(f"{n}={r}" for n, r in lowered.rules.items()))
        return "\n".join(lines)
