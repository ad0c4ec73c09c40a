"""The ``batch_dims`` pass: tag every tensor's sample dimension; reject ops that mix samples
or that make a sample's loss depend on its row position in the batch.

Rewrites: nothing. It sets ``node.meta["batch_dim"]`` on every node to a ``BatchDim``
(which dimension holds samples, how many rows each sample owns in it when views
folded the batch with other dimensions, e.g. B*T, and in how many blocks those rows recur
when the folded rows were tiled, e.g. E*B*T tokens repeated per expert), to ``None`` for tensors that do not
depend on any one sample (parameters, constants, position ids), or to a tuple of those for
ops with several outputs. On every tensor tagged ``None`` it also sets
``node.meta["varies"]`` (see ``row_variation``). The rules, one per aten op, are in
``batch_rules``; ``register_batch_rule`` adds one.

Assumes: every user input has the batch as dimension 0, of size ``ctx.batch_size``; the
loss cotangent is (B,). Every op that touches a batched tensor has a rule below, matched
on aten ops (never on module names). An op whose rule does not say which dimensions of its
untagged inputs line up with the batch (``aligned=`` of ``register_batch_rule``) is checked
on every untagged dimension of the batch's size.

Where the rules come from. Pointwise ops: aten's ``pointwise`` tag (one broadcasting rule).
Views, reductions, matmuls, attention kernels, norms, indexing: hand rules (``batch_rules``,
``batch_rules_indexing``), because they track what DTensor cannot express: a batch folded
with other dims (B*T rows, ``inner``), the backward's weight-gradient reductions, and whether
an untagged input varies along the batch. Every other aten op: DTensor's sharding
propagation (``dtensor_rule``), the batch as a Shard over a mesh of one coordinate per
sample; its rules are maintained for distributed correctness, which is exactly "each
sample's rows are computed from that sample's rows". Still needing a hand rule: ops DTensor
has no strategy for (refused by name, ``register_batch_rule`` adds one).

Ops whose values reach no output of the graph (those feeding only run-time assertions, such
as a check on the longest sequence of the batch) are tagged ``None`` unchecked.

Guarantees: in the forward, no op that a value of the step depends on combines rows of different samples; otherwise
``UnsupportedModelError`` names the op and the module it came from. In the backward, a
reduction over the batch dimension is allowed and tagged ``None``: those are the
weight-gradient reductions the ``per_sample`` pass rewrites; a per-sample value computed from
one (a tensor hook or a custom ``autograd.Function`` backward that normalises, centres or clips
the gradient over the batch) is refused. Forward and backward, no
per-sample value depends on the row a sample sits in: an op that moves rows along the batch
dimension (flip, roll, index/index_select/gather/take over it), or that combines per-sample
data with an untagged value whose entries differ along the dimension lined up with the batch
(a weight ``arange(B)``, ``ones(B).cumsum(0)``, a per-row parameter or constant tensor), is
refused naming the op, its module, and the op that made the value. Removing one record
shifts the later ones to new rows, so such a loss changes every sample's clipped gradient and
the sum's add/remove sensitivity exceeds C. Position ids over the sequence, causal masks and
per-token weights folded with the batch (B*T rows, constant per sample block) stay accepted.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from .._torch import BatchArg, OpOverload, dtensor_batch_dims
from ..errors import UnsupportedModelError
from ._context import PassContext
from ._graph import CONSTANT_LIKE, is_backward, is_pointwise, module_of, val
from .row_variation import variation, varies

aten = torch.ops.aten


@dataclass(frozen=True)
class BatchDim:
    """Dimension ``dim`` has size outer*B*inner and is laid out as (outer, B, inner): sample i
    owns rows [o*B*inner + i*inner, o*B*inner + (i+1)*inner) of every outer block o.

    ``outer`` > 1 when rows of the folded batch were tiled (an MoE that ``repeat``s the B*T
    tokens once per expert); only rules registered with ``outer=True`` accept such inputs.
    """

    dim: int
    inner: int = 1
    outer: int = 1

    def __repr__(self):  # untiled tags print as before, in messages and test ids
        tiled = f", outer={self.outer}" if self.outer != 1 else ""
        return f"BatchDim(dim={self.dim}, inner={self.inner}{tiled})"

    def rows(self, B: int) -> int:
        return self.outer * B * self.inner

    def at(self, dim: int) -> "BatchDim":
        """The same rows, moved to dimension ``dim``."""
        return BatchDim(dim, self.inner, self.outer)


def batch_dim(node) -> BatchDim | None:
    return node.meta.get("batch_dim") if isinstance(node, fx.Node) else None


def batch_dims(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Tag sample dimensions on every node (see the module docstring)."""
    return _tag_graph(gm, ctx.captured.inputs, ctx.batch_size)


def _tag_graph(gm: fx.GraphModule, kinds, B: int) -> fx.GraphModule:
    for ph, (kind, _) in zip(gm.graph.find_nodes(op="placeholder"), kinds):
        tag = None
        if kind in ("input", "cotangent"):
            shape = val(ph).shape
            if len(shape) == 0 or shape[0] != B:
                raise UnsupportedModelError(
                    f"input {ph.name} has shape {tuple(shape)}: every batch tensor must have the batch "
                    f"(size {B}) as dimension 0")
            tag = BatchDim(0, 1)
        ph.meta["batch_dim"] = tag
    live = _reaching_outputs(gm.graph)
    pooled: dict[fx.Node, fx.Node] = {}  # untagged values computed from samples -> the op that pooled them
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node not in live:  # feeds only run-time assertions: no value of the step depends on it
            node.meta["batch_dim"] = None
            continue
        node.meta["batch_dim"] = _tag(node, B)
        _no_pooled_value_flows_back(node, pooled)
        if node.meta["batch_dim"] is None and val(node) is not None:
            node.meta["varies"] = variation(node)
    return gm


def _holds_samples(tag) -> bool:
    return tag is not None and (not isinstance(tag, tuple) or any(t is not None for t in tag))


def _no_pooled_value_flows_back(node: fx.Node, pooled: dict) -> None:
    """The backward may reduce over the batch (a weight gradient, tagged None), but such a value
    must only go on to parameters' gradients: per-sample data computed from it (a tensor hook or
    a custom ``autograd.Function`` backward that normalises, centres or clips the gradient over
    the whole batch) would make each sample's gradient depend on every other sample."""
    if _holds_samples(batch_dim(node)):
        source = next((i for i in node.all_input_nodes if i in pooled), None)
        if source is not None:
            raise UnsupportedModelError(
                f"op {node.target} (node {node.name}) in {module_of(node)} mixes samples: it combines per-sample "
                f"gradients with {source.name}, computed from a reduction over the batch ({pooled[source].target}, "
                f"node {pooled[source].name}) in the backward (a tensor hook or a custom autograd.Function's backward), "
                "so each sample's gradient would depend on the others. Way out: make the hook or backward act on each "
                "sample's gradient alone (elementwise, or reducing over that sample's own dimensions), or remove it.")
    elif val(node) is not None and node.target not in CONSTANT_LIKE:
        source = next((i for i in node.all_input_nodes if i in pooled), None)
        if source is not None:
            pooled[node] = pooled[source]
        elif is_backward(node) and any(_holds_samples(batch_dim(i)) for i in node.all_input_nodes):
            # pooled here (the forward refuses pooling; the values some of its rules leave untagged,
            # as nll_loss's total_weight, carry no sample into a per-sample value)
            pooled[node] = node.args[0] if node.target is operator.getitem else node


def _reaching_outputs(graph: fx.Graph) -> set[fx.Node]:
    live, stack = set(), [graph.output_node()]
    while stack:
        node = stack.pop()
        for x in node.all_input_nodes:
            if x not in live:
                live.add(x)
                stack.append(x)
    return live


class Mixing(Exception):
    """Raised by a rule whose op combines rows of different samples; ``way_out`` replaces the
    generic advice where the op tells what the model was doing (a batch norm, an MoE count)."""

    def __init__(self, why: str, way_out: str | None = None):
        super().__init__(why)
        self.way_out = way_out


class RowPosition(Exception):
    """Raised by a rule whose op moves rows along the batch dimension."""


def _tag(node: fx.Node, B: int):
    if node.target is operator.getitem:
        parent_tag = batch_dim(node.args[0])
        return parent_tag[node.args[1]] if isinstance(parent_tag, tuple) else parent_tag
    batched = [a for a in node.all_input_nodes if batch_dim(a) is not None]
    if not batched:
        return None
    rule = _rule_for(node.target)
    if rule is None:
        no_rule(node)
    if rule not in _OUTER_AWARE and any(getattr(batch_dim(a), "outer", 1) != 1 for a in batched):
        _refuse_outer(node)
    try:
        tag = rule(node, B)
    except Mixing as e:
        if is_backward(node):
            return None  # a weight-gradient reduction; the per_sample pass rewrites it
        raise UnsupportedModelError(
            f"op {node.target} (node {node.name}) in {module_of(node)} mixes samples: {e}. "
            "DP-SGD needs each sample's loss to depend on that sample only. Way out: "
            f"{e.way_out or 'remove the op (e.g. compute pairwise losses within a sample)'}.")
    except RowPosition as e:
        raise _row_position_error(node, str(e)) from None
    for x, dim, inner in _aligned_for(node.target)(node, tag, B):
        v = varies(x).get(dim)
        # A period dividing inner gives every sample the same entries, in each outer block too.
        if v is not None and inner % v.period:
            raise _row_position_error(
                node, f"it combines per-sample data with {x.name}, whose entries differ from row to row "
                f"along the batch dimension (its dimension {dim}, made by {v.origin})")
    return tag


def no_rule(node: fx.Node):
    raise UnsupportedModelError(
        f"op {node.target} (node {node.name}) in {module_of(node)} touches per-sample data and has no "
        "batch rule, so longshield_fx cannot prove it keeps samples apart. Way out: write the layer "
        "with standard ops, or register a rule with longshield_fx.passes.batch_dims.register_batch_rule.")


def _refuse_outer(node: fx.Node):
    tags = sorted({str(batch_dim(a)) for a in node.all_input_nodes if batch_dim(a) is not None})
    raise UnsupportedModelError(
        f"op {node.target} (node {node.name}) in {module_of(node)} reads a tensor whose batch rows are tiled "
        f"in blocks ({', '.join(tags)}: each sample's rows recur in every one of `outer` blocks, as when an MoE "
        "repeats the tokens once per expert), and no rule proves this op keeps samples apart on such a tensor. "
        "Way out: view the tiled dimension back to (blocks, rows) before the op, or register a rule with "
        "longshield_fx.passes.batch_dims.register_batch_rule(op, outer=True).")


def _row_position_error(node: fx.Node, what: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"op {node.target} (node {node.name}) in {module_of(node)} makes a sample's loss depend on its row "
        f"position in the batch: {what}. Removing one record moves the later ones to other rows and changes "
        "their losses, so one record can change the clipped sum by more than C. Way out: a per-sample loss "
        "may not depend on the sample's row position; compute weights from the sample's own data (or pass "
        "them as an input with the batch as dimension 0), and index or permute the other dimensions only.")


# ---------------------------------------------------------------------------------------
# Rules: (node, B) -> BatchDim | None | tuple; raise Mixing when samples are combined and
# RowPosition when rows move along the batch dimension. After a rule, the untagged inputs its
# ``aligned`` function lines up with the batch must not vary there (see ``varies``).

_RULES: dict = {}
_OUTER_AWARE: set = set()  # rules that read ``BatchDim.outer`` and keep it in their output tags
# op -> fn(node, tag, B) -> [(untagged input, its dim lined up with the batch, rows per sample)]
_ALIGNED: dict = {}


def register_batch_rule(*ops, aligned=None, outer=False):
    """Register ``fn(node, B) -> BatchDim | None | tuple`` for aten/custom ops.

    ``outer=True``: ``fn`` handles inputs tagged with ``outer`` > 1 (tiled batch rows); any
    other rule never sees one (the op is refused first).

    ``aligned(node, tag, B)``, given the output tag ``fn`` returned, lists the untagged
    tensor inputs whose entries line up with the batch: ``(input, dim, inner)`` tuples, one
    per input dimension that meets the batch dimension (``inner`` rows per sample). Such a
    dimension must be uniform (see ``varies``). Without it, every untagged dimension of the
    batch's size is checked.
    """

    def deco(fn):
        if outer:
            _OUTER_AWARE.add(fn)
        for op in ops:
            _RULES[op] = fn
            if aligned is not None:
                _ALIGNED[op] = aligned
        return fn

    return deco


_BATCH_NORM = ("batch norm normalises with statistics over the batch",
               "replace BatchNorm with LayerNorm or GroupNorm, or keep it in eval mode (running statistics: "
               "accepted)")
_RUNNING_STATISTICS = ("norm in training mode with running statistics updates them from every sample of the "
                       "batch (BatchNorm also normalises with the batch's statistics)",
                       "replace BatchNorm with LayerNorm or GroupNorm, or keep it in eval mode (accepted); "
                       "InstanceNorm with track_running_stats=False is accepted")
# A count over the whole batch is, in a language model, almost always an MoE router's
# load-balancing loss (tokens routed to each expert across the batch).
_COUNT_WAY_OUT = ("if it is an MoE load-balancing loss, train without it (longshield_fx.CausalLMLoss "
                  "does; the router still learns through the routing weights) or compute it from each "
                  "sample's own tokens and add it to that sample's loss")
_MIXING = {
    aten._native_batch_norm_legit.default: _RUNNING_STATISTICS,
    aten._native_batch_norm_legit_functional.default: _RUNNING_STATISTICS,
    aten.native_batch_norm.default: _RUNNING_STATISTICS,
    aten.histc.default: ("a histogram counts the entries of every sample together", _COUNT_WAY_OUT),
    aten.bincount.default: ("counts the entries of every sample together", _COUNT_WAY_OUT),
}


def _rule_for(op):
    if op in _RULES:
        return _RULES[op]
    if op in _MIXING:
        def mixing(node, B, reason=_MIXING[op]):
            raise Mixing(*reason)
        return mixing
    if is_pointwise(op):
        return pointwise_rule
    return dtensor_rule if isinstance(op, OpOverload) else None


def dtensor_rule(node: fx.Node, B: int):
    """For an op without a hand rule, DTensor's sharding propagation decides: the batched
    inputs sharded along their batch dims over a mesh of B coordinates (one sample each), the
    others replicated. An output DTensor can compute locally, still sharded, keeps each sample's
    rows apart; one that would need data moved between coordinates first, or comes out as a
    partial sum, combines samples."""
    def arg(a):
        v = val(a)
        if v is None:
            return a.meta.get("val") if isinstance(a, fx.Node) else a
        tag = batch_dim(a)
        return BatchArg(v, None if tag is None else tag.dim)

    args, kwargs = fx.node.map_arg((node.args, node.kwargs), arg)
    placements = dtensor_batch_dims(node.target, args, kwargs, B)
    if placements is None:
        no_rule(node)
    if placements == "redistribute":
        raise Mixing("DTensor's sharding rules cannot run it on each sample's rows alone")
    outs = node.meta["val"] if isinstance(node.meta["val"], (tuple, list)) else (node.meta["val"],)
    tags = []
    for out, placement in zip(outs, placements):
        if placement is None or placement[0] == "replicate":
            tags.append(None)  # not a tensor, or computed from shapes and shared inputs only
        elif placement[0] == "partial":
            raise Mixing("it sums over the batch dimension")
        else:
            tags.append(BatchDim(placement[1], out.shape[placement[1]] // B))
    return tuple(tags) if isinstance(node.meta["val"], (tuple, list)) else tags[0]


def _aligned_for(op):
    if op in _ALIGNED:
        return _ALIGNED[op]
    return broadcast_aligned if is_pointwise(op) else by_size_aligned


def untagged(node: fx.Node) -> list[fx.Node]:
    return [a for a in node.all_input_nodes if batch_dim(a) is None and val(a) is not None]


def broadcast_aligned(node, tag, B):
    """Untagged inputs broadcast against the output: dimensions line up from the right."""
    rank = val(node).dim()
    found = [(x, tag.dim - rank + val(x).dim(), tag.inner) for x in untagged(node)]
    return [(x, d, inner) for x, d, inner in found if d >= 0]


def by_size_aligned(node, tag, B):
    """No alignment known: any untagged dimension of a batched input's size may meet the batch."""
    rows = {t.rows(B): t.inner for t in map(batch_dim, node.all_input_nodes) if isinstance(t, BatchDim)}
    return [(x, d, rows[s]) for x in untagged(node) for d, s in enumerate(val(x).shape) if s in rows]


def weights_only(node, tag, B):
    return []  # untagged inputs (weights, tables, indices over other dims) never meet the batch


def single_tag(node: fx.Node) -> BatchDim:
    """The one batch tag all batched inputs share (in their own coordinates)."""
    tags = {batch_dim(a) for a in node.all_input_nodes if batch_dim(a) is not None}
    if len(tags) != 1:
        raise Mixing(f"inputs hold samples in different dimensions {sorted(tags, key=str)}")
    return tags.pop()


def pointwise_rule(node: fx.Node, B: int):
    out = val(node)
    rank = out.dim()
    placed = set()
    for a in node.all_input_nodes:
        tag = batch_dim(a)
        if tag is None:
            continue
        pos = rank - val(a).dim() + tag.dim
        if out.shape[pos] != tag.rows(B):
            raise Mixing(f"broadcasting changes the batch dimension of {a.name}")
        placed.add(tag.at(pos))
    if len(placed) != 1:
        raise Mixing(f"inputs hold samples in different dimensions {sorted(placed, key=str)}")
    return placed.pop()


_OUTER_AWARE.add(pointwise_rule)  # elementwise: each output entry comes from the same entry of each input
