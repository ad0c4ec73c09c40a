"""The ``shard_grads`` pass: reduce-scatter local partial per-sample gradients over sp.

The sequence-parallel group ("sp": the cp ranks, times hp under 2D attention; written cp
below) shares each sequence. Each rank holds T/cp tokens of every sample, so the
``per_sample`` einsum gives a PARTIAL per-sample gradient (B, p, d): the sum over the
local tokens only. The full per-sample gradient is the sum over the cp group. This pass
inserts, right after each parameter's per-sample gradient (the input-stationary pattern
of longshield.md Figure 5):

- a reduce-scatter over cp (``_c10d_functional.reduce_scatter_tensor`` + ``wait_tensor``)
  that leaves each rank a shard (B, p/cp, d) of the full per-sample gradient. The shard
  dim is dim 0 if cp divides it, else dim 1 if cp divides that: dim 0 is the one model
  states are sharded along (``scatter_clipped_sums`` can then hand shards on without
  padding) and, for B = 1, already at the front for the collective (no copy). Its bytes
  per step are B·p·d·4, independent of T;
- an all-reduce instead, for parameters with one dim (norm weights, biases) or none
  divisible by cp: small, and replicated on every cp rank.

With ``DPConfig(per_sample_comm="output_stationary")`` (longshield.md Figure 4), a
parameter whose per-sample gradient is one einsum over the tokens gathers the einsum's
two operands over cp instead and computes its own shard locally: same shard, bytes
growing with T. Offered to measure the trade-off; input-stationary is the default.

Embedding gradients in sparse-row form (``rows``: each token's row of the gradient and its
id) are made dense (B, V, H) first: rows from different cp ranks may hit the same token and
must be added before any norm. When every cp rank's rows together are smaller than the dense
gradient (fewer tokens in the sequence than rows in the table), each rank instead
all-gathers the rows and ids over cp and adds only those of its own shard (B, V/cp, H): the
dense (B, V, H) buffer and its reduce-scatter never exist. Bytes then grow with T, and stay
below the reduce-scatter's.

Assumes: ``per_sample`` ran with the sequence sharded over ``ctx.sp_group_name``.
Guarantees: each parameter placeholder's ``meta[PER_SAMPLE_GRAD].dense`` is the shard (or
the replicated full gradient) and ``meta[CP_SHARD_DIM]`` the parameter dim it is sharded
along (None: replicated), so ``clip`` can all-reduce the squared norms of the shards
exactly once.
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx

from .._torch import c10d
from ._context import CP_SHARD_DIM, PER_SAMPLE_GRAD, PassContext
from ._graph import eliminate_dead_code, val
from .batch_dims import BatchDim
from .per_sample import PerSampleGrad, Rewriter

aten = torch.ops.aten


def shard_dim(shape, cp: int) -> int | None:
    """The parameter dim a per-sample gradient is sharded along, or None (all-reduce)."""
    if len(shape) < 2:
        return None
    return next((d for d in (0, 1) if shape[d] % cp == 0), None)


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
        dim = shard_dim(g.shape, cp)
        if dim == 0 and _rows_are_smaller(g, cp):
            # inserting_before(x.next): nodes land right after x, in creation order.
            with gm.graph.inserting_before(anchor.next):
                reduced = _gathered_rows(rw, g, ctx)
            _record(meta, reduced, dim)
            outputs.append(reduced)
            continue
        with gm.graph.inserting_before(anchor.next):
            full = rw.densify(g)
        einsum = _plain_einsum(g)
        with gm.graph.inserting_before(full.next):
            if dim is not None and einsum is not None and ctx.config.per_sample_comm == "output_stationary":
                reduced = _output_stationary(rw, einsum, dim, ctx)
            elif dim is None:
                reduced = rw.call(c10d.wait_tensor.default, rw.call(c10d.all_reduce.default, full, "sum", group))
            else:
                # reduce_scatter_tensor scatters dim 0: bring the shard dim to the front.
                front = rw.call(aten.contiguous.default, rw.call(aten.movedim.int, full, dim + 1, 0))
                scattered = rw.call(c10d.wait_tensor.default,
                                    rw.call(c10d.reduce_scatter_tensor.default, front, "sum", cp, group))
                reduced = rw.call(aten.movedim.int, scattered, 0, dim + 1)
        _record(meta, reduced, dim)
        outputs.append(reduced)
    output.args = ((loss, *outputs),)
    eliminate_dead_code(gm.graph)
    gm.recompile()
    return gm


def _record(meta: dict, reduced: fx.Node, dim: int | None) -> None:
    reduced.meta["batch_dim"] = BatchDim(0, 1)
    meta[PER_SAMPLE_GRAD] = PerSampleGrad(tuple(val(reduced).shape[1:]), reduced)
    meta[CP_SHARD_DIM] = dim


def _rows_are_smaller(g: PerSampleGrad, cp: int) -> bool:
    """True for a gradient made only of sparse rows whose ids and values, gathered from
    every cp rank, take fewer bytes than its dense form (per sample)."""
    if not g.rows or g.dense is not None or g.outer or len(g.rows[0]) == 3:  # packed rows: (indices, values, owner)
        return False
    row = math.prod(g.shape[1:])
    gathered = sum(cp * val(ids).shape[1] * (row * val(values).element_size() + val(ids).element_size())
                   for ids, values in g.rows)
    return gathered < g.shape[0] * row * val(g.rows[0][1]).element_size()


def _gathered_rows(rw: Rewriter, g: PerSampleGrad, ctx: PassContext) -> fx.Node:
    """This rank's shard (B, V/cp, *row) of a sparse-row gradient: every cp rank's ids and
    rows gathered, those in the shard added into it (in place: one shard buffer)."""
    cp, group, rank = ctx.sp_size, ctx.sp_group_name, ctx.sp_rank
    B, row = rw.B, list(g.shape[1:])
    size = g.shape[0] // cp
    like = val(g.rows[0][1])
    shard = rw.call(aten.zeros.default, [B * size, *row], dtype=like.dtype, device=like.device)
    offsets = rw.call(aten.unsqueeze.default, rw.call(aten.mul.Tensor, rw.call(
        aten.arange.default, B, device=val(g.rows[0][0]).device), size), 1)
    for ids, values in g.rows:
        ids, values = _gather(rw, ids, 1, cp, group), _gather(rw, values, 1, cp, group)
        n = val(ids).shape[1]
        local = rw.call(aten.sub.Tensor, ids, rank * size)
        inside = rw.call(aten.logical_and.default, rw.call(aten.ge.Scalar, local, 0), rw.call(aten.lt.Scalar, local, size))
        local = rw.call(aten.add.Tensor, rw.call(aten.where.ScalarOther, inside, local, 0), offsets)
        mask = rw.call(aten.view.default, inside, [B, n] + [1] * len(row))
        values = rw.call(aten.where.ScalarOther, mask, values, 0.0)
        shard = rw.call(aten.index_add_.default, shard, 0, rw.call(aten.reshape.default, local, [B * n]),
                        rw.call(aten.reshape.default, values, [B * n, *row]))
    return rw.call(aten.view.default, shard, [B, size, *row])


def _gather(rw: Rewriter, x: fx.Node, dim: int, cp: int, group: str) -> fx.Node:
    """``x`` all-gathered over cp along ``dim`` (cp times as long there), rank by rank."""
    front = rw.call(aten.contiguous.default, rw.call(aten.movedim.int, x, dim, 0))
    gathered = rw.call(c10d.wait_tensor.default, rw.call(c10d.all_gather_into_tensor.default, front, cp, group))
    return rw.call(aten.movedim.int, gathered, 0, dim)


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
        full = _gather(rw, x, lab.index(token), cp, group)
        if shard_label in lab:
            d = lab.index(shard_label)
            size = val(full).shape[d] // cp
            full = rw.call(aten.slice.Tensor, full, d, rank * size, (rank + 1) * size)
        operands.append(full)
    return rw.call(aten.einsum.default, spec, operands)
