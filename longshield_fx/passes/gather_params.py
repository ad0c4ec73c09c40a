"""The ``gather_params`` pass: parameters enter the graph as shards and are all-gathered
right before their use (FSDP / ZeRO-3 as a graph rewrite, as SimpleFSDP does it).

Rewrites: each parameter placeholder (trainable or frozen) into this rank's shard, dim 0
padded to c = ceil(p / n) rows (``runtime.fsdp``). The forward reads an all-gather over
the fsdp group (``all_gather_into_tensor`` + ``wait_tensor``, then a slice dropping the
padding rows) placed before the parameter's first use. What the backward reads depends on
``ctx.reshard_after_forward`` (``compile(..., reshard_after_forward=...)``):

- True (the default; FSDP2's ``reshard_after_forward=True``): the backward reads a second
  gather, placed before the parameter's first backward use, so no full parameter lives
  from the forward to the backward. The joint graph hands the backward forward values
  computed from the parameter alone (its transpose, views, casts); those are recomputed
  from the second gather. Under activation checkpointing, a parameter used inside one
  transformer block gets no second gather here: its gather carries the block's module
  path, so the ``checkpoint`` pass recomputes it with the block (SimpleFSDP tags its
  gathers for recomputation alike); parameters outside blocks keep the backward gather.
- False: the backward reads the forward's gather (and the forward's views of it), so each
  parameter is gathered once per step (half the gather traffic) and lives whole from its
  forward use to its last backward use: at the turn from forward to backward every
  parameter the backward reads is whole at once, as in the unsharded engine. Under
  activation checkpointing the gather stays outside the block (no module path), so the
  ``checkpoint`` pass keeps it and recomputes only the views of it.

A parameter only the backward reads (one the loss never reaches: ``zeros_like`` of it)
gets one gather, before that backward use, either way.

Gathers move whatever dtype the parameter enters in: the engine casts a shard to the
compute dtype before the graph, so bf16 compute gathers bf16 while the shards stay fp32.
The ``overlap`` pass then issues each gather one block ahead of its use.

Assumes: parameter placeholders still have their full shapes (earlier passes are done
reading them), and forward nodes are tagged ``partitioner_tag == "is_forward"``.
Guarantees: every use reads the same full values as before (so both settings compute the
same numbers); each placeholder's ``meta["val"]`` is the padded shard, read only by gathers.
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx

from .._torch import c10d
from ._context import PassContext
from ._graph import is_backward, region_of, val

aten = torch.ops.aten


def gather_params(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """All-gather each sharded parameter before its forward use, and again before its backward
    use unless ``ctx.reshard_after_forward`` is False (see the module docstring)."""
    graph = gm.graph
    n = ctx.fsdp_size
    fake_mode = ctx.captured.fake_mode
    position = {node: i for i, node in enumerate(graph.nodes)}  # the original nodes keep their order
    for ph, (kind, name) in zip(ctx.captured.placeholders, ctx.captured.inputs):
        if kind != "param":
            continue
        full = val(ph)
        rows = math.ceil(full.shape[0] / n)
        with fake_mode:
            ph.meta["val"] = full.new_empty((rows, *full.shape[1:]))
        if not ph.users:
            continue
        readers = list(ph.users)
        first = min(readers, key=position.__getitem__)
        with graph.inserting_before(first):
            gathered = _gather(graph, ph, full, rows * n, n, ctx.fsdp_group_name, fake_mode)
        for reader in readers:
            reader.replace_input_with(ph, gathered[-1])
        only_backward = all(is_backward(r) for r in readers)  # e.g. zeros_like of a parameter the loss never reaches
        for node in gathered:
            node.meta["partitioner_tag"] = "is_backward" if only_backward else "is_forward"
        if only_backward or not ctx.reshard_after_forward:
            continue  # one gather: the backward reads this one (or the forward's views of it)
        derived = _derived(gathered)
        regions = {region_of(u) for node in derived for u in node.users if u not in derived and not is_backward(u)}
        block = regions.pop() if len(regions) == 1 and None not in regions else None
        if ctx.checkpoint is not None and block is not None:
            # checkpoint recomputes the gather (and the views of it) with the block
            for node in gathered:
                node.meta["nn_module_stack"] = dict(first.meta.get("nn_module_stack") or {})
            continue
        _regather_for_backward(graph, ph, gathered, derived, ctx, fake_mode, position)
    gm.recompile()
    return gm


def _derived(gathered: list[fx.Node]) -> set[fx.Node]:
    """The gathered parameter and the forward nodes computed from it alone (its transposes,
    views, casts): the joint graph hands those, not the parameter, to the backward."""
    out = set(gathered)
    frontier = [gathered[-1]]
    while frontier:
        for user in frontier.pop().users:
            if (user not in out and user.op == "call_function" and not is_backward(user)
                    and all(i in out for i in user.all_input_nodes)):
                out.add(user)
                frontier.append(user)
    return out


def _regather_for_backward(graph: fx.Graph, shard: fx.Node, gathered: list[fx.Node], derived: set[fx.Node],
                           ctx: PassContext, fake_mode, position: dict) -> None:
    """Point the backward's reads of the parameter (or of forward views of it) at a second
    gather placed before the first of them, recomputing those views from it."""
    readers = sorted({u for node in derived for u in node.users if is_backward(u) and u not in derived},
                     key=position.__getitem__)
    if not readers:
        return
    with graph.inserting_before(readers[0]):
        again = _gather(graph, shard, val(gathered[-1]), val(gathered[0]).shape[0], ctx.fsdp_size,
                        ctx.fsdp_group_name, fake_mode)
    copies = dict(zip(gathered, again))

    def copy(node: fx.Node) -> fx.Node:
        if node not in copies:
            args = fx.node.map_arg((node.args, node.kwargs), copy)
            with graph.inserting_before(readers[0]):
                copies[node] = graph.call_function(node.target, *args)
            copies[node].meta.update(node.meta, partitioner_tag="is_backward")
        return copies[node]

    for node in again:
        node.meta["partitioner_tag"] = "is_backward"
    for reader in readers:
        reader.args, reader.kwargs = fx.node.map_arg(
            (reader.args, reader.kwargs), lambda a: copy(a) if a in derived else a)


def _gather(graph: fx.Graph, shard: fx.Node, full, padded_rows: int, n: int, group: str, fake_mode) -> list[fx.Node]:
    """Nodes computing the full parameter from ``shard``: gather, wait, and the slice that
    drops padding rows when dim 0 is not a multiple of n."""
    nodes = [graph.call_function(c10d.all_gather_into_tensor.default, (shard, n, group))]
    nodes.append(graph.call_function(c10d.wait_tensor.default, (nodes[0],)))
    if padded_rows != full.shape[0]:
        nodes.append(graph.call_function(aten.slice.Tensor, (nodes[1], 0, 0, full.shape[0])))
    with fake_mode:
        padded = full.new_empty((padded_rows, *full.shape[1:]))
    nodes[0].meta["val"] = padded
    nodes[1].meta["val"] = padded
    if len(nodes) == 3:
        nodes[2].meta["val"] = full
    return nodes
