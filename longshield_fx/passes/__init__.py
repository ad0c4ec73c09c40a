"""Graph passes and the one ordered list they run in.

Each pass is a function ``(gm, ctx) -> gm`` in its own module. ``pipeline`` returns the
ordered list for a configuration (the pipeline as data: ``print(engine)`` and
``longshield-fx inspect`` show it); ``lower`` runs it on a capture, linting the graph
after each pass and recording what each changed. What a pass learns about a parameter
lives on that parameter's placeholder ``meta`` (keys in ``_context``); ``Lowered``
collects it for readers.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Iterable

import torch.fx as fx

from ..capture import CapturedGraph
from . import batch_rules, batch_rules_indexing, per_sample_rules  # noqa: F401  (register the rules of each aten op)
from ._context import CP_SHARD_DIM, NORM_METHOD, PER_SAMPLE_RULE, PassContext
from .batch_dims import batch_dims
from .checkpoint import checkpoint
from .chunked_loss import chunked_loss
from .clip import clip
from .context_parallel import context_parallel
from .gather_params import gather_params
from .ghost_norm import ghost_norm
from .overlap import overlap
from .per_sample import per_sample
from .scatter_clipped_sums import scatter_clipped_sums
from .shard_grads import shard_grads

Pass = Callable[[fx.GraphModule, PassContext], fx.GraphModule]

__all__ = ["Lowered", "Pass", "PassContext", "PassRecord", "format_log", "lower", "pipeline"]


def pipeline(*, training: bool, cp: int = 1, checkpointing: str | None = None, fsdp: bool = False,
             disable: Iterable[str] = ()) -> list[Pass]:
    """The ordered passes for a configuration.

    ``training``: the clipped-sum graph (True) or the per-sample-gradient graph (False,
    ``engine.per_sample_grads``; its gradients stay full under cp). ``cp``: the
    sequence-parallel degree (cp x hp ranks share a sequence). ``checkpointing``: the
    activation-checkpointing policy. ``fsdp``: parameters and clipped sums are sharded
    (``compile(..., fsdp=...)``). Packed documents (``compile(..., packed_units=...)``) run the
    same passes: each one that forms per-sample values reads the unit slots. ``disable``: pass
    names to leave out, for experiments and benchmarks; a name not in the list is an error.

    >>> [p.__name__ for p in pipeline(training=True, cp=2, checkpointing="block")]
    ['batch_dims', 'context_parallel', 'chunked_loss', 'per_sample', 'shard_grads', 'clip', 'overlap', 'checkpoint']
    >>> [p.__name__ for p in pipeline(training=True, cp=2, fsdp=True)][-4:]
    ['clip', 'scatter_clipped_sums', 'gather_params', 'overlap']
    >>> [p.__name__ for p in pipeline(training=True)]
    ['batch_dims', 'chunked_loss', 'per_sample', 'ghost_norm', 'clip']
    """
    cp_only = cp > 1
    steps = [
        (batch_dims, True),
        (context_parallel, cp_only),
        (chunked_loss, True),
        (per_sample, True),
        (shard_grads, training and cp_only),
        (ghost_norm, training and not cp_only),
        (clip, training),
        (scatter_clipped_sums, training and fsdp),
        (gather_params, fsdp),
        (overlap, training and (cp_only or fsdp)),
        (checkpoint, checkpointing is not None),
    ]
    passes = [p for p, on in steps if on]
    disable = set(disable)
    unknown = disable - {p.__name__ for p in passes}
    if unknown:
        raise ValueError(f"disable_passes: {sorted(unknown)} not in this pipeline "
                         f"{[p.__name__ for p in passes]}")
    return [p for p in passes if p.__name__ not in disable]


@dataclass(frozen=True)
class PassRecord:
    """What one pass changed: node counts before/after and ops added/removed (by count)."""

    name: str
    nodes_before: int
    nodes_after: int
    added: dict
    removed: dict


@dataclass
class Lowered:
    """A rewritten graph and what its passes recorded.

    ``gm(*captured.gather_args(...))`` runs it. ``rules``: parameter -> per-sample rule;
    ``norm_methods``: parameter -> ghost norm or per-sample gradient, and why;
    ``shard_dims``: parameter -> the dim its clipped sum is sharded along over cp (None:
    full on every rank).
    """

    gm: fx.GraphModule
    captured: CapturedGraph
    ctx: PassContext
    log: list[PassRecord]

    @property
    def passes(self) -> list[str]:
        return [r.name for r in self.log]

    @cached_property  # the graph is not rewritten after lowering
    def rules(self) -> dict[str, str]:
        return {n: self.ctx.param_meta(n).get(PER_SAMPLE_RULE, "?") for n in self.captured.param_names}

    @cached_property
    def norm_methods(self) -> dict[str, str]:
        """parameter -> how ``clip`` forms its norm and clipped sum, and why (``ghost_norm``)."""
        return {n: self.ctx.param_meta(n).get(NORM_METHOD, "per-sample (no ghost_norm pass)") for n in self.captured.param_names}

    @cached_property  # read by every finalize
    def shard_dims(self) -> dict[str, int | None]:
        return {n: self.ctx.param_meta(n).get(CP_SHARD_DIM) for n in self.captured.param_names}


def _op_counts(gm: fx.GraphModule) -> Counter:
    return Counter(n.target for n in gm.graph.nodes if n.op == "call_function")


def _named(counts: Counter) -> dict:
    return {str(op): n for op, n in counts.items()}


def lower(ctx: PassContext, passes: list[Pass]) -> Lowered:
    """Run ``passes`` in order on ``ctx.captured.gm`` (in place), linting after each."""
    gm, log = ctx.captured.gm, []
    after = _op_counts(gm)
    for p in passes:
        before, n_before = after, len(gm.graph.nodes)
        gm = p(gm, ctx)
        gm.graph.lint()
        after = _op_counts(gm)
        log.append(PassRecord(p.__name__, n_before, len(gm.graph.nodes), _named(after - before), _named(before - after)))
    return Lowered(gm, ctx.captured, ctx, log)


def format_log(log: list[PassRecord], top: int = 6) -> str:
    """One line per pass (node counts), then its most-added and most-removed ops."""
    lines = []
    width = max((len(r.name) for r in log), default=0)
    for r in log:
        lines.append(f"  {r.name:<{width}}  {r.nodes_before} -> {r.nodes_after} nodes")
        for sign, ops in (("+", r.added), ("-", r.removed)):
            most = sorted(ops.items(), key=lambda kv: -kv[1])[:top]
            if most:
                lines.append(f"    {sign} " + ", ".join(f"{k} x{v}" for k, v in most))
    return "\n".join(lines)
