"""``longshield-fx plan``: the longest context that fits, from the rewritten graph's own tensors.

For a (model, GPUs, GPU memory, cp, checkpointing, micro-batch, dtype) the planner builds the
training graph of ONE cp rank on fake tensors (real Llama shapes, no real memory, a fake
process group for cp > 1), with every pass the engine runs, and adds up per GPU:

- model states, sharded ZeRO-3 over ALL N GPUs as ``compile(..., fsdp=<every mesh dim>)``
  lays them out (as longshield.md assumes: "each GPU holds a sharded model state O(M/N)"; TorchTitan
  shards FSDP over the dp x cp mesh too). The shard one GPU holds is read off the model
  sharded by the engine's own code (``runtime.fsdp.Sharding``) on a fake process group of N
  ranks: every parameter ``Shard(0)``, dim 0 padded to ceil(p/N) rows. With S its elements:
    params     the compute-dtype copy of the shard the graph takes    2 (bf16) or 4 (fp32) bytes x S
    grads      the fp32 clipped-sum accumulator shard                 4 bytes x S
    optimizer  AdamW: the fp32 shard itself (bf16 only) + m + v       12 (bf16) or 8 (fp32) bytes x S
    gathered   all-gather working set: the two largest FSDP units (a transformer block, the
               embedding, the norm + output head), unsharded in the compute dtype (the unit
               in use and the one prefetched); a formula, as the captured graph has no gathers;
- activations + per-sample gradients: the liveness peak of the captured per-rank graph's
  intermediates (``longshield_fx.tools.memory.estimate_memory``) plus its batch inputs. This is
  where the per-sample gradients and their cp shards, the reduce-scatter inputs and
  outputs, the clipped sums the graph returns, ring attention's outputs and the
  checkpointing recomputation all live: they are graph tensors;
- a fixed overhead (default 5 GiB): 2 GiB that an "80 GB" H100 does not give the allocator
  (torch sees 79.18 GiB; CUDA context, cuBLAS and NCCL take 1.24 GiB more, measured on an
  H100) plus 3 GiB of allocator fragmentation, the reserved-minus-active gap longshield.md
  reports for non-DP training with checkpointing (61.9 vs 58.9 GB, Table 5 text). Memory is
  in GiB (2^30 bytes), as torch and TorchTitan report it.

The graph's memory is affine in T: attention is a flash kernel (out and log-sum-exp, no
T x T tensor), every other tensor is (B, T, ·), (B, ·) or T-free, and the graph's nodes
and their order do not depend on T. So each node's live-bytes is fitted as a + b*T from
captures at two small T (the node sequences must match, or the planner stops) and the
peak at any T is the max over nodes of the fitted lines: exact for this graph, not an
extrapolation of the peak itself (the peak moves between phases as T grows, e.g. from the
per-sample gradients at short T to the activations kept by checkpointing at long T; a single
line through two peaks would miss that). ``tests/tools/test_plan.py`` checks the prediction against a direct capture at a third T.

A plan captures each layout at two T (``tools.plan_graphs``), run ``jobs`` at a time in worker
processes, memoised in-process and cached on disk (``--cache-dir``), keyed by a hash of the
graph-building sources and the torch version. A capture costs about a second per layer on a
2-core CPU, so a reference Llama of more than 18 layers is captured at 4, 5 and 6 layers and
extrapolated in layers (``tools.plan_layers``: exact where its rule, checked on those captures,
holds; captured whole where it does not). The comparison with the paper's tables is
``tools.paper_tables``.

Two layouts are planned side by side:
- "DP cp=<cp>": longshield_fx's layout, the sequence sharded over cp ranks, per-sample
  gradients reduce-scattered over cp (the graph's own shard_grads pass);
- "FSDP-style": cp=1 on every GPU (ZeRO-DP's layout): activations unsharded, and, in
  grad-sample mode with flat clipping, the full per-sample gradient of every parameter
  for the micro-batch is live (it cannot be sharded: each GPU holds other samples).
  No activation checkpointing (hook-based DP cannot checkpoint, longshield.md §2, §3.3).
  This is the ceiling argument of longshield.md Table 2; ZeRO-DP itself uses ghost
  clipping, which this graph does not model (see benchmarks/results/planner.md): its
  captures leave out the ``ghost_norm`` pass, which at the fit points' T would put some
  layers on ghost norm and others not, depending on T.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..config import DPConfig
from . import plan_layers
from .plan_graphs import DTYPES, HF_CONFIG, Capture, GraphSpec, measure, model_label, model_shape, prefetch
from .plan_layers import LAYERS

__all__ = ["DTYPES", "Breakdown", "GraphFit", "GraphSpec", "LayoutPlan", "ModelStats", "PlanError", "check_args",
           "fit_graph", "fit_points", "fit_requests", "format_plan", "measure", "model_stats", "plan", "plan_layout",
           "prefetch", "tokens"]

GiB = 2 ** 30
MODELS = ("llama3.2-1b", "llama3.2-3b", "llama3.1-8b")
# Fixed overhead per GPU, measured on an H100 80GB HBM3 (torch 2.11, CUDA 13) with a 1-rank NCCL group:
# torch sees 79.18 GiB of an "80 GB" card (so --gpu-mem-gb 80 overstates it by 0.82 GiB); outside the
# allocator, the CUDA context takes 0.60 GiB, cuBLAS + flash attention 0.08 GiB more, NCCL 0.55 GiB more.
OUTSIDE_ALLOCATOR_GIB = 2.0   # 0.82 + 1.24 measured, rounded down (more NCCL peers add a little)
# Allocator fragmentation: reserved minus active memory. longshield.md (Table 5 text) reports 61.9 GB
# reserved vs 58.9 GB active for non-DP training with checkpointing: 3 GB.
FRAGMENTATION_GIB = 3.0
DEFAULT_OVERHEAD_GIB = OUTSIDE_ALLOCATOR_GIB + FRAGMENTATION_GIB
MAX_LOG2_T = 24  # the search stops at 16M tokens


# --- the affine fit -----------------------------------------------------------------------------

@dataclass
class GraphFit:
    """Per-node live bytes = intercept + slope * T + curvature * T², from captures at two T
    (curvature 0: the affine model) or three (same nodes)."""

    spec: GraphSpec
    T_points: tuple[int, ...]
    intercept: torch.Tensor  # float64 (nodes,)
    slope: torch.Tensor
    curvature: torch.Tensor
    names: list[str]
    batch_intercept: float
    batch_slope: float
    capture_s: float
    layers: tuple[int, ...] = ()  # the layer counts captured when extrapolated in layers (tools.plan_layers)

    @classmethod
    def from_captures(cls, spec: GraphSpec, *caps: Capture, layers: tuple[int, ...] = ()) -> "GraphFit":
        a = caps[0]
        for b in caps[1:]:
            if a.ops_digest != b.ops_digest or len(a.timeline) != len(b.timeline):
                raise RuntimeError(f"plan: the graph of {spec.label()} has different nodes at T={a.T} and T={b.T}; "
                                   "its memory cannot be fitted per node (report this: the planner assumes the "
                                   "graph's structure does not depend on T)")
        Ts = torch.tensor([c.T for c in caps], dtype=torch.float64)
        live = torch.tensor([c.timeline for c in caps], dtype=torch.float64)  # (points, nodes)
        powers = torch.stack([Ts ** k for k in range(len(caps))], 1)  # an exact fit: as many terms as points
        coef = torch.linalg.solve(powers, live)
        curvature = coef[2] if len(caps) == 3 else torch.zeros_like(coef[0])
        grows = (live[1:] - live[:-1] >= 0).all(0) & (curvature >= -1e-6)
        if not bool(grows.all()):
            i = int(torch.nonzero(~grows)[0])
            raise RuntimeError(f"plan: live bytes at node {a.names[i]} shrink with T in {spec.label()}; "
                               "the fitted model does not hold")
        b = caps[1]
        bslope = (b.batch_bytes - a.batch_bytes) / (b.T - a.T)
        return cls(spec, tuple(c.T for c in caps), coef[0], coef[1], curvature, a.names,
                   a.batch_bytes - bslope * a.T, bslope, sum(c.capture_s for c in caps), layers)

    def peak(self, T: int) -> tuple[float, str]:
        """(bytes, node name) of the graph's peak at ``T``: intermediates plus batch inputs."""
        live = self.intercept + self.slope * T + self.curvature * T * T
        i = int(torch.argmax(live))
        return float(live[i]) + self.batch_intercept + self.batch_slope * T, self.names[i]


def fit_points(sp: int, quadratic: bool = False) -> tuple[int, ...]:
    """The sequence lengths captured: 1024 and 2048 tokens per sequence-parallel rank (and 4096
    for a ``quadratic`` fit). From one ``DPConfig.loss_chunk`` of positions on (1024 rows: the
    planner's micro-batches have mbs ≥ 1) the chunked loss's working set, one chunk of logits,
    stops growing with T, so every node's live bytes are affine in T from the first point on
    for the reference Llama (flash attention, no T x T tensor). A Hugging Face model's traced
    attention builds its (T, T) mask, so its fit is quadratic."""
    assert DPConfig.loss_chunk <= 1024
    return (1024 * sp, 2048 * sp, 4096 * sp) if quadratic else (1024 * sp, 2048 * sp)


def _points(spec: GraphSpec) -> tuple[int, ...]:
    return fit_points(spec.sp, quadratic=spec.model.startswith(HF_CONFIG))


def _layer_specs(spec: GraphSpec) -> list[GraphSpec] | None:
    """The specs of the same graph with ``plan_layers.LAYERS`` decoder layers, when ``spec``'s
    model has more than ``plan_layers.WHOLE_UP_TO`` (a reference Llama; a Hugging Face model is
    always captured whole)."""
    if spec.model.startswith(HF_CONFIG) or spec.layers <= plan_layers.WHOLE_UP_TO:
        return None
    overrides = {k: v for k, v in spec.overrides if k != "n_layers"}
    own = model_shape(spec.model)["layers"]
    # a count equal to the model's own is no override: that capture is shared with the model's own spec
    return [replace(spec, overrides=tuple((overrides | ({} if k == own else {"n_layers": k})).items()))
            for k in LAYERS]


def fit_requests(specs) -> list[tuple[GraphSpec, int]]:
    """The (spec, T) captures that ``fit_graph`` needs for each of ``specs`` (for ``prefetch``)."""
    return [(s, T) for spec in specs for s in (_layer_specs(spec) or [spec]) for T in _points(spec)]


def fit_graph(spec: GraphSpec, cache_dir: Path | None = None, points: tuple[int, ...] | None = None) -> GraphFit:
    """Each node's live bytes as a function of T, from captures at ``points`` (default: the fit
    points). A reference Llama of more than ``plan_layers.WHOLE_UP_TO`` layers is captured at
    ``plan_layers.LAYERS`` layers and extrapolated in layers (checked to the byte on those
    captures); where that check fails, it is captured whole."""
    points = points or _points(spec)
    small = _layer_specs(spec)
    if small:
        caps = [_extrapolated(small, T, spec.layers, cache_dir) for T in points]
        if all(caps):
            return GraphFit.from_captures(spec, *caps, layers=LAYERS)
    return GraphFit.from_captures(spec, *(measure(spec, T, cache_dir) for T in points))


def _extrapolated(specs: list[GraphSpec], T: int, layers: int, cache_dir: Path | None) -> Capture | None:
    """The representative timeline of ``layers`` layers at ``T`` from the captures of ``specs``
    (one per ``LAYERS``), or None when the layer rule does not hold for them."""
    caps = {k: measure(s, T, cache_dir) for k, s in zip(LAYERS, specs)}
    parts = plan_layers.template({k: c.ops for k, c in caps.items()})
    found = parts and plan_layers.extrapolate(parts, {k: c.timeline for k, c in caps.items()}, caps[LAYERS[-1]].names,
                                              layers)
    if not found:
        return None
    timeline, names = found
    digest = hashlib.sha256(repr((layers, parts)).encode()).hexdigest()
    last = caps[LAYERS[-1]]
    return Capture(T, timeline, names, [], digest, last.batch_bytes, sum(c.capture_s for c in caps.values()))


# --- model states -------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelStats:
    params: int          # unique trainable parameters
    units: tuple         # parameter counts of the FSDP units, largest first
    name: str = ""
    overrides: tuple = ()

    def shard_numel(self, gpus: int | float) -> float:
        """Elements of the parameter shard one GPU holds when the engine shards the model over
        ``gpus`` ranks (``compile(..., fsdp=...)``): each parameter's padded dim-0 shard,
        read off the model sharded on a fake process group. 0 for ``math.inf``."""
        if gpus == math.inf:
            return 0.0
        if gpus == 1:
            return float(self.params)
        return float(_shard_numel(self.name, self.overrides, int(gpus)))


_SHARDS: dict[tuple, int] = {}


def _shard_numel(name: str, overrides: tuple, gpus: int) -> int:
    key = (name, overrides, gpus)
    if key not in _SHARDS:
        import longshield_fx as lf
        from longshield_fx.runtime.fsdp import Sharding

        from .._torch import FakeTensorMode
        from .plan_graphs import _world, build_lm

        with FakeTensorMode():
            model = lf.CausalLMLoss(build_lm(name, overrides))
        with _world(1, dp=gpus) as mesh:
            sharding = Sharding(mesh, tuple(mesh.mesh_dim_names))
            sharding.shard_model(model)
            _SHARDS[key] = sum(sharding.local(p).numel() for p in model.parameters())
    return _SHARDS[key]


def model_stats(name: str, overrides: tuple = ()) -> ModelStats:
    """Parameter count and FSDP units (each block; the embedding; the rest: the final norm and
    the output head, which with tied embeddings is the embedding itself) from the real module, on
    meta tensors. The blocks are the longest ``nn.ModuleList`` of the model."""
    from .plan_graphs import build_lm

    with torch.device("meta"):
        lm = build_lm(name, overrides)
    params = sum(p.numel() for p in lm.parameters())  # a tied weight is one parameter, counted once
    blocks = max((m for m in lm.modules() if isinstance(m, torch.nn.ModuleList)), key=len)
    units = [sum(p.numel() for p in block.parameters()) for block in blocks]
    embedding = (lm.get_input_embeddings() if hasattr(lm, "get_input_embeddings") else lm.tok_embeddings).weight.numel()
    units += [embedding, params - sum(units) - embedding]
    return ModelStats(params, tuple(sorted(units, reverse=True)), name, tuple(overrides))


@dataclass
class Breakdown:
    """Bytes per GPU at one sequence length."""

    T: int
    params: float
    grads: float
    optimizer: float
    gathered: float
    graph: float           # activations + per-sample gradients + collective buffers + batch
    overhead: float
    peak_node: str = ""

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.gathered + self.graph + self.overhead

    def as_gib(self) -> dict:
        keys = ("params", "grads", "optimizer", "gathered", "graph", "overhead", "total")
        return {k: getattr(self, k) / GiB for k in keys}


def state_bytes(stats: ModelStats, gpus: int | float, dtype: str) -> tuple[float, float, float, float]:
    """(params, grads, optimizer, gathered) bytes per GPU; ``gpus`` may be ``math.inf``."""
    width = 2 if dtype == "bf16" else 4
    S = stats.shard_numel(gpus)
    params = width * S
    grads = 4 * S
    optimizer = (12 if dtype == "bf16" else 8) * S
    gathered = width * sum(stats.units[:2]) if gpus > 1 else 0.0  # one GPU: nothing to gather
    return params, grads, optimizer, gathered


# --- the plan -----------------------------------------------------------------------------------

@dataclass
class LayoutPlan:
    title: str
    spec: GraphSpec
    fit: GraphFit
    gpus: float
    gpu_mem: float            # bytes
    overhead: float           # bytes
    stats: ModelStats
    max_T: int | None = None
    at_max: Breakdown | None = None
    smallest: Breakdown | None = None   # the breakdown at the smallest T tried, when nothing fits

    def breakdown(self, T: int) -> Breakdown:
        params, grads, optimizer, gathered = state_bytes(self.stats, self.gpus, self.spec.dtype)
        graph, node = self.fit.peak(T)
        return Breakdown(T, params, grads, optimizer, gathered, graph, self.overhead, node)

    def solve(self) -> "LayoutPlan":
        """The longest power-of-two T (a multiple of 2*cp*hp) whose total fits in GPU memory.

        Memory is non-decreasing in T (every fitted slope is >= 0), so the search goes up
        the powers of two until the first that does not fit.
        """
        self.max_T, self.at_max = None, None
        first = max(1, math.ceil(math.log2(2 * self.spec.sp)))
        for k in range(first, MAX_LOG2_T + 1):
            b = self.breakdown(2 ** k)
            if b.total > self.gpu_mem:
                if self.at_max is None:
                    self.smallest = b
                break
            self.max_T, self.at_max = 2 ** k, b
        return self


def plan_layout(title: str, spec: GraphSpec, *, gpus: float, gpu_mem_gib: float,
                overhead_gib: float = DEFAULT_OVERHEAD_GIB, cache_dir: Path | None = None) -> LayoutPlan:
    fit = fit_graph(spec, cache_dir)
    stats = model_stats(spec.model, spec.overrides)
    return LayoutPlan(title, spec, fit, gpus, gpu_mem_gib * GiB, overhead_gib * GiB, stats).solve()


def plan(model: str, gpus: int, gpu_mem_gib: float, *, cp: int | None = None, checkpoint: str | None = None,
         mbs: int = 1, dtype: str = "bf16", overhead_gib: float = DEFAULT_OVERHEAD_GIB,
         cache_dir: Path | None = None, jobs: int = 1, hp: int = 1) -> tuple[LayoutPlan, LayoutPlan]:
    """(DP layout with cp x hp, FSDP-style layout) for ``model`` on ``gpus`` GPUs of ``gpu_mem_gib`` GiB.

    ``jobs``: captures run at once in worker processes (two per layout, each at 4, 5 and 6 layers for a
    reference Llama of more layers)."""
    cp = gpus // hp if cp is None else cp
    check_args(model, gpus, gpu_mem_gib, cp, mbs, hp)
    dp_spec, fsdp_spec = GraphSpec(model, cp, checkpoint, mbs, dtype, hp=hp), GraphSpec(model, 1, None, mbs, dtype)
    prefetch(fit_requests([dp_spec, fsdp_spec]), cache_dir, jobs)
    kw = dict(gpus=gpus, gpu_mem_gib=gpu_mem_gib, overhead_gib=overhead_gib, cache_dir=cache_dir)
    dp = plan_layout(f"DP cp={cp}" + (f" hp={hp}" if hp > 1 else "") + (f" {checkpoint}" if checkpoint else ""),
                     dp_spec, **kw)
    fsdp = plan_layout("FSDP-style cp=1", fsdp_spec, **kw)
    return dp, fsdp


class PlanError(ValueError):
    """A bad request: the CLI prints it as one line and exits 2."""


def check_args(model: str, gpus, gpu_mem_gib, cp, mbs, hp: int = 1) -> None:
    """``model``: one of ``MODELS`` or ``plan_graphs.hf_model(config)``."""
    if model not in MODELS and not model.startswith(HF_CONFIG):
        raise PlanError(f"unknown model {model!r}; choose from {', '.join(MODELS)}, or a Hugging Face model "
                        "directory or config JSON")
    if not (isinstance(gpus, int) and gpus > 0):
        raise PlanError(f"--gpus must be a positive integer, got {gpus}")
    if not gpu_mem_gib > 0:
        raise PlanError(f"--gpu-mem-gb must be positive, got {gpu_mem_gib}")
    if not (isinstance(cp, int) and cp > 0):
        raise PlanError(f"--cp must be a positive integer, got {cp}")
    if not (isinstance(hp, int) and hp > 0):
        raise PlanError(f"--hp must be a positive integer, got {hp}")
    if gpus % (cp * hp):
        raise PlanError(f"--cp {cp}" + (f" x --hp {hp}" if hp > 1 else "") + f" does not divide --gpus {gpus}")
    heads = model_shape(model)["heads"]
    if heads % hp:
        raise PlanError(f"--hp {hp} does not divide {model_label(model)}'s {heads} attention heads")
    if not (isinstance(mbs, int) and mbs > 0):
        raise PlanError(f"--mbs must be a positive integer, got {mbs}")


# --- output ---------------------------------------------------------------------------------------

def tokens(T: int | None) -> str:
    if T is None:
        return "OOM"
    return f"{T // 1024}k" if T >= 1024 and T % 1024 == 0 else str(T)


def format_plan(plans: list[LayoutPlan], *, header: str) -> str:
    cols = ("params", "grads", "optimizer", "gathered", "graph", "overhead", "total")
    lines = [header, "",
             f"{'layout':<22} {'max T':>7}  " + " ".join(f"{c:>9}" for c in cols) + "   graph peak at",
             "-" * 120]
    for p in plans:
        b = p.at_max or p.smallest
        g = b.as_gib()
        T = tokens(p.max_T) if p.max_T else f"OOM@{tokens(b.T)}"
        lines.append(f"{p.title:<22} {T:>7}  " + " ".join(f"{g[c]:9.2f}" for c in cols) + f"   {b.peak_node}")
    first = plans[0]
    lines += [
        "",
        "GiB per GPU at the longest power-of-two T that fits (for OOM: at the smallest T tried).",
        f"model states: ZeRO-3 over all {first.gpus:g} GPUs as compile(mesh, fsdp=<every mesh dim>) shards them "
        f"({first.stats.params / 1e9:.2f}B parameters, each Shard(0) with dim 0 padded to ceil(p/N) rows, shard "
        "sizes read off the model sharded on a fake process group): "
        f"params = {first.spec.dtype} shard, grads = fp32 clipped-sum accumulator shard, "
        "optimizer = AdamW m + v" + (" + fp32 master" if first.spec.dtype == "bf16" else "") +
        "; gathered = the two largest FSDP units unsharded (in use + prefetched).",
        "graph = liveness peak of the captured per-rank training graph (activations, per-sample gradients "
        "and their cp shards, collective buffers, clipped sums, batch), from fake-tensor metadata; each node "
        "fitted as a + b*T" + (" + c*T² (a Hugging Face model's traced attention builds a T x T mask)"
                               if len(first.fit.T_points) == 3 else "") + " from captures at T = " +
        ", ".join(f"{'/'.join(map(str, p.fit.T_points))} ({p.title})" for p in plans) +
        "".join(f"; {p.title}: captured at {'/'.join(map(str, p.fit.layers))} layers and extrapolated to "
                f"{p.spec.layers} (checked to the byte on those captures)" for p in plans if p.fit.layers) +
        (" (exact for this graph: flash attention, no T x T tensor)." if len(first.fit.T_points) == 2 else "."),
        f"overhead = {first.overhead / GiB:g} GiB fixed (default: an 80 GB H100 exposes 79.2 GiB, CUDA context + "
        "cuBLAS + NCCL take 1.2 GiB, measured; allocator fragmentation 3 GiB, longshield.md Table 5 text); "
        "not graph-derived, nor are model states and gathered.",
        "FSDP-style = ZeRO-DP's layout: cp=1 on every GPU, activations unsharded, full per-sample gradients "
        "(grad-sample mode, flat clipping), no checkpointing.",
    ]
    return "\n".join(lines)
