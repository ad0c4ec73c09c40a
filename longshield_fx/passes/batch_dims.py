"""The ``batch_dims`` pass: tag every tensor's sample dimension; reject ops that mix samples.

Rewrites: nothing. It sets ``node.meta["batch_dim"]`` on every node to a ``BatchDim``
(which dimension holds samples, and how many rows each sample owns in it when views
folded the batch with other dimensions, e.g. B*T), to ``None`` for tensors that do not
depend on any one sample (parameters, constants, position ids), or to a tuple of those for
ops with several outputs.

Assumes: every user input has the batch as dimension 0, of size ``ctx.batch_size``; the
loss cotangent is (B,). Every op that touches a batched tensor has a rule below, matched
on aten ops (never on module names).

Guarantees: in the forward, no op combines rows of different samples; otherwise
``UnsupportedModelError`` names the op and the module it came from. In the backward, a
reduction over the batch dimension is allowed and tagged ``None``: those are the
weight-gradient reductions the ``per_sample`` pass rewrites.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..errors import UnsupportedModelError
from . import PassContext
from ._graph import is_backward, module_of, val

aten = torch.ops.aten


@dataclass(frozen=True)
class BatchDim:
    """Dimension ``dim`` has size B*inner; sample i owns rows [i*inner, (i+1)*inner)."""

    dim: int
    inner: int = 1


def batch_dim(node) -> BatchDim | None:
    return node.meta.get("batch_dim") if isinstance(node, fx.Node) else None


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
    return gm


class _Mixing(Exception):
    pass


def _tag(node: fx.Node, B: int):
    if node.target is operator.getitem:
        parent_tag = batch_dim(node.args[0])
        return parent_tag[node.args[1]] if isinstance(parent_tag, tuple) else parent_tag
    batched = [a for a in _flat_inputs(node) if batch_dim(a) is not None]
    if not batched:
        return None
    rule = _rule_for(node.target)
    if rule is None:
        raise UnsupportedModelError(
            f"op {node.target} (node {node.name}) in {module_of(node)} touches per-sample data and has no "
            "batch rule, so longshield_fx cannot prove it keeps samples apart. Way out: write the layer "
            "with standard ops, or register a rule with longshield_fx.passes.batch_dims.register_batch_rule.")
    try:
        return rule(node, B)
    except _Mixing as e:
        if is_backward(node):
            return None  # a weight-gradient reduction; the per_sample pass rewrites it
        raise UnsupportedModelError(
            f"op {node.target} (node {node.name}) in {module_of(node)} mixes samples: {e}. "
            "DP-SGD needs each sample's loss to depend on that sample only; remove the op "
            "(e.g. replace BatchNorm with LayerNorm/GroupNorm, compute pairwise losses within a sample).")


def _flat_inputs(node: fx.Node) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), found.append)
    return found


# ---------------------------------------------------------------------------------------
# Rules: (node, B) -> BatchDim | None | tuple; raise _Mixing when samples are combined.

_RULES: dict = {}


def register_batch_rule(*ops):
    """Register ``fn(node, B) -> BatchDim | None | tuple`` for aten/custom ops."""

    def deco(fn):
        for op in ops:
            _RULES[op] = fn
        return fn

    return deco


_POINTWISE_EXTRA = {aten._to_copy.default, aten.detach.default, aten.alias.default,
                    aten.copy.default, aten.lift_fresh_copy.default, aten.contiguous.default}


@register_batch_rule(aten.zeros_like.default, aten.ones_like.default, aten.full_like.default,
                     aten.empty_like.default, aten.fill.Scalar, aten.new_zeros.default,
                     aten.new_ones.default, aten.new_empty.default, aten.new_full.default)
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
    if op in _POINTWISE_EXTRA or (isinstance(op, torch._ops.OpOverload) and torch.Tag.pointwise in op.tags):
        return _pointwise
    return None


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
    rank = val(node).dim()
    if node.target == aten.t.default:
        perm = list(range(rank))[::-1]
    elif node.target == aten.transpose.int:
        perm = list(range(rank))
        a, b = _norm(node.args[1], rank), _norm(node.args[2], rank)
        perm[a], perm[b] = perm[b], perm[a]
    else:
        perm = [_norm(d, rank) for d in node.args[1]]
    return BatchDim(perm.index(tag.dim), tag.inner)


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
    rank = val(node.args[0]).dim()
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if isinstance(dims, int):
        dims = [dims]
    dims = list(range(rank)) if not dims else [_norm(d, rank) for d in dims]
    keepdim = node.args[2] if len(node.args) > 2 and isinstance(node.args[2], bool) else node.kwargs.get("keepdim", False)
    if tag.dim in dims:
        raise _Mixing("reduces over the batch dimension")
    out = BatchDim(tag.dim if keepdim else tag.dim - sum(d < tag.dim for d in dims), tag.inner)
    return (out, out) if isinstance(node.meta["val"], tuple) else out


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
register_batch_rule(aten._softmax_backward_data.default, aten._log_softmax_backward_data.default)(_along_dim(2))


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


@register_batch_rule(aten.mm.default)
def _mm(node, B):
    return _contraction("mk", "kn", "mn", node.args[0], node.args[1])


@register_batch_rule(aten.addmm.default)
def _addmm(node, B):
    if batch_dim(node.args[0]) is not None:
        raise _Mixing("adds a per-sample bias")  # never produced by nn.Linear
    return _contraction("mk", "kn", "mn", node.args[1], node.args[2])


@register_batch_rule(aten.bmm.default)
def _bmm(node, B):
    return _contraction("bmk", "bkn", "bmn", node.args[0], node.args[1])


@register_batch_rule(aten.embedding.default)
def _embedding(node, B):
    if batch_dim(node.args[0]) is not None:
        raise _Mixing("looks up rows of a per-sample table")
    return batch_dim(node.args[1])


@register_batch_rule(aten.embedding_dense_backward.default)
def _embedding_backward(node, B):
    raise _Mixing("sums gradient rows of all samples into one table")


@register_batch_rule(aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)
def _nll_loss_forward(node, B):
    tag = _single_tag(node)
    if node.args[3] != 0 or tag.dim != 0:  # reduction "mean" or "sum" over the batch
        raise _Mixing("reduces the loss over the batch (use reduction='none')")
    return (tag, None)


@register_batch_rule(aten.nll_loss_backward.default, aten.nll_loss2d_backward.default)
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


@register_batch_rule(*_ATTENTION_BATCHED_OUTPUTS)
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


@register_batch_rule(aten.native_layer_norm.default)
def _layer_norm(node, B):
    tag = batch_dim(node.args[0])
    if tag.dim >= val(node.args[0]).dim() - len(node.args[1]):
        raise _Mixing("normalises over the batch dimension")
    return (tag, tag, tag)


@register_batch_rule(aten.native_layer_norm_backward.default)
def _layer_norm_backward(node, B):
    tag = batch_dim(node.args[1])
    return (tag, None, None)  # weight and bias grads reduce over the batch


@register_batch_rule(aten.convolution.default)
def _convolution(node, B):
    if batch_dim(node.args[1]) is not None or batch_dim(node.args[0]) != BatchDim(0, 1):
        raise _Mixing("convolves with per-sample weights or over the batch dimension")
    return batch_dim(node.args[0])


@register_batch_rule(aten.convolution_backward.default)
def _convolution_backward(node, B):
    return (batch_dim(node.args[1]), None, None)  # weight and bias grads reduce over the batch


@register_batch_rule(aten.index_select.default)
def _index_select(node, B):
    tag = batch_dim(node.args[0])
    if tag is None or batch_dim(node.args[2]) is not None or _norm(node.args[1], val(node).dim()) == tag.dim:
        raise _Mixing("indexes along the batch dimension")
    return tag
