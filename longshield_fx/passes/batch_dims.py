"""The ``batch_dims`` pass: tag every tensor's sample dimension; reject ops that mix samples
or that make a sample's loss depend on its row position in the batch.

Rewrites: nothing. It sets ``node.meta["batch_dim"]`` on every node to a ``BatchDim``
(which dimension holds samples, and how many rows each sample owns in it when views
folded the batch with other dimensions, e.g. B*T), to ``None`` for tensors that do not
depend on any one sample (parameters, constants, position ids), or to a tuple of those for
ops with several outputs. On every tensor tagged ``None`` it also sets
``node.meta["varies"]``: the dimensions along which its entries may differ, each with a
``Variation`` (the entries depend on the index along it only modulo ``period``, and the op
that made them differ). A dimension not listed is uniform: every index holds the same values
(a size-1 or expanded dimension, ``ones``/``full``/``zeros_like``, ``arange(T)`` broadcast
over the batch).

Assumes: every user input has the batch as dimension 0, of size ``ctx.batch_size``; the
loss cotangent is (B,). Every op that touches a batched tensor has a rule below, matched
on aten ops (never on module names). An op whose rule does not say which dimensions of its
untagged inputs line up with the batch (``aligned=`` of ``register_batch_rule``) is checked
on every untagged dimension of the batch's size. An op without a variation rule is assumed to
make its output differ along every dimension (``arange``, ``eye``, ``randperm``, ``rand``, an
unknown op: refused wherever they line up with the batch, even if the values happen to be
equal).

Guarantees: in the forward, no op combines rows of different samples; otherwise
``UnsupportedModelError`` names the op and the module it came from. In the backward, a
reduction over the batch dimension is allowed and tagged ``None``: those are the
weight-gradient reductions the ``per_sample`` pass rewrites. Forward and backward, no
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

import math
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..errors import UnsupportedModelError
from .._torch import OpOverload
from ._context import PassContext
from ._graph import is_backward, module_of, val

aten = torch.ops.aten


@dataclass(frozen=True)
class BatchDim:
    """Dimension ``dim`` has size B*inner; sample i owns rows [i*inner, (i+1)*inner)."""

    dim: int
    inner: int = 1


def batch_dim(node) -> BatchDim | None:
    return node.meta.get("batch_dim") if isinstance(node, fx.Node) else None


@dataclass(frozen=True)
class Variation:
    """Entries differ along a dimension, as a function of its index modulo ``period``.

    ``period`` divides the dimension's size (the size itself: no known structure);
    ``origin`` names the op that made them differ, for error messages.
    """

    period: int
    origin: str


def varies(node) -> dict[int, Variation]:
    """Dimensions along which an untagged tensor's entries may differ (see the module docstring).

    Parameters, buffers and constant tensors of the graph may differ along every dimension.
    """
    if not isinstance(node, fx.Node) or val(node) is None:
        return {}
    if "varies" in node.meta:
        return node.meta["varies"]
    return _everywhere(node)


def _everywhere(node: fx.Node) -> dict[int, Variation]:
    origin = _describe(node)
    return {d: Variation(s, origin) for d, s in enumerate(val(node).shape) if s > 1}


def _describe(node: fx.Node) -> str:
    if node.op == "placeholder":
        return f"graph input {node.name} (a parameter or buffer)"
    if node.op == "get_attr":
        return f"the tensor constant {node.target} (a torch.tensor(...) literal in the model)"
    if node.target is operator.getitem:
        node = node.args[0]
    return f"{node.target} (node {node.name}) in {module_of(node)}"


def batch_dims(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Tag sample dimensions on every node (see the module docstring)."""
    B = ctx.batch_size
    kinds = ctx.captured.inputs
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
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        node.meta["batch_dim"] = _tag(node, B)
        if node.meta["batch_dim"] is None and val(node) is not None:
            node.meta["varies"] = _variation(node)
    return gm


class _Mixing(Exception):
    pass


class _RowPosition(Exception):
    """Raised by a rule whose op moves rows along the batch dimension."""


def _tag(node: fx.Node, B: int):
    if node.target is operator.getitem:
        parent_tag = batch_dim(node.args[0])
        return parent_tag[node.args[1]] if isinstance(parent_tag, tuple) else parent_tag
    batched = [a for a in _flat_inputs(node) if batch_dim(a) is not None]
    if not batched:
        return None
    rule = _rule_for(node.target)
    if rule is None:
        _no_rule(node)
    try:
        tag = rule(node, B)
    except _Mixing as e:
        if is_backward(node):
            return None  # a weight-gradient reduction; the per_sample pass rewrites it
        raise UnsupportedModelError(
            f"op {node.target} (node {node.name}) in {module_of(node)} mixes samples: {e}. "
            "DP-SGD needs each sample's loss to depend on that sample only; remove the op "
            "(e.g. replace BatchNorm with LayerNorm/GroupNorm, compute pairwise losses within a sample).")
    except _RowPosition as e:
        raise _row_position_error(node, str(e)) from None
    for x, dim, inner in _aligned_for(node.target)(node, tag, B):
        v = varies(x).get(dim)
        if v is not None and inner % v.period:
            raise _row_position_error(
                node, f"it combines per-sample data with {x.name}, whose entries differ from row to row "
                f"along the batch dimension (its dimension {dim}, made by {v.origin})")
    return tag


def _no_rule(node: fx.Node):
    raise UnsupportedModelError(
        f"op {node.target} (node {node.name}) in {module_of(node)} touches per-sample data and has no "
        "batch rule, so longshield_fx cannot prove it keeps samples apart. Way out: write the layer "
        "with standard ops, or register a rule with longshield_fx.passes.batch_dims.register_batch_rule.")


def _row_position_error(node: fx.Node, what: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"op {node.target} (node {node.name}) in {module_of(node)} makes a sample's loss depend on its row "
        f"position in the batch: {what}. Removing one record moves the later ones to other rows and changes "
        "their losses, so one record can change the clipped sum by more than C. Way out: a per-sample loss "
        "may not depend on the sample's row position; compute weights from the sample's own data (or pass "
        "them as an input with the batch as dimension 0), and index or permute the other dimensions only.")


def _flat_inputs(node: fx.Node) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), found.append)
    return found


# ---------------------------------------------------------------------------------------
# Rules: (node, B) -> BatchDim | None | tuple; raise _Mixing when samples are combined and
# _RowPosition when rows move along the batch dimension. After a rule, the untagged inputs its
# ``aligned`` function lines up with the batch must not vary there (see ``varies``).

_RULES: dict = {}
# op -> fn(node, tag, B) -> [(untagged input, its dim lined up with the batch, rows per sample)]
_ALIGNED: dict = {}


def register_batch_rule(*ops, aligned=None):
    """Register ``fn(node, B) -> BatchDim | None | tuple`` for aten/custom ops.

    ``aligned(node, tag, B)``, given the output tag ``fn`` returned, lists the untagged
    tensor inputs whose entries line up with the batch: ``(input, dim, inner)`` tuples, one
    per input dimension that meets the batch dimension (``inner`` rows per sample). Such a
    dimension must be uniform (see ``varies``). Without it, every untagged dimension of the
    batch's size is checked.
    """

    def deco(fn):
        for op in ops:
            _RULES[op] = fn
            if aligned is not None:
                _ALIGNED[op] = aligned
        return fn

    return deco


_POINTWISE_EXTRA = {aten._to_copy.default, aten.detach.default, aten.alias.default,
                    aten.copy.default, aten.lift_fresh_copy.default, aten.contiguous.default}


_CONSTANT_LIKE = (aten.zeros_like.default, aten.ones_like.default, aten.full_like.default,
                  aten.empty_like.default, aten.fill.Scalar, aten.new_zeros.default,
                  aten.new_ones.default, aten.new_empty.default, aten.new_full.default)


@register_batch_rule(*_CONSTANT_LIKE)
def _constant(node, B):
    return None  # values do not depend on any sample, only the shape does


_MIXING = {
    aten._native_batch_norm_legit.default: "batch norm normalises with statistics over the batch",
    aten._native_batch_norm_legit_functional.default: "batch norm normalises with statistics over the batch",
    aten._native_batch_norm_legit_no_training.default: "batch norm uses batch statistics",
    aten.native_batch_norm.default: "batch norm normalises with statistics over the batch",
}


def _rule_for(op):
    if op in _RULES:
        return _RULES[op]
    if op in _MIXING:
        def mixing(node, B, why=_MIXING[op]):
            raise _Mixing(why)
        return mixing
    if _is_pointwise(op):
        return _pointwise
    return None


def _is_pointwise(op) -> bool:
    return op in _POINTWISE_EXTRA or (isinstance(op, OpOverload) and torch.Tag.pointwise in op.tags)


def _aligned_for(op):
    if op in _ALIGNED:
        return _ALIGNED[op]
    return _broadcast if _is_pointwise(op) else _by_size


def _untagged(node: fx.Node) -> list[fx.Node]:
    return [a for a in _flat_inputs(node) if batch_dim(a) is None and val(a) is not None]


def _broadcast(node, tag, B):
    """Untagged inputs broadcast against the output: dimensions line up from the right."""
    rank = val(node).dim()
    found = [(x, tag.dim - rank + val(x).dim(), tag.inner) for x in _untagged(node)]
    return [(x, d, inner) for x, d, inner in found if d >= 0]


def _by_size(node, tag, B):
    """No alignment known: any untagged dimension of a batched input's size may meet the batch."""
    rows = {B * t.inner: t.inner for t in map(batch_dim, _flat_inputs(node)) if isinstance(t, BatchDim)}
    return [(x, d, rows[s]) for x in _untagged(node) for d, s in enumerate(val(x).shape) if s in rows]


def _weights_only(node, tag, B):
    return []  # untagged inputs (weights, tables, indices over other dims) never meet the batch


def _norm(dim: int, rank: int) -> int:
    return dim + rank if dim < 0 else dim


def _single_tag(node: fx.Node) -> BatchDim:
    """The one batch tag all batched inputs share (in their own coordinates)."""
    tags = {batch_dim(a) for a in _flat_inputs(node) if batch_dim(a) is not None}
    if len(tags) != 1:
        raise _Mixing(f"inputs hold samples in different dimensions {sorted(tags, key=str)}")
    return tags.pop()


def _pointwise(node: fx.Node, B: int):
    out = val(node)
    rank = out.dim()
    placed = set()
    for a in _flat_inputs(node):
        tag = batch_dim(a)
        if tag is None:
            continue
        pos = rank - val(a).dim() + tag.dim
        if out.shape[pos] != B * tag.inner:
            raise _Mixing(f"broadcasting changes the batch dimension of {a.name}")
        placed.add(BatchDim(pos, tag.inner))
    if len(placed) != 1:
        raise _Mixing(f"inputs hold samples in different dimensions {sorted(placed, key=str)}")
    return placed.pop()


@register_batch_rule(aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def _view(node, B):
    tag = batch_dim(node.args[0])
    in_shape, out_shape = list(val(node.args[0]).shape), list(val(node).shape)
    prefix, suffix = math.prod(in_shape[: tag.dim]), math.prod(in_shape[tag.dim + 1:])
    rows = B * tag.inner
    candidates = [
        d for d in range(len(out_shape))
        if math.prod(out_shape[:d]) == prefix and out_shape[d] % B == 0
        and out_shape[d] * math.prod(out_shape[d + 1:]) == rows * suffix
    ]
    if not candidates:
        raise _Mixing(f"the view {in_shape} -> {out_shape} folds the batch dimension into a dimension before it")
    # Only size-1 dims separate candidates; for B > 1 they are excluded, for B == 1 the
    # leftmost keeps the batch leading, as rules such as attention expect.
    d = candidates[0]
    return BatchDim(d, out_shape[d] // B)


@register_batch_rule(aten.expand.default)
def _expand(node, B):
    tag = batch_dim(node.args[0])
    return BatchDim(tag.dim + val(node).dim() - val(node.args[0]).dim(), tag.inner)


@register_batch_rule(aten.unsqueeze.default)
def _unsqueeze(node, B):
    tag = batch_dim(node.args[0])
    dim = _norm(node.args[1], val(node).dim())
    return BatchDim(tag.dim + (dim <= tag.dim), tag.inner)


@register_batch_rule(aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)
def _squeeze(node, B):
    tag = batch_dim(node.args[0])
    in_shape = val(node.args[0]).shape
    if node.target == aten.squeeze.default:
        dims = [i for i, s in enumerate(in_shape) if s == 1]
    else:
        dims = node.args[1] if isinstance(node.args[1], (list, tuple)) else [node.args[1]]
        dims = [_norm(d, len(in_shape)) for d in dims if in_shape[_norm(d, len(in_shape))] == 1]
    if tag.dim in dims:
        dims.remove(tag.dim)
        if val(node).dim() == len(in_shape) - len(dims) - 1:
            raise _Mixing("squeezes away the batch dimension")
    return BatchDim(tag.dim - sum(d < tag.dim for d in dims), tag.inner)


@register_batch_rule(aten.t.default, aten.transpose.int, aten.permute.default)
def _permute(node, B):
    tag = batch_dim(node.args[0])
    return BatchDim(_perm(node).index(tag.dim), tag.inner)


def _perm(node: fx.Node) -> list[int]:
    """Output dim i is input dim perm[i]."""
    rank = val(node).dim()
    if node.target == aten.t.default:
        return list(range(rank))[::-1]
    if node.target == aten.transpose.int:
        perm = list(range(rank))
        a, b = _norm(node.args[1], rank), _norm(node.args[2], rank)
        perm[a], perm[b] = perm[b], perm[a]
        return perm
    return [_norm(d, rank) for d in node.args[1]]


@register_batch_rule(aten.slice.Tensor)
def _slice(node, B):
    tag = batch_dim(node.args[0])
    shape = val(node.args[0]).shape
    dim = _norm(node.args[1] if len(node.args) > 1 else 0, len(shape))
    if dim == tag.dim and val(node).shape[dim] != shape[dim]:
        raise _Mixing("slices across the batch dimension")
    return tag


@register_batch_rule(aten.slice_backward.default)
def _slice_backward(node, B):
    tag = batch_dim(node.args[0])
    shape = val(node).shape
    if _norm(node.args[2], len(shape)) == tag.dim and val(node.args[0]).shape[tag.dim] != shape[tag.dim]:
        raise _Mixing("pads across the batch dimension")
    return tag


@register_batch_rule(aten.select_backward.default)
def _select_backward(node, B):
    tag = batch_dim(node.args[0])
    dim = _norm(node.args[2], val(node).dim())
    return BatchDim(tag.dim + (dim <= tag.dim), tag.inner)


@register_batch_rule(aten.select.int)
def _select(node, B):
    tag = batch_dim(node.args[0])
    dim = _norm(node.args[1], val(node.args[0]).dim())
    if dim == tag.dim:
        raise _Mixing("selects along the batch dimension")
    return BatchDim(tag.dim - (dim < tag.dim), tag.inner)


@register_batch_rule(aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int, aten.chunk.default)
def _split(node, B):
    tag = batch_dim(node.args[0])
    rank = val(node.args[0]).dim()
    dim = _norm(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0), rank) \
        if node.target != aten.unbind.int else _norm(node.args[1] if len(node.args) > 1 else 0, rank)
    if dim == tag.dim:
        raise _Mixing("splits along the batch dimension")
    outs = node.meta["val"]
    if node.target == aten.unbind.int:
        tag = BatchDim(tag.dim - (dim < tag.dim), tag.inner)
    return tuple(tag for _ in outs)


@register_batch_rule(aten.cat.default)
def _cat(node, B):
    tensors = node.args[0]
    rank = val(node).dim()
    dim = _norm(node.args[1] if len(node.args) > 1 else 0, rank)
    tags = set()
    for t in tensors:
        tag = batch_dim(t)
        if tag is None:
            raise _Mixing("concatenates per-sample data with data shared by all samples")
        tags.add(tag)
    if len(tags) != 1 or dim == next(iter(tags)).dim:
        raise _Mixing("concatenates along the batch dimension")
    return tags.pop()


_REDUCTIONS = {aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default, aten.amax.default,
               aten.amin.default, aten.max.dim, aten.min.dim, aten.argmax.default, aten.argmin.default,
               aten.var.correction, aten.std.correction, aten.logsumexp.default, aten.prod.dim_int,
               aten.any.dim, aten.all.dim, aten.var_mean.correction, aten.max.default, aten.min.default}


@register_batch_rule(*_REDUCTIONS)
def _reduction(node, B):
    tag = batch_dim(node.args[0])
    dims, keepdim = _reduced(node)
    if tag.dim in dims:
        raise _Mixing("reduces over the batch dimension")
    out = BatchDim(tag.dim if keepdim else tag.dim - sum(d < tag.dim for d in dims), tag.inner)
    return (out, out) if isinstance(node.meta["val"], tuple) else out


def _reduced(node: fx.Node) -> tuple[list[int], bool]:
    """The dims a reduction removes, and whether it keeps them as size 1."""
    rank = val(node.args[0]).dim()
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if isinstance(dims, int):
        dims = [dims]
    dims = list(range(rank)) if not dims else [_norm(d, rank) for d in dims]
    keepdim = node.args[2] if len(node.args) > 2 and isinstance(node.args[2], bool) else node.kwargs.get("keepdim", False)
    return dims, keepdim


def _along_dim(dim_arg_index):
    def rule(node, B):
        tag = _single_tag(node)
        rank = val(node.args[0]).dim()
        if _norm(node.args[dim_arg_index], rank) == tag.dim:
            raise _Mixing("normalises or accumulates along the batch dimension")
        return (tag,) * len(node.meta["val"]) if isinstance(node.meta["val"], tuple) else tag
    return rule


register_batch_rule(aten._softmax.default, aten._safe_softmax.default, aten._log_softmax.default,
                    aten.cumsum.default, aten.sort.default)(_along_dim(1))
register_batch_rule(aten._softmax_backward_data.default, aten._log_softmax_backward_data.default,
                    aligned=_broadcast)(_along_dim(2))


@register_batch_rule(aten.tril.default, aten.triu.default)
def _tri(node, B):
    tag = batch_dim(node.args[0])
    if tag.dim >= val(node).dim() - 2:
        raise _Mixing("masks across the batch dimension")
    return tag


def _contraction(labels_a: str, labels_b: str, labels_out: str, a: fx.Node, b: fx.Node) -> BatchDim:
    """Batch tag of a matmul-like op given einsum labels of its operands."""
    placed = set()
    for labels, x in ((labels_a, a), (labels_b, b)):
        tag = batch_dim(x)
        if tag is None:
            continue
        label = labels[tag.dim]
        if label not in labels_out:
            raise _Mixing("contracts over the batch dimension")
        placed.add((label, tag.inner))
    if len(placed) != 1:
        raise _Mixing("multiplies two samples' data together")
    label, inner = placed.pop()
    return BatchDim(labels_out.index(label), inner)


def _contraction_aligned(labels_a: str, labels_b: str, labels_out: str, first: int = 0):
    """An untagged operand meets the batch where it carries the batch dimension's label."""
    def aligned(node, tag, B):
        label = labels_out[tag.dim]
        operands = ((labels_a, node.args[first]), (labels_b, node.args[first + 1]))
        return [(x, labels.index(label), tag.inner) for labels, x in operands
                if batch_dim(x) is None and label in labels]
    return aligned


@register_batch_rule(aten.mm.default, aligned=_contraction_aligned("mk", "kn", "mn"))
def _mm(node, B):
    return _contraction("mk", "kn", "mn", node.args[0], node.args[1])


def _addmm_aligned(node, tag, B):
    bias = [a for a in _broadcast(node, tag, B) if a[0] is node.args[0]]
    return bias + _contraction_aligned("mk", "kn", "mn", first=1)(node, tag, B)


@register_batch_rule(aten.addmm.default, aligned=_addmm_aligned)
def _addmm(node, B):
    if batch_dim(node.args[0]) is not None:
        raise _Mixing("adds a per-sample bias")  # never produced by nn.Linear
    return _contraction("mk", "kn", "mn", node.args[1], node.args[2])


@register_batch_rule(aten.bmm.default, aligned=_contraction_aligned("bmk", "bkn", "bmn"))
def _bmm(node, B):
    return _contraction("bmk", "bkn", "bmn", node.args[0], node.args[1])


@register_batch_rule(aten.embedding.default, aligned=_weights_only)
def _embedding(node, B):
    if batch_dim(node.args[0]) is not None:
        raise _Mixing("looks up rows of a per-sample table")
    return batch_dim(node.args[1])


@register_batch_rule(aten.embedding_dense_backward.default)
def _embedding_backward(node, B):
    raise _Mixing("sums gradient rows of all samples into one table")


def _leading(*positions):
    """The untagged tensors at these argument positions have the samples' rows as dimension 0."""
    def aligned(node, tag, B):
        inner = _single_tag(node).inner
        args = [node.args[i] for i in positions if i < len(node.args)]
        return [(x, 0, inner) for x in args if x in _untagged(node) and val(x).dim() > 0]
    return aligned


@register_batch_rule(aten.nll_loss_forward.default, aten.nll_loss2d_forward.default, aligned=_leading(1))
def _nll_loss_forward(node, B):
    tag = _single_tag(node)
    if node.args[3] != 0 or tag.dim != 0:  # reduction "mean" or "sum" over the batch
        raise _Mixing("reduces the loss over the batch (use reduction='none')")
    return (tag, None)


@register_batch_rule(aten.nll_loss_backward.default, aten.nll_loss2d_backward.default, aligned=_leading(0, 2))
def _nll_loss_backward(node, B):
    return batch_dim(node.args[1])


def _attention_tag(node: fx.Node) -> BatchDim:
    tag = _single_tag(node)
    if tag.dim != 0:
        raise _Mixing("attention over the batch dimension")
    return tag


# Fused attention kernels, by device: which outputs hold per-sample rows (the others are
# RNG state, sequence offsets or sizes). Samples stay apart as long as all batched inputs
# (q, k, v, a per-sample mask) keep the batch in dimension 0.
_ATTENTION_BATCHED_OUTPUTS = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: (0, 1),  # out, lse
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: (0, 1, 2),  # dq, dk, dv
    aten._scaled_dot_product_flash_attention.default: (0, 1, 8),  # out, lse, debug mask
    aten._scaled_dot_product_flash_attention_backward.default: (0, 1, 2),
    aten._scaled_dot_product_efficient_attention.default: (0, 1),
    aten._scaled_dot_product_efficient_attention_backward.default: (0, 1, 2),  # 3: d(attn_bias), below
    aten._scaled_dot_product_cudnn_attention.default: (0, 1, 8),
    aten._scaled_dot_product_cudnn_attention_backward.default: (0, 1, 2),
}
_EFFICIENT_BWD = aten._scaled_dot_product_efficient_attention_backward.default


def _has_rows(value, rows: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == rows  # not an empty debug mask


def _attention_aligned(node, tag, B):
    """A mask or bias broadcasts against (B, heads, L, S) from the right."""
    inner, rank = _single_tag(node).inner, val(node.args[0]).dim()
    return [(x, 0, inner) for x in _untagged(node) if val(x).dim() == rank]


@register_batch_rule(*_ATTENTION_BATCHED_OUTPUTS, aligned=_attention_aligned)
def _fused_attention(node, B):
    tag = _attention_tag(node)
    batched = _ATTENTION_BATCHED_OUTPUTS[node.target]
    tags = [tag if i in batched and _has_rows(v, B * tag.inner) else None for i, v in enumerate(node.meta["val"])]
    if node.target is _EFFICIENT_BWD and len(tags) > 3:
        bias = node.args[4]
        if batch_dim(bias) is not None:
            tags[3] = tag  # a per-sample mask's gradient stays per sample
        elif isinstance(bias, fx.Node) and node.args[10][3]:
            # Its gradient sums over the samples and no per-sample rule covers it. Refused here:
            # raising _Mixing would untag dq/dk/dv too.
            raise UnsupportedModelError(
                f"{node.target} (node {node.name}) in {module_of(node)}: a trainable attention bias shared "
                "by all samples has no per-sample gradient rule; make the bias a constant or per-sample mask")
    return tuple(tags)


@register_batch_rule(aten.native_layer_norm.default, aligned=_weights_only)
def _layer_norm(node, B):
    tag = batch_dim(node.args[0])
    if tag.dim >= val(node.args[0]).dim() - len(node.args[1]):
        raise _Mixing("normalises over the batch dimension")
    return (tag, tag, tag)


@register_batch_rule(aten.native_layer_norm_backward.default, aligned=_weights_only)
def _layer_norm_backward(node, B):
    tag = batch_dim(node.args[1])
    return (tag, None, None)  # weight and bias grads reduce over the batch


@register_batch_rule(aten.convolution.default, aligned=_weights_only)
def _convolution(node, B):
    if batch_dim(node.args[1]) is not None or batch_dim(node.args[0]) != BatchDim(0, 1):
        raise _Mixing("convolves with per-sample weights or over the batch dimension")
    return batch_dim(node.args[0])


@register_batch_rule(aten.convolution_backward.default, aligned=_weights_only)
def _convolution_backward(node, B):
    return (batch_dim(node.args[1]), None, None)  # weight and bias grads reduce over the batch


# Ops that move entries along a dimension. Along the batch dimension they put a record in
# another row (or several rows, or none), so its loss depends on where the sampler put it.
_MOVES_ROWS = "it moves rows along the batch dimension, so row i holds the record of another row"


@register_batch_rule(aten.index_select.default, aligned=_weights_only)
def _index_select(node, B):
    tag = batch_dim(node.args[0])
    if tag is None or batch_dim(node.args[2]) is not None:
        raise _Mixing("indexes along the batch dimension")
    if _norm(node.args[1], val(node).dim()) == tag.dim:
        raise _RowPosition(_MOVES_ROWS)
    return tag


@register_batch_rule(aten.flip.default, aten.roll.default)
def _flip_roll(node, B):
    tag = batch_dim(node.args[0])
    rank = val(node).dim()
    if node.target == aten.flip.default:
        dims = node.args[1]
    else:
        dims = node.args[2] if len(node.args) > 2 else node.kwargs.get("dims", [])
    if not dims or tag.dim in [_norm(d, rank) for d in dims]:  # roll without dims rolls the flattened tensor
        raise _RowPosition(_MOVES_ROWS)
    return tag


@register_batch_rule(aten.index.Tensor, aten.gather.default)
def _index_rows(node, B):
    """Refused along the batch dimension; along other dims there are no rules for their backward."""
    tag = batch_dim(node.args[0])
    if tag is not None:
        if node.target == aten.gather.default:
            moves = _norm(node.args[1], val(node).dim()) == tag.dim
        else:
            moves = tag.dim < len(node.args[1]) and node.args[1][tag.dim] is not None
        if moves:
            raise _RowPosition(_MOVES_ROWS)
    _no_rule(node)


@register_batch_rule(aten.take.default)
def _take(node, B):
    if batch_dim(node.args[0]) is not None:
        raise _RowPosition("it reads the per-sample tensor as one flat list, so an output entry comes from "
                           "whichever row the index names")
    _no_rule(node)


# ---------------------------------------------------------------------------------------
# Variation of untagged tensors: node -> {dim: Variation}. An op without a rule differs along
# every dimension (factories such as arange, eye, randperm, rand; parameters; unknown ops).

_VARIATION: dict = {}


def _variation_rule(*ops):
    def deco(fn):
        for op in ops:
            _VARIATION[op] = fn
        return fn
    return deco


def _variation(node: fx.Node) -> dict[int, Variation]:
    rule = _VARIATION.get(node.target)
    if rule is None and _is_pointwise(node.target):
        rule = _broadcast_variation
    return _everywhere(node) if rule is None else rule(node)


def _join(a: Variation | None, b: Variation) -> Variation:
    # Both periods divide the size, so their lcm does too.
    return b if a is None else Variation(math.lcm(a.period, b.period), a.origin)


@_variation_rule(aten.full.default, aten.ones.default, aten.zeros.default, aten.empty.memory_format,
                 aten.empty_strided.default, aten.scalar_tensor.default, aten.fill.Tensor, *_CONSTANT_LIKE)
def _uniform(node):
    return {}


def _broadcast_variation(node):
    shape = val(node).shape
    out: dict[int, Variation] = {}
    for x in _flat_inputs(node):
        for d, v in varies(x).items():
            pos = len(shape) - val(x).dim() + d
            out[pos] = _join(out.get(pos), v)
    return out


@_variation_rule(aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.unsqueeze.default,
                 aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)
def _reshape_variation(node):
    """A reshape maps runs of input dims onto runs of output dims with the same product.

    Within a run, the entries depend on the flat index modulo ``period`` (the first varying
    input dim's period times the sizes after it); an output dim whose stride is a multiple
    of it is uniform, e.g. the B part of (1, T) expanded to (B, T) and viewed as (B*T,).
    """
    a, b = list(val(node.args[0]).shape), list(val(node).shape)
    if 0 in a or math.prod(a) != math.prod(b):
        return _everywhere(node)
    vin, out = varies(node.args[0]), {}
    for run_a, run_b in _runs(a, b):
        first = next((k for k, d in enumerate(run_a) if d in vin), None)
        if first is None:
            continue
        v = vin[run_a[first]]
        period = v.period * math.prod(a[d] for d in run_a[first + 1:])
        stride = 1
        for e in reversed(run_b):
            if b[e] > 1 and stride % period:
                q = period // stride if period % stride == 0 else b[e]
                out[e] = Variation(q if b[e] % q == 0 else b[e], v.origin)
            stride *= b[e]
    return out


def _runs(a: list[int], b: list[int]) -> list[tuple[list[int], list[int]]]:
    """Pair runs of dims of shapes a and b (no zeros, equal products) whose sizes multiply alike."""
    runs, i, j = [], 0, 0
    while i < len(a) or j < len(b):
        run_a, run_b, pa, pb = [], [], 1, 1
        if i < len(a):
            run_a, pa, i = [i], a[i], i + 1
        if j < len(b):
            run_b, pb, j = [j], b[j], j + 1
        while pa != pb:
            if pa < pb:
                run_a.append(i)
                pa, i = pa * a[i], i + 1
            else:
                run_b.append(j)
                pb, j = pb * b[j], j + 1
        runs.append((run_a, run_b))
    return runs


@_variation_rule(aten.expand.default, aten.repeat.default)
def _expand_variation(node):
    # Expanded dims had size 1 and new dims are in front: neither varies. Tiling keeps the
    # period, which divides the tile.
    shift = val(node).dim() - val(node.args[0]).dim()
    return {d + shift: v for d, v in varies(node.args[0]).items()}


@_variation_rule(aten.t.default, aten.transpose.int, aten.permute.default)
def _permute_variation(node):
    vin = varies(node.args[0])
    return {o: vin[i] for o, i in enumerate(_perm(node)) if i in vin}


@_variation_rule(aten.slice.Tensor)
def _slice_variation(node):
    out = dict(varies(node.args[0]))
    dim = _norm(node.args[1] if len(node.args) > 1 else 0, val(node).dim())
    n = val(node).shape[dim]
    if dim in out:
        out[dim] = Variation(n, out[dim].origin)
        if n == 1:
            del out[dim]
    return out


@_variation_rule(aten.select.int)
def _select_variation(node):
    dim = _norm(node.args[1], val(node.args[0]).dim())
    return {d - (d > dim): v for d, v in varies(node.args[0]).items() if d != dim}


@_variation_rule(aten.cat.default)
def _cat_variation(node):
    tensors = [t for t in node.args[0] if val(t).dim() == val(node).dim()]  # cat skips legacy (0,) inputs
    dim = _norm(node.args[1] if len(node.args) > 1 else 0, val(node).dim())
    out: dict[int, Variation] = {}
    for t in tensors:
        for d, v in varies(t).items():
            out[d] = _join(out.get(d), v) if d != dim else out.get(d, v)
    n = val(node).shape[dim]
    if n > 1:  # the pieces may hold different values even where each is uniform
        out[dim] = Variation(n, out[dim].origin if dim in out else _describe(node))
    return out


@_variation_rule(*_REDUCTIONS)
def _reduction_variation(node):
    dims, keepdim = _reduced(node)
    return {d if keepdim else d - sum(e < d for e in dims): v
            for d, v in varies(node.args[0]).items() if d not in dims}


@_variation_rule(aten._softmax.default, aten._safe_softmax.default, aten._log_softmax.default, aten.flip.default)
def _same_variation(node):
    return dict(varies(node.args[0]))


@_variation_rule(aten.roll.default)
def _roll_variation(node):
    # A roll keeps each dim's period; without dims it rolls the flattened tensor.
    return _same_variation(node) if len(node.args) > 2 and node.args[2] else _everywhere(node)


@_variation_rule(aten.cumsum.default, aten.cumprod.default)
def _accumulate_variation(node):
    """Running sums differ along their dim even over equal entries: ones(B).cumsum(0) is 1..B."""
    out = dict(varies(node.args[0]))
    dim = _norm(node.args[1], val(node).dim())
    n = val(node).shape[dim]
    if n > 1:
        out[dim] = Variation(n, out[dim].origin if dim in out else _describe(node))
    return out


@_variation_rule(aten.tril.default, aten.triu.default)
def _tri_variation(node):
    out, shape = dict(varies(node.args[0])), val(node).shape
    for d in (len(shape) - 2, len(shape) - 1):
        if shape[d] > 1:
            out[d] = Variation(shape[d], out[d].origin if d in out else _describe(node))
    return out


@_variation_rule(aten.index.Tensor)
def _index_variation(node):
    """src[..., i1, i2, ...]: a broadcast index dim varies where an index varies and picks along a
    src dim that varies (HF's mask builder indexes a uniform (B, T) table with arange(B))."""
    src, indices = node.args[0], list(node.args[1])
    picked = [k for k, ix in enumerate(indices) if ix is not None]
    if any(val(indices[k]).dtype in (torch.bool, torch.uint8) for k in picked):
        return _everywhere(node)  # masks select a data-dependent number of entries
    vin, shape = varies(src), val(node).shape
    width = max(val(indices[k]).dim() for k in picked)
    adjacent = picked == list(range(picked[0], picked[-1] + 1))
    start = picked[0] if adjacent else 0
    out: dict[int, Variation] = {}
    for k in picked:
        if k in vin:
            for d, v in varies(indices[k]).items():
                pos = start + width - val(indices[k]).dim() + d
                out[pos] = Variation(shape[pos], v.origin)
    rest = [d for d in range(val(src).dim()) if d not in picked]
    for n, d in enumerate(rest):
        if d in vin:
            pos = d if adjacent and d < start else (d - len(picked) + width if adjacent else width + n)
            out[pos] = vin[d]
    return out


@_variation_rule(aten.index_select.default)
def _index_select_variation(node):
    src, dim, index = node.args[:3]
    out = dict(varies(src))
    dim = _norm(dim, val(node).dim())
    picked = out.pop(dim, None)
    if picked is not None and 0 in varies(index):
        out[dim] = Variation(val(node).shape[dim], picked.origin)
    return out


@_variation_rule(aten.embedding.default)
def _embedding_variation(node):
    table, index = node.args[:2]
    vt, shape = varies(table), val(node).shape
    out = {d: Variation(shape[d], v.origin) for d, v in varies(index).items() if 0 in vt}
    if 1 in vt:
        out[len(shape) - 1] = vt[1]
    return out


def _contraction_variation(labels_a: str, labels_b: str, labels_out: str, first: int = 0):
    def variation(node):
        out: dict[int, Variation] = {}
        for labels, x in ((labels_a, node.args[first]), (labels_b, node.args[first + 1])):
            for d, v in varies(x).items():
                if labels[d] in labels_out:
                    pos = labels_out.index(labels[d])
                    out[pos] = _join(out.get(pos), v)
        return out
    return variation


_variation_rule(aten.mm.default)(_contraction_variation("mk", "kn", "mn"))
_variation_rule(aten.bmm.default)(_contraction_variation("bmk", "bkn", "bmn"))


@_variation_rule(aten.addmm.default)
def _addmm_variation(node):
    out = _contraction_variation("mk", "kn", "mn", first=1)(node)
    bias = varies(node.args[0])
    for d, v in bias.items():
        pos = 2 - val(node.args[0]).dim() + d
        out[pos] = _join(out.get(pos), v)
    return out
