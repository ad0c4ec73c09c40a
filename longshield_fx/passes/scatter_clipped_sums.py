"""The ``scatter_clipped_sums`` pass: each rank keeps only its shard of the clipped sums.

Rewrites: each clipped-sum output of ``clip`` (the full parameter shape, or under sequence
parallelism the slice ``shard_grads`` left this rank along ``meta[CP_SHARD_DIM]``) into
this rank's fsdp shard of the clipped sum over every replica's samples, dim 0 padded to
c = ceil(p / n) rows like the parameter shard (``runtime.fsdp``).

When the sp slices are along dim 0 and each is a whole number m of shards (n divides p, and
the fsdp group holds every sp rank m times: the fsdp dims include the sequence dims), the
slices are handed on as they are:

- an ``all_to_all_single`` over the fsdp group sends each of this rank's m shards of its
  slice to the rank owning it and receives its own shard from the m ranks holding that
  shard's slice (the other dp replicas' samples), which are summed. With m = 1 and this
  rank's slice being its own shard (hybrid sharding over the sequence dims) nothing moves.

Bytes per rank: the sp slice, p/sp rows in fp32. Otherwise (a slice along dim 1, rows that
do not divide, a replicated gradient, or fsdp dims without the sequence dims):

- a contribution Z of the padded full shape: the sp slice in its place and zeros elsewhere
  (padding rows included);
  a gradient every sp rank holds whole (norm weights, biases, or no sp at all) is
  contributed by sp rank 0 alone. Summed over all ranks (dp x sp), the Z's are the clipped
  sum of the whole physical batch, exactly once;
- a reduce-scatter of Z over the fsdp group.

Bytes per rank: the padded full parameter in fp32 (as FSDP's gradient reduce-scatter). Then,
either way, with hybrid sharding an all-reduce over the replica group: the fsdp group times
the replica group is every rank, so each rank ends with its shard of the sum, and replicas of
a shard receive the same reduced values. Independent of T.

Assumes: ``clip`` ran (outputs ``(loss_sum, norms, *clipped sums)`` in
``captured.param_names`` order). Guarantees: output i is the (c, ...) fp32 shard; padding
rows are zero.
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx

from .._torch import c10d
from ._context import CP_SHARD_DIM, PassContext
from ._graph import GraphBuilder, eliminate_dead_code, val

aten = torch.ops.aten


def scatter_clipped_sums(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Reduce-scatter clipped sums to the rank owning each shard (see the module docstring)."""
    graph = gm.graph
    output = graph.output_node()
    loss_sum, norms, *sums = output.args[0]
    b = GraphBuilder(graph, ctx.captured.fake_mode)
    n = ctx.fsdp_size
    shards = []
    for name, clipped in zip(ctx.captured.param_names, sums):
        full = val(ctx.captured.param_placeholder(name))
        padded = (math.ceil(full.shape[0] / n) * n, *full.shape[1:])
        dim = ctx.param_meta(name).get(CP_SHARD_DIM)
        with graph.inserting_before(output):
            shard = _exchanged_slices(b, clipped, full.shape[0], dim, ctx)
            if shard is None:
                z = _contribution(b, clipped, tuple(full.shape), padded, dim, ctx.sp_rank)
                shard = b(c10d.wait_tensor.default,
                          b(c10d.reduce_scatter_tensor.default, z, "sum", n, ctx.fsdp_group_name))
            if ctx.fsdp_replica_group_name is not None:
                shard = b(c10d.wait_tensor.default,
                          b(c10d.all_reduce.default, shard, "sum", ctx.fsdp_replica_group_name))
        shards.append(shard)
    output.args = ((loss_sum, norms, *shards),)
    eliminate_dead_code(graph)  # a replicated sum off sp rank 0 is not needed
    gm.recompile()
    return gm


def _exchanged_slices(b, clipped: fx.Node, rows: int, dim: int | None, ctx: PassContext) -> fx.Node | None:
    """This rank's shard summed from the sp slices that hold it (see the module docstring), or
    None when the slices are not whole shards."""
    n, sp, holders, me = ctx.fsdp_size, ctx.sp_size, list(ctx.fsdp_sp_ranks), ctx.fsdp_rank
    if dim != 0 or sp == 1 or n % sp or rows % n or sorted(holders) != sorted(list(range(sp)) * (n // sp)):
        return None
    m, size = n // sp, rows // n  # shards per slice, rows per shard
    rest = list(val(clipped).shape[1:])
    if m == 1 and holders[me] == me:  # this rank's slice is its shard
        return clipped
    send = [size if k // m == ctx.sp_rank else 0 for k in range(n)]  # my slice's shards, to their owners
    receive = [size if holders[k] == me // m else 0 for k in range(n)]  # my shard, from its slice's holders
    exchanged = b(c10d.wait_tensor.default, b(c10d.all_to_all_single.default, b(aten.contiguous.default, clipped),
                                              receive, send, ctx.fsdp_group_name))
    return exchanged if m == 1 else b(aten.sum.dim_IntList, b(aten.view.default, exchanged, [m, size, *rest]), [0])


def _contribution(b, clipped: fx.Node, full: tuple, padded: tuple, dim: int | None, sp_rank: int) -> fx.Node:
    """This rank's share of the padded full clipped sum (see the module docstring)."""
    like = val(clipped)
    if dim is None and sp_rank != 0:  # whole on every sp rank: counted once, by sp rank 0
        return b(aten.zeros.default, list(padded), dtype=like.dtype, device=like.device)
    # One padding op places the sp slice and pads dim 0 to whole shards: no zeros buffer plus a
    # scattered copy of it (two full parameters in fp32 at the step's peak).
    pad = [0, 0] * len(full)  # (before, after) per dim, last dim first, as constant_pad_nd reads it

    def widen(d: int, before: int, after: int) -> None:
        pad[2 * (len(full) - 1 - d)] += before
        pad[2 * (len(full) - 1 - d) + 1] += after

    if dim is not None:  # this rank's sp slice in its place, zeros around it
        size = like.shape[dim]
        widen(dim, sp_rank * size, full[dim] - (sp_rank + 1) * size)
    widen(0, 0, padded[0] - full[0])
    return b(aten.constant_pad_nd.default, clipped, pad) if any(pad) else clipped
