"""Graph passes. Each pass is a function ``(gm, ctx) -> gm`` in its own module.

``run_passes`` runs an ordered list, checks the graph after each pass and records what
each changed (node counts by op), which ``print(engine)`` shows.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import torch.fx as fx

from ..capture import CapturedGraph


@dataclass
class PassContext:
    """What passes share: the capture, the batch size, the DP config, and pass results."""

    captured: CapturedGraph
    batch_size: int
    config: object = None
    # name -> PerSampleGrad, filled by the per_sample pass, read by clip and inspection.
    per_sample: dict = field(default_factory=dict)
    # name -> rule name, for inspection ("linear", "sum", "embedding", ...).
    rules_used: dict = field(default_factory=dict)
    # Context parallelism: group size, group name and rank (cp_size 1: one process).
    cp_size: int = 1
    cp_group_name: str | None = None
    cp_rank: int = 0
    # name -> parameter dim its per-sample gradient is sharded along over cp (None: replicated).
    shard_dims: dict = field(default_factory=dict)
    # Activation checkpointing policy: None, "block" or "selective".
    checkpoint: str | None = None
    log: list = field(default_factory=list)


Pass = Callable[[fx.GraphModule, PassContext], fx.GraphModule]


def op_counts(gm: fx.GraphModule) -> Counter:
    return Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


def run_passes(gm: fx.GraphModule, ctx: PassContext, passes: list[Pass]) -> fx.GraphModule:
    for p in passes:
        before = op_counts(gm)
        n_before = len(gm.graph.nodes)
        gm = p(gm, ctx)
        gm.graph.lint()
        after = op_counts(gm)
        added = after - before
        removed = before - after
        ctx.log.append((p.__name__, n_before, len(gm.graph.nodes), dict(added), dict(removed)))
    return gm


def format_log(log) -> str:
    lines = []
    for name, n_before, n_after, added, removed in log:
        lines.append(f"  {name}: {n_before} -> {n_after} nodes")
        top = sorted(added.items(), key=lambda kv: -kv[1])[:6]
        if top:
            lines.append("    + " + ", ".join(f"{k} x{v}" for k, v in top))
        top = sorted(removed.items(), key=lambda kv: -kv[1])[:6]
        if top:
            lines.append("    - " + ", ".join(f"{k} x{v}" for k, v in top))
    return "\n".join(lines)
