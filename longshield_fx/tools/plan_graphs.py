"""The planner's graphs: one per-rank training graph on fake tensors, its liveness timeline,
and the caches that keep captures from being repeated.

``capture_timelines(spec, T)`` builds the rewritten training graph of ONE cp rank at full
sequence length T with ``engine.lower`` (real Llama shapes on fake tensors, a fake process
group for cp > 1; nothing real is allocated) and records the liveness timeline of every node
(``tools.memory.estimate_memory``). A checkpointed spec is lowered WITHOUT checkpointing
first, the plain graph's timeline recorded, and then the checkpoint pass (which runs last and
reads only the policy) is applied to that same graph: one capture serves both layouts.

Captures cost 10 s (1B) to about a minute (8B, cp=4, on a busy 2-core CPU) each. ``measure``
memoises them in-process (``_MEMO``) and on disk (``cache_dir``, keyed by the spec, T, a hash
of the graph-building sources and the torch version), and ``prefetch`` runs the missing ones
in parallel worker processes (each capture is single-threaded Python).
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import json
import multiprocessing
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch

from ..passes._graph import nbytes

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


HF_CONFIG = "hf-config:"  # a GraphSpec.model of a Hugging Face architecture: this prefix, then its config JSON


def hf_model(config) -> str:
    """The ``GraphSpec.model`` of a Hugging Face config (a ``PretrainedConfig``): its whole JSON
    but for where it was read from (``_name_or_path``), so the spec pickles to the capture workers
    and keys the caches by the config's content: one config read from a model folder or from a
    JSON file, or moved, is one spec."""
    fields = json.loads(config.to_json_string(use_diff=False))
    fields.pop("_name_or_path", None)
    return HF_CONFIG + json.dumps(fields, indent=2, sort_keys=True)


def _hf_fields(model: str) -> dict | None:
    """The config fields of a ``hf_model`` spec model, or None for a reference name."""
    return json.loads(model[len(HF_CONFIG):]) if model.startswith(HF_CONFIG) else None


def build_lm(model: str, overrides: tuple = ()) -> torch.nn.Module:
    """The language model a spec names: a reference Llama (``longshield_fx.models.CONFIGS``, with
    ``overrides``) or, for ``hf_model(config)``, that Hugging Face architecture with SDPA attention,
    randomly initialised (call under a fake or meta mode: the planner needs shapes only)."""
    fields = _hf_fields(model)
    if fields is not None:
        import transformers

        config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
        return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa",
                                                             dtype=torch.get_default_dtype())
    from longshield_fx.models import Llama

    return Llama.from_name(model, **dict(overrides))


def model_shape(model: str) -> dict:
    """Layers, attention heads, K/V heads and head dim of the model a spec names."""
    c = _hf_fields(model)
    if c is not None:
        heads = c["num_attention_heads"]
        return {"layers": c["num_hidden_layers"], "heads": heads, "kv_heads": c.get("num_key_value_heads") or heads,
                "head_dim": c.get("head_dim") or c["hidden_size"] // heads}
    from longshield_fx.models import CONFIGS

    cfg = CONFIGS[model]
    return {"layers": cfg.n_layers, "heads": cfg.n_heads, "kv_heads": cfg.n_kv_heads, "head_dim": cfg.dim // cfg.n_heads}


def model_label(model: str) -> str:
    c = _hf_fields(model)
    if c is not None:
        return f"HF {(c.get('architectures') or [c['model_type']])[0]} ({c['num_hidden_layers']} layers)"
    return model


@dataclass(frozen=True)
class GraphSpec:
    """What decides the per-rank graph: model (a reference name or ``hf_model(config)``), cp
    degree, checkpointing, micro-batch, dtype, head-parallel degree (2D attention: the sequence
    is sharded over cp x hp ranks)."""

    model: str
    cp: int = 1
    checkpoint: str | None = None
    mbs: int = 1
    dtype: str = "bf16"
    overrides: tuple = ()  # (field, value) pairs for Llama.from_name (tests: fewer layers)
    hp: int = 1

    @property
    def sp(self) -> int:
        """Ranks sharing one sequence."""
        return self.cp * self.hp

    def label(self) -> str:
        extra = "".join(f",{k}={v}" for k, v in self.overrides)
        return (f"{model_label(self.model)}{extra} cp={self.cp}" + (f" hp={self.hp}" if self.hp > 1 else "") +
                f" checkpoint={self.checkpoint or 'none'} mbs={self.mbs} {self.dtype}")

    @property
    def layers(self) -> int:
        """Decoder layers of the graph (an ``n_layers`` override, else the model's own)."""
        return dict(self.overrides).get("n_layers", model_shape(self.model)["layers"])

    @property
    def plain(self) -> "GraphSpec":
        """The same graph without activation checkpointing."""
        return dataclasses.replace(self, checkpoint=None)


@dataclass
class Capture:
    """The liveness timeline of one captured graph at one T (bytes, one entry per node)."""

    T: int
    timeline: list[int]
    names: list[str]
    ops: list[str]            # each node's op and target (placeholders: their op only)
    ops_digest: str
    batch_bytes: int          # the graph's batch inputs (ids, labels, positions, mask)
    capture_s: float


# --- one capture ------------------------------------------------------------------------------

@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


@contextlib.contextmanager
def _world(cp: int, hp: int = 1, dp: int = 1):
    """No mesh for one rank; else a one-process fake process group of dp x cp x hp ranks (rank 0's view)."""
    if dp * cp * hp == 1:
        yield None
        return
    import torch.distributed as dist

    from .._torch import fake_world

    if dist.is_initialized():
        raise RuntimeError("plan: torch.distributed is already initialised in this process; the planner "
                           "needs its own fake process group (run it in a fresh process)")
    with fake_world(cp, dp=dp, hp=hp) as mesh:
        yield mesh


def _build_model(spec: GraphSpec):
    """The CausalLMLoss-wrapped Llama in the compute dtype, on fake tensors (call inside the mode).

    Built directly in the compute dtype: ``DPConfig(compute_dtype=...)`` makes the engine
    deep-copy and ``.to()`` the model, which fake parameters refuse ("Cannot swap t1 because
    it has weakref associated with it", torch 2.13); with parameters already in that dtype
    the engine skips the copy and captures the same graph.
    """
    import longshield_fx as lf

    with _default_dtype(DTYPES[spec.dtype]):
        return lf.CausalLMLoss(build_lm(spec.model, spec.overrides))


def _timeline(lowered, T: int, elapsed: float) -> Capture:
    from .memory import estimate_memory

    gm, captured = lowered.gm, lowered.captured
    est = estimate_memory(gm)
    batch_bytes = sum(nbytes(node) for node, (kind, _) in zip(captured.placeholders, captured.inputs)
                      if kind in ("input", "cotangent"))
    nodes = list(gm.graph.nodes)
    ops = [n.op if n.op == "placeholder" else f"{n.op}:{n.target}" for n in nodes]
    digest = hashlib.sha256("\n".join(f"{n.op}:{n.target}" for n in nodes).encode()).hexdigest()
    return Capture(T, list(est.timeline), [n.name for n in nodes], ops, digest, batch_bytes, elapsed)


def capture_timelines(spec: GraphSpec, T: int) -> dict[GraphSpec, Capture]:
    """Lower ``spec``'s per-rank graph at full sequence length ``T`` on fake tensors and return
    its timeline, and for a checkpointed spec also the plain graph's (``spec.plain``)."""
    import longshield_fx as lf
    from longshield_fx.passes.checkpoint import checkpoint

    from .._torch import FakeTensorMode

    start = time.perf_counter()
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = _build_model(spec)
        ids = torch.zeros(spec.mbs, T, dtype=torch.long)
    config = lf.DPConfig(1.0, 1.0, compute_dtype=DTYPES[spec.dtype])  # graph only: no noise is drawn
    # Per-sample gradients for every layer: the FSDP-style layout (cp=1) models grad-sample DP,
    # and ghost norm, which picks layers by T, would change the graph between the fit points
    # (it only pays below the contexts planned; under cp it is not in the pipeline).
    disable = ("ghost_norm",) if spec.sp == 1 else ()
    with _world(spec.cp, spec.hp) as mesh:
        engine = lf.compile(model, mesh, config=config, checkpoint=None, disable_passes=disable)
        lowered = engine.lower(ids, ids)
        out = {spec.plain: _timeline(lowered, T, time.perf_counter() - start)}
        if spec.checkpoint:
            checkpoint(lowered.gm, dataclasses.replace(lowered.ctx, checkpoint=spec.checkpoint))  # in place
            out[spec] = _timeline(lowered, T, time.perf_counter() - start)
    return out


# --- caches -------------------------------------------------------------------------------------

_MEMO: dict[tuple, Capture] = {}

CAPTURE_VERSION = 3  # bump when capture_timelines / _timeline change what they record
_GRAPH_SOURCES = ("_torch.py", "api.py", "capture.py", "config.py", "losses.py", "models", "ops", "passes",
                  "runtime", "tools/memory.py", "tools/plan_graphs.py")


def _source_digest() -> str:
    """Hash of the sources that build the graph, and the torch version: a disk-cache entry
    is only reused for exactly the code that produced it."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256(torch.__version__.encode())
    files = []
    for name in _GRAPH_SOURCES:
        p = root / name
        files += sorted(p.rglob("*.py")) if p.is_dir() else [p]
    for p in files:
        h.update(str(p.relative_to(root)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def default_cache_dir() -> Path:
    env = os.environ.get("LONGSHIELD_FX_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "longshield_fx" / "plan"


def _cache_path(cache_dir: Path | None, spec: GraphSpec, T: int) -> Path | None:
    if cache_dir is None:
        return None
    name = hashlib.sha256(repr((spec, T, _source_digest(), CAPTURE_VERSION)).encode()).hexdigest()[:24]
    return Path(cache_dir) / f"{name}.json"


def _store(spec: GraphSpec, T: int, cap: Capture, cache_dir: Path | None) -> None:
    _MEMO[(spec, T)] = cap
    path = _cache_path(cache_dir, spec, T)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(cap)))
        tmp.replace(path)


def cached(spec: GraphSpec, T: int, cache_dir: Path | None = None) -> Capture | None:
    """The memoised or disk-cached timeline of ``spec`` at ``T``, or None."""
    key = (spec, T)
    if key not in _MEMO:
        path = _cache_path(cache_dir, spec, T)
        if path is None or not path.exists():
            return None
        try:
            _MEMO[key] = Capture(**json.loads(path.read_text()))
        except (ValueError, TypeError):
            return None  # a corrupt entry is rebuilt
    return _MEMO[key]


def measure(spec: GraphSpec, T: int, cache_dir: Path | None = None) -> Capture:
    """The liveness timeline of ``spec``'s graph at ``T``, from the caches or a new capture
    (which, for a checkpointed spec, also stores ``spec.plain``)."""
    found = cached(spec, T, cache_dir)
    if found is None:
        for s, cap in capture_timelines(spec, T).items():
            if s == spec or cached(s, T, cache_dir) is None:
                _store(s, T, cap, cache_dir)
        found = _MEMO[(spec, T)]
    return found


def _cost(spec: GraphSpec) -> float:
    """Relative capture time (nodes grow with layers; cp adds ring attention and collectives)."""
    return spec.layers * (1.4 if spec.sp > 1 else 1.0) * (1.2 if spec.checkpoint else 1.0)


def prefetch(requests: Iterable[tuple[GraphSpec, int]], cache_dir: Path | None = None, jobs: int = 1) -> None:
    """Capture every requested (spec, T) that no cache holds, ``jobs`` at a time in worker
    processes (spawned: each gets its own fake process group), costliest first."""
    todo: dict[tuple, None] = {}
    for spec, T in requests:
        if cached(spec, T, cache_dir) is None:
            todo[(spec, T)] = None
    brought = {(s.plain, t) for s, t in todo if s.checkpoint}  # a checkpointed capture brings its plain graph
    order = sorted((st for st in todo if st not in brought), key=lambda st: -_cost(st[0]))
    if jobs <= 1 or len(order) <= 1:
        for spec, T in order:
            measure(spec, T, cache_dir)
        return
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(min(jobs, len(order)), mp_context=context) as pool:
        futures = {pool.submit(capture_timelines, spec, T): T for spec, T in order}
        for done in concurrent.futures.as_completed(futures):
            for s, cap in done.result().items():
                if cached(s, futures[done], cache_dir) is None:
                    _store(s, futures[done], cap, cache_dir)
