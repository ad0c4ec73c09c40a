"""The ``checkpoint`` pass: activation checkpointing as a rewrite of the joint graph.

Rewrites: every forward node inside a transformer block (a region) that the backward
reads is recomputed in the backward instead of being kept: the pass copies the forward
nodes a backward node needs, transitively within the region, right before the first
backward node that needs them, and points the backward (data gradients and the
per-sample einsums alike) at the copies. Forward versions the forward itself no longer
needs die after their last forward use, so no activation inside a region outlives the
region's forward; the recomputed copies die right after their last backward use.

Regions come from the module path dynamo records on each forward node
(``nn_module_stack``): the first module whose name ends in an index (``layers.3``,
``h.0``) is the region. Kept from the forward, per region: the nodes that the forward
outside the region reads (the block's output, i.e. the next block's input) and, with
``"selective"``, the attention outputs and their log-sum-exp (LoongTrain's Selective
Checkpoint++), so attention (and its ring communication under cp) is not recomputed; under
2D attention also the ring's q/k/v and the output after their hp all-to-alls, so no
all-to-all is recomputed either.
With ``"block"`` ring attention is recomputed with its communication.

Random ops (dropout) are kept with their masks, never recomputed: a recomputation would
draw another mask, so the backward would differentiate a different function.

Assumes: forward nodes carry ``partitioner_tag == "is_forward"`` and module stacks; the
only random op inside regions is ``native_dropout`` (any other impure op but functional
collectives is refused).
Guarantees: the same values as without the pass (the copies compute the same ops on the
same inputs, random draws are not repeated); the graph stays topologically ordered.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .._torch import COLLECTIVES, c10d
from ..errors import UnsupportedModelError
from .. import ops  # noqa: F401  (registers longshield::ring_attention)
from ._context import KEEP_SELECTIVE, PassContext
from ._graph import FUSED_ATTENTION, eliminate_dead_code, region_of

aten = torch.ops.aten
_RING = torch.ops.longshield.ring_attention.default


def checkpoint(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Recompute block activations in the backward (see the module docstring)."""
    graph = gm.graph
    policy = ctx.checkpoint
    forward = [n for n in graph.nodes if n.op == "call_function" and n.meta.get("partitioner_tag") == "is_forward"]
    region = {n: r for n in forward if (r := region_of(n)) is not None}
    if not region:
        raise UnsupportedModelError(
            "checkpoint: no transformer blocks found (no module named like 'layers.0' in the forward); "
            "use checkpoint=None")
    is_forward = set(forward)
    keep = set()
    for node, r in region.items():
        if any(u in is_forward and region.get(u) != r for u in node.users):
            keep.add(node)  # read by the forward outside the region: the block output
        if policy == "selective" and _is_attention(node):
            keep.add(node)
            keep.update(node.users)  # its getitems: out and lse
        if policy == "selective" and node.meta.get(KEEP_SELECTIVE):
            keep.add(node)  # 2D attention's inputs and output after their all-to-alls
        if _is_random(node):
            keep.add(node)  # recomputed, it would draw another mask
            keep.update(node.users)
        elif node.is_impure() and not _is_attention(node) and not _is_collective(node):
            raise UnsupportedModelError(f"checkpoint: {node.target} ({node.name}) in {r} is impure; "
                                        "recomputing it would change the result")
    recompute = {n for n in region if n not in keep}
    copies: dict[fx.Node, fx.Node] = {}

    def recomputed(node: fx.Node, before: fx.Node) -> fx.Node:
        if node not in recompute:
            return node
        if node not in copies:
            with graph.inserting_before(before):
                args = fx.node.map_arg((node.args, node.kwargs), lambda a: recomputed(a, before))
            with graph.inserting_before(before):
                copy = graph.call_function(node.target, *args)
            copy.meta.update(node.meta)
            copy.meta["partitioner_tag"] = "is_backward"
            copy.meta["recomputed"] = True
            copy.name = f"{node.name}_recomputed"
            copies[node] = copy
        return copies[node]

    for node in list(graph.nodes):
        if node.op != "call_function" or node in is_forward or node.meta.get("recomputed"):
            continue
        if not any(i in recompute for i in node.all_input_nodes):
            continue
        node.args, node.kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: recomputed(a, node))
    # Forward versions read only by the backward are now unused. Attention is removed by
    # hand too: fx treats it as impure because of its dropout argument.
    for node in reversed(list(graph.nodes)):
        if node in recompute and not node.users:
            graph.erase_node(node)
    eliminate_dead_code(graph)
    gm.recompile()
    return gm


def _is_random(node: fx.Node) -> bool:
    """Dropout, alone or inside a fused attention kernel (its dropout_p argument)."""
    if node.target is aten.native_dropout.default:
        return True
    if node.target in FUSED_ATTENTION:
        schema = node.target._schema
        dropout = next(i for i, a in enumerate(schema.arguments) if a.name == "dropout_p")
        p = node.args[dropout] if dropout < len(node.args) else node.kwargs.get("dropout_p", 0.0)
        return p > 0
    return False


def _is_collective(node: fx.Node) -> bool:
    """A functional collective or its wait: recomputed, every rank issues it again in the
    same graph order, so it returns the same value (the ring's own hops are recomputed alike)."""
    return node.target in COLLECTIVES or node.target == c10d.wait_tensor.default


def _is_attention(node: fx.Node) -> bool:
    return node.target in FUSED_ATTENTION or node.target is _RING
