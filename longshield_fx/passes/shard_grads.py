"""The ``shard_grads`` pass: reduce-scatter local partial per-sample gradients over sp.

The sequence-parallel group ("sp": the cp ranks, times hp under 2D attention; written cp
below) shares each sequence. Each rank holds T/cp tokens of every sample, so the
``per_sample`` einsum gives a PARTIAL per-sample gradient (B, p, d): the sum over the
local tokens only. The full per-sample gradient is the sum over the cp group. This pass
inserts, right after each parameter's per-sample gradient (the input-stationary pattern
of longshield.md Figure 5):

- a reduce-scatter over cp (``_c10d_functional.reduce_scatter_tensor`` + ``wait_tensor``)
  that leaves each rank a shard (B, p/cp, d) of the full per-sample gradient. The shard
  dim is the larger of the parameter's first two dims among those divisible by cp (ties:
  dim 0); its bytes per step are B·p·d·4, independent of T;
- an all-reduce instead, for parameters with one dim (norm weights, biases) or none
  divisible by cp: small, and replicated on every cp rank.

With ``DPConfig(per_sample_comm="output_stationary")`` (longshield.md Figure 4), a
parameter whose per-sample gradient is one einsum over the tokens gathers the einsum's
two operands over cp instead and computes its own shard locally: same shard, bytes
growing with T. Offered to measure the trade-off; input-stationary is the default.

Embedding gradients in sparse-row form are made dense (B, V, H) first: rows from
different cp ranks may hit the same token and must be added before any norm.

Assumes: ``per_sample`` ran with the sequence sharded over ``ctx.sp_group_name``.
Guarantees: each parameter placeholder's ``meta[PER_SAMPLE_GRAD].dense`` is the shard (or
the replicated full gradient) and ``meta[CP_SHARD_DIM]`` the parameter dim it is sharded
along (None: replicated), so ``clip`` can all-reduce the squared norms of the shards
exactly once.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .._torch import c10d
from ._context import CP_SHARD_DIM, PER_SAMPLE_GRAD, PassContext
from ._graph import val
from .batch_dims import BatchDim
from .per_sample import PerSampleGrad, Rewriter

aten = torch.ops.aten


def shard_dim(shape, cp: int) -> int | None:
    """The parameter dim a per-sample gradient is sharded along, or None (all-reduce)."""
    if len(shape) < 2:
        return None
    candidates = [d for d in (0, 1) if shape[d] % cp == 0]
    if not candidates:
        return None
    return max(candidates, key=lambda d: (shape[d], -d))


def _position(graph: fx.Graph):
    order = {n: i for i, n in enumerate(graph.nodes)}
    return order.__getitem__


def shard_grads(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Reduce-scatter (or all-reduce) per-sample gradients over sp (see the module docstring)."""
    cp, group = ctx.sp_size, ctx.sp_group_name
    rw = Rewriter(gm, ctx)
    output = gm.graph.output_node()
    loss, *_ = output.args[0]
    outputs = []
    for name in ctx.captured.param_names:
        meta = ctx.param_meta(name)
        g = meta[PER_SAMPLE_GRAD]
        anchor = max(g.nodes, key=_position(gm.graph))
        # inserting_before(x.next): nodes land right after x, in creation order.
        with gm.graph.inserting_before(anchor.next):
            full = rw.densify(g)
        dim = shard_dim(g.shape, cp)
        einsum = _plain_einsum(g)
        with gm.graph.inserting_before(full.next):
            if dim is not None and einsum is not None and ctx.config.per_sample_comm == "output_stationary":
                reduced = _output_stationary(rw, einsum, dim, ctx)
            elif dim is None:
                reduced = rw.call(c10d.wait_tensor.default, rw.call(c10d.all_reduce.default, full, "sum", group))
            else:
                # reduce_scatter_tensor scatters dim 0: bring the shard dim to the front.
                front = rw.call(aten.movedim.int, full, dim + 1, 0)
                front = rw.call(aten.clone.default, front, memory_format=torch.contiguous_format)
                scattered = rw.call(c10d.wait_tensor.default,
                                    rw.call(c10d.reduce_scatter_tensor.default, front, "sum", cp, group))
                reduced = rw.call(aten.movedim.int, scattered, 0, dim + 1)
        reduced.meta["batch_dim"] = BatchDim(0, 1)
        meta[PER_SAMPLE_GRAD] = PerSampleGrad(tuple(val(reduced).shape[1:]), reduced)
        meta[CP_SHARD_DIM] = dim
        outputs.append(reduced)
    output.args = ((loss, *outputs),)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def _plain_einsum(g: PerSampleGrad) -> fx.Node | None:
    """The per-sample einsum ``"X,Y->bmn"`` contracting one token label, if that is all g is."""
    node = g.dense
    if g.rows or node is None or node.target != aten.einsum.default or len(node.args[1]) != 2:
        return None
    inputs, out = node.args[0].split("->")
    left, right = inputs.split(",")
    contracted = (set(left) & set(right)) - set(out)
    return node if out.startswith("b") and len(contracted) == 1 else None


def _output_stationary(rw: Rewriter, einsum: fx.Node, dim: int, ctx: PassContext) -> fx.Node:
    """longshield.md Figure 4: gather both einsum operands over the sequence, then compute
    only this rank's shard of the per-sample gradient locally (no reduction needed).

    Operands are all-gathered along their token dim (the paper exchanges one of them
    all-to-all; gathering both moves more bytes, and the count reported is what this
    does). Bytes grow linearly with T, unlike the reduce-scatter.
    """
    cp, group, rank = ctx.sp_size, ctx.sp_group_name, ctx.sp_rank
    spec = einsum.args[0]
    inputs, out = spec.split("->")
    labels = inputs.split(",")
    token = ((set(labels[0]) & set(labels[1])) - set(out)).pop()
    shard_label = out[dim + 1]
    operands = []
    for x, lab in zip(einsum.args[1], labels):
        t = lab.index(token)
        front = rw.call(aten.clone.default, rw.call(aten.movedim.int, x, t, 0), memory_format=torch.contiguous_format)
        gathered = rw.call(c10d.wait_tensor.default, rw.call(c10d.all_gather_into_tensor.default, front, cp, group))
        full = rw.call(aten.movedim.int, gathered, 0, t)
        if shard_label in lab:
            d = lab.index(shard_label)
            size = val(full).shape[d] // cp
            full = rw.call(aten.slice.Tensor, full, d, rank * size, (rank + 1) * size)
        operands.append(full)
    return rw.call(aten.einsum.default, spec, operands)
