"""Batch rules, one per aten op: which dimension of an op's output holds the samples.

A rule ``fn(node, B) -> BatchDim | None | tuple`` reads its inputs' tags (``batch_dim``) and
returns the output's; it raises ``Mixing`` when the op combines rows of different samples and
``RowPosition`` when it moves rows along the batch dimension. ``aligned=`` says which
dimensions of the op's untagged inputs line up with the batch (they must not vary there; see
``row_variation``). Registered when ``longshield_fx.passes`` is imported.
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx

from ..errors import UnsupportedModelError
from ._graph import (ATTENTION_BATCHED_OUTPUTS, CONSTANT_LIKE, REDUCTIONS, arg_of, module_of, norm_dim, permutation,
                     reduced_dims, val)
from .batch_dims import (_BATCH_NORM, BatchDim, Mixing, RowPosition, batch_dim, broadcast_aligned, pointwise_rule,
                         register_batch_rule, single_tag, untagged, weights_only)

aten = torch.ops.aten


@register_batch_rule(*CONSTANT_LIKE)
def _constant(node, B):
    return None  # values do not depend on any sample, only the shape does


@register_batch_rule(aten.view.default, aten._unsafe_view.default, aten.reshape.default, outer=True)
def _view(node, B):
    """In row-major order the batch index steps by ``stride`` elements over B values. The
    output dim whose elements step by a divisor of ``stride`` and span a multiple of
    ``stride * B`` holds it: each of its indices splits as (outer, B, inner), the dims before
    and after it do not depend on the sample, so the tag says exactly which entries each
    sample owns. A view that splits the batch index over two dims has no such dim."""
    tag = batch_dim(node.args[0])
    in_shape, out_shape = list(val(node.args[0]).shape), list(val(node).shape)
    stride = tag.inner * math.prod(in_shape[tag.dim + 1:])
    if stride == 0:  # no entries: the first dim whose rows split into B samples' holds them (vacuously)
        for d, size in enumerate(out_shape):
            if size and size % B == 0:
                return BatchDim(d, size // B)
        raise Mixing(f"the view {in_shape} -> {out_shape} of an empty tensor keeps no dimension of the batch's size")
    found = []
    for d, size in enumerate(out_shape):
        step = math.prod(out_shape[d + 1:])
        if step and stride % step == 0 and (size * step) % (stride * B) == 0:
            found.append(BatchDim(d, stride // step, size * step // (stride * B)))
    if not found:
        raise Mixing(f"the view {in_shape} -> {out_shape} splits the batch index over two dimensions")
    # For B > 1 exactly one dim qualifies. For B == 1 several may, all right for the one sample;
    # prefer untiled and leftmost, keeping the batch leading as rules such as attention expect
    # (where that guess leads to a refusal, ``batch_dims`` asks the B = 2 capture).
    return min(found, key=lambda t: (t.outer != 1, t.dim))


@register_batch_rule(aten.expand.default, outer=True)
def _expand(node, B):
    tag = batch_dim(node.args[0])
    return tag.at(tag.dim + val(node).dim() - val(node.args[0]).dim())


@register_batch_rule(aten.unsqueeze.default, outer=True)
def _unsqueeze(node, B):
    tag = batch_dim(node.args[0])
    dim = norm_dim(node.args[1], val(node).dim())
    return tag.at(tag.dim + (dim <= tag.dim))


@register_batch_rule(aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, outer=True)
def _squeeze(node, B):
    tag = batch_dim(node.args[0])
    in_shape = val(node.args[0]).shape
    if node.target == aten.squeeze.default:
        dims = [i for i, s in enumerate(in_shape) if s == 1]
    else:
        dims = node.args[1] if isinstance(node.args[1], (list, tuple)) else [node.args[1]]
        dims = [norm_dim(d, len(in_shape)) for d in dims if in_shape[norm_dim(d, len(in_shape))] == 1]
    if tag.dim in dims:
        dims.remove(tag.dim)
        if val(node).dim() == len(in_shape) - len(dims) - 1:
            raise Mixing("squeezes away the batch dimension")
    return tag.at(tag.dim - sum(d < tag.dim for d in dims))


@register_batch_rule(aten.t.default, aten.transpose.int, aten.permute.default, outer=True)
def _permute(node, B):
    tag = batch_dim(node.args[0])
    return tag.at(permutation(node).index(tag.dim))


@register_batch_rule(aten.slice.Tensor, outer=True)
def _slice(node, B):
    tag = batch_dim(node.args[0])
    shape = val(node.args[0]).shape
    dim = norm_dim(node.args[1] if len(node.args) > 1 else 0, len(shape))
    if dim == tag.dim and val(node).shape[dim] != shape[dim]:
        raise Mixing("slices across the batch dimension")
    return tag


@register_batch_rule(aten.slice_backward.default)
def _slice_backward(node, B):
    tag = batch_dim(node.args[0])
    shape = val(node).shape
    if norm_dim(node.args[2], len(shape)) == tag.dim and val(node.args[0]).shape[tag.dim] != shape[tag.dim]:
        raise Mixing("pads across the batch dimension")
    return tag


@register_batch_rule(aten.select_backward.default)
def _select_backward(node, B):
    tag = batch_dim(node.args[0])
    dim = norm_dim(node.args[2], val(node).dim())
    return BatchDim(tag.dim + (dim <= tag.dim), tag.inner)


@register_batch_rule(aten.select.int)
def _select(node, B):
    tag = batch_dim(node.args[0])
    dim = norm_dim(node.args[1], val(node.args[0]).dim())
    if dim == tag.dim:
        raise Mixing("selects along the batch dimension")
    return BatchDim(tag.dim - (dim < tag.dim), tag.inner)


@register_batch_rule(aten.unfold.default, aten.unfold_backward.default)
def _unfold(node, B):
    """Windows along one dim (n-grams of a row: BLT's byte hashes): a window holds entries of one
    sample unless the windows run along the batch dim. ``unfold`` appends the window dim last and
    ``unfold_backward`` drops it again, so the batch dim keeps its index either way."""
    tag = batch_dim(node.args[0])
    rank = val(node.args[0]).dim() if node.target == aten.unfold.default else val(node).dim()
    dim = norm_dim(node.args[1] if node.target == aten.unfold.default else node.args[2], rank)
    if dim == tag.dim:
        raise Mixing("takes windows along the batch dimension")
    return tag


@register_batch_rule(aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int, aten.chunk.default)
def _split(node, B):
    tag = batch_dim(node.args[0])
    rank = val(node.args[0]).dim()
    dim = norm_dim(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0), rank) \
        if node.target != aten.unbind.int else norm_dim(node.args[1] if len(node.args) > 1 else 0, rank)
    if dim == tag.dim:
        raise Mixing("splits along the batch dimension")
    outs = node.meta["val"]
    if node.target == aten.unbind.int:
        tag = BatchDim(tag.dim - (dim < tag.dim), tag.inner)
    return tuple(tag for _ in outs)


def _cat_aligned(node, tag, B):
    """Every input has the output's rank; each meets the batch in the batch dimension only."""
    return [(t, tag.dim, tag.inner) for t in node.args[0]
            if batch_dim(t) is None and val(t) is not None and val(t).dim() == val(node).dim()]


@register_batch_rule(aten.cat.default, aligned=_cat_aligned)
def _cat(node, B):
    tensors = node.args[0]
    rank = val(node).dim()
    dim = norm_dim(node.args[1] if len(node.args) > 1 else 0, rank)
    tags = set()
    for t in tensors:
        tag = batch_dim(t)
        if tag is not None:
            tags.add(tag)
    if len(tags) != 1 or dim == next(iter(tags)).dim:
        raise Mixing("concatenates along the batch dimension")
    tag = tags.pop()
    for t in tensors:
        if batch_dim(t) is None and tuple(val(t).shape) != (0,):  # cat skips 1-D empties (an empty KV cache)
            if val(t).dim() != rank or val(t).shape[tag.dim] != val(node).shape[tag.dim]:
                raise Mixing("concatenates per-sample data with data shared by all samples")
    # Shared rows expanded over the batch (attention sinks, memory tokens) join every sample
    # alike; that they do not vary along the batch is checked like any untagged input.
    return tag


@register_batch_rule(aten.repeat.default, outer=True)
def _repeat(node, B):
    """Tiling the batch dim r times copies its (outer, B, inner) layout into r blocks: each
    copy of a row still sits in its sample's place of a block (an MoE's tokens per expert)."""
    tag = batch_dim(node.args[0])
    sizes = node.args[1]
    dim = tag.dim + len(sizes) - val(node.args[0]).dim()
    return BatchDim(dim, tag.inner, tag.outer * sizes[dim])


@register_batch_rule(*REDUCTIONS, outer=True)
def _reduction(node, B):
    tag = batch_dim(node.args[0])
    dims, keepdim = reduced_dims(node)
    if tag.dim in dims:
        raise Mixing("reduces over the batch dimension")
    out = tag.at(tag.dim if keepdim else tag.dim - sum(d < tag.dim for d in dims))
    return (out, out) if isinstance(node.meta["val"], tuple) else out


def _along_dim(node, B):
    tag = single_tag(node)
    if norm_dim(arg_of(node, "dim"), val(node.args[0]).dim()) == tag.dim:
        raise Mixing("normalises or accumulates along the batch dimension")
    return (tag,) * len(node.meta["val"]) if isinstance(node.meta["val"], tuple) else tag


register_batch_rule(aten._softmax.default, aten._safe_softmax.default, aten._log_softmax.default,
                    aten.cumsum.default, aten.sort.default)(_along_dim)
register_batch_rule(aten._softmax_backward_data.default, aten._log_softmax_backward_data.default,
                    aligned=broadcast_aligned)(_along_dim)


@register_batch_rule(aten.tril.default, aten.triu.default)
def _tri(node, B):
    tag = batch_dim(node.args[0])
    if tag.dim >= val(node).dim() - 2:
        raise Mixing("masks across the batch dimension")
    return tag


def _contraction(labels_a: str, labels_b: str, labels_out: str, a: fx.Node, b: fx.Node) -> BatchDim:
    """Batch tag of a matmul-like op given einsum labels of its operands. Each output entry
    along a kept label comes from the same entry of the operands, so rows tiled in blocks
    stay as they were (``outer``)."""
    placed = set()
    for labels, x in ((labels_a, a), (labels_b, b)):
        tag = batch_dim(x)
        if tag is None:
            continue
        label = labels[tag.dim]
        if label not in labels_out:
            raise Mixing("contracts over the batch dimension")
        placed.add((label, tag.inner, tag.outer))
    if len(placed) != 1:
        raise Mixing("multiplies two samples' data together")
    label, inner, outer = placed.pop()
    return BatchDim(labels_out.index(label), inner, outer)


def _contraction_aligned(labels_a: str, labels_b: str, labels_out: str, first: int = 0):
    """An untagged operand meets the batch where it carries the batch dimension's label."""
    def aligned(node, tag, B):
        label = labels_out[tag.dim]
        operands = ((labels_a, node.args[first]), (labels_b, node.args[first + 1]))
        return [_block_rows(x, labels.index(label), tag, B) for labels, x in operands
                if batch_dim(x) is None and label in labels]
    return aligned


def _block_rows(x: fx.Node, dim: int, tag: BatchDim, B: int) -> tuple:
    """``(tensor, dim, inner)`` to check for row variation where untagged ``x`` meets the batch
    at ``dim``. Where the rows are tiled in blocks (a per-head weight broadcast over the batch
    and folded with it into bmm's group dim: Zamba's per-head Mamba projections), ``x`` may
    differ from block to block, not from sample to sample within one: when ``x`` is a view of
    (blocks, rows), the rows dim is checked. Otherwise ``x`` itself, which then must not differ
    along ``dim`` at all but with a period dividing ``inner``. Looks through transposes (the
    backward's ``w.transpose(-1, -2)``)."""
    view = x
    while tag.outer != 1 and view.target in (aten.t.default, aten.transpose.int, aten.permute.default):
        view, dim = view.args[0], permutation(view)[dim]
    if tag.outer != 1 and view.target in (aten.view.default, aten._unsafe_view.default, aten.reshape.default):
        shape = list(val(view).shape)
        if list(val(view.args[0]).shape) == shape[:dim] + [tag.outer, B * tag.inner] + shape[dim + 1:]:
            return view.args[0], dim + 1, tag.inner
    return x, dim, tag.inner


@register_batch_rule(aten.mm.default, aligned=_contraction_aligned("mk", "kn", "mn"), outer=True)
def _mm(node, B):
    return _contraction("mk", "kn", "mn", node.args[0], node.args[1])


def _addmm_aligned(node, tag, B):
    bias = [a for a in broadcast_aligned(node, tag, B) if a[0] is node.args[0]]
    return bias + _contraction_aligned("mk", "kn", "mn", first=1)(node, tag, B)


@register_batch_rule(aten.addmm.default, aligned=_addmm_aligned, outer=True)
def _addmm(node, B):
    if batch_dim(node.args[0]) is not None:
        raise Mixing("adds a per-sample bias")  # never produced by nn.Linear
    return _contraction("mk", "kn", "mn", node.args[1], node.args[2])


@register_batch_rule(aten.bmm.default, aligned=_contraction_aligned("bmk", "bkn", "bmn"), outer=True)
def _bmm(node, B):
    return _contraction("bmk", "bkn", "bmn", node.args[0], node.args[1])


def _baddbmm_aligned(node, tag, B):
    bias = [a for a in broadcast_aligned(node, tag, B) if a[0] is node.args[0]]
    return bias + _contraction_aligned("bmk", "bkn", "bmn", first=1)(node, tag, B)


@register_batch_rule(aten.baddbmm.default, aligned=_baddbmm_aligned)
def _baddbmm(node, B):
    """beta * self + alpha * (b1 @ b2): a batched matmul plus a bias (Bloom's ALiBi)."""
    tag = _contraction("bmk", "bkn", "bmn", node.args[1], node.args[2])
    bias = batch_dim(node.args[0])
    if bias is not None and BatchDim(val(node).dim() - val(node.args[0]).dim() + bias.dim, bias.inner) != tag:
        raise Mixing("adds a bias holding samples in another dimension")
    return tag


@register_batch_rule(aten.embedding.default, aligned=weights_only)
def _embedding(node, B):
    if batch_dim(node.args[0]) is not None:
        raise Mixing("looks up rows of a per-sample table")
    return batch_dim(node.args[1])


@register_batch_rule(aten.embedding_dense_backward.default)
def _embedding_backward(node, B):
    raise Mixing("sums gradient rows of all samples into one table")


def _leading(*positions):
    """The untagged tensors at these argument positions have the samples' rows as dimension 0."""
    def aligned(node, tag, B):
        inner = single_tag(node).inner
        args = [node.args[i] for i in positions if i < len(node.args)]
        return [(x, 0, inner) for x in args if x in untagged(node) and val(x).dim() > 0]
    return aligned


@register_batch_rule(aten.nll_loss_forward.default, aten.nll_loss2d_forward.default, aligned=_leading(1))
def _nll_loss_forward(node, B):
    tag = single_tag(node)
    if node.args[3] != 0 or tag.dim != 0:  # reduction "mean" or "sum" over the batch
        raise Mixing("reduces the loss over the batch (use reduction='none')")
    return (tag, None)


@register_batch_rule(aten.nll_loss_backward.default, aten.nll_loss2d_backward.default, aligned=_leading(0, 2))
def _nll_loss_backward(node, B):
    return batch_dim(node.args[1])


def _attention_tag(node: fx.Node) -> BatchDim:
    tag = single_tag(node)
    if tag.dim != 0:
        raise Mixing("attention over the batch dimension")
    return tag


_EFFICIENT_BWD = aten._scaled_dot_product_efficient_attention_backward.default


def _has_rows(value, rows: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == rows  # not an empty debug mask


def _attention_aligned(node, tag, B):
    """A mask or bias broadcasts against (B, heads, L, S) from the right."""
    inner, rank = single_tag(node).inner, val(node.args[0]).dim()
    return [(x, 0, inner) for x in untagged(node) if val(x).dim() == rank]


@register_batch_rule(*ATTENTION_BATCHED_OUTPUTS, aligned=_attention_aligned)
def _fused_attention(node, B):
    tag = _attention_tag(node)
    batched = ATTENTION_BATCHED_OUTPUTS[node.target]
    tags = [tag if i in batched and _has_rows(v, B * tag.inner) else None for i, v in enumerate(node.meta["val"])]
    if node.target is _EFFICIENT_BWD and len(tags) > 3:
        bias = node.args[4]
        if batch_dim(bias) is not None:
            tags[3] = tag  # a per-sample mask's gradient stays per sample
        elif isinstance(bias, fx.Node) and node.args[10][3]:
            # Its gradient sums over the samples and no per-sample rule covers it. Refused here:
            # raising Mixing would untag dq/dk/dv too.
            raise UnsupportedModelError(
                f"{node.target} (node {node.name}) in {module_of(node)}: a trainable attention bias shared "
                "by all samples has no per-sample gradient rule; make the bias a constant or per-sample mask")
    return tuple(tags)


@register_batch_rule(aten.native_layer_norm.default, aligned=weights_only)
def _layer_norm(node, B):
    tag = batch_dim(node.args[0])
    if tag.dim >= val(node.args[0]).dim() - len(node.args[1]):
        raise Mixing("normalises over the batch dimension")
    return (tag, tag, tag)


@register_batch_rule(aten._native_batch_norm_legit_no_training.default, aligned=weights_only)
def _batch_norm_eval(node, B):
    """Batch norm in eval mode normalises each element with the running statistics: per channel
    (dim 1), never over the batch; training-mode batch norm is refused (``batch_dims._MIXING``)."""
    tag = batch_dim(node.args[0])
    if tag.dim == 1:
        raise Mixing("the batch is folded into batch norm's channel dimension")
    return (tag, None, None)


@register_batch_rule(aten.native_group_norm.default, aligned=weights_only)
def _group_norm(node, B):
    """Group norm normalises each row (dim 0) over its own channels and positions."""
    tag = batch_dim(node.args[0])
    if tag.dim != 0:
        raise Mixing("group norm normalises over the dimension that holds the batch")
    return (tag, tag, tag)  # output, and the (N, groups) mean and rstd


@register_batch_rule(aten.native_group_norm_backward.default, aligned=weights_only)
def _group_norm_backward(node, B):
    return (batch_dim(node.args[0]), None, None)  # weight and bias grads reduce over the batch


def _own_statistics(node, B) -> BatchDim | None:
    """For batch norm with statistics from its input (training mode): the tag of its per-channel
    values (the (C,) statistics, weight and bias gradients) when they are per sample, else None.
    They are when the channel dim (1) holds the batch: ``instance_norm`` folds (B, C) into B*C
    channels."""
    x = node.args[0] if node.target != aten.native_batch_norm_backward.default else node.args[1]
    tag = batch_dim(x)
    if tag is not None and tag.dim == 1 and tag.outer == 1:
        return BatchDim(0, tag.inner)
    return None


def _own_statistics_aligned(node, tag, B):
    """The weight and bias (B*C channels: ``instance_norm`` repeats them per sample) meet the batch
    along their only dim; each sample must see the same entries."""
    channels = _own_statistics(node, B)
    weights = node.args[1:3] if node.target != aten.native_batch_norm_backward.default else node.args[2:3]
    return [(w, 0, channels.inner) for w in weights if isinstance(w, fx.Node) and batch_dim(w) is None]


@register_batch_rule(aten._native_batch_norm_legit.no_stats, aligned=_own_statistics_aligned)
def _batch_norm_own_statistics(node, B):
    """Training-mode batch norm without running statistics (InstanceNorm, and BatchNorm with
    ``track_running_stats=False``): each channel normalised over the other dims."""
    channels = _own_statistics(node, B)
    if channels is None:
        raise Mixing(*_BATCH_NORM)
    return (batch_dim(node.args[0]), channels, channels)  # output, per-channel mean and invstd


@register_batch_rule(aten.native_batch_norm_backward.default, aligned=weights_only)
def _batch_norm_backward(node, B):
    grad_input = batch_dim(node.args[0]) if node.meta["val"][0] is not None else None
    if not node.args[7]:  # eval mode: running statistics; weight and bias grads reduce over the batch
        return (grad_input, None, None)
    channels = _own_statistics(node, B)
    if channels is None:  # statistics over the batch (refused in the forward)
        raise Mixing(*_BATCH_NORM)
    return (grad_input, channels, channels)  # per channel, so per sample: no reduction yet


@register_batch_rule(aten.native_layer_norm_backward.default, aligned=weights_only)
def _layer_norm_backward(node, B):
    tag = batch_dim(node.args[1])
    return (tag, None, None)  # weight and bias grads reduce over the batch


@register_batch_rule(aten.convolution.default, aligned=weights_only)
def _convolution(node, B):
    if batch_dim(node.args[1]) is not None or batch_dim(node.args[0]) != BatchDim(0, 1):
        raise Mixing("convolves with per-sample weights or over the batch dimension")
    return batch_dim(node.args[0])


@register_batch_rule(aten.convolution_backward.default, aligned=weights_only)
def _convolution_backward(node, B):
    return (batch_dim(node.args[1]), None, None)  # weight and bias grads reduce over the batch


@register_batch_rule(aten.native_dropout.default)
def _dropout(node, B):
    """Each element gets its own random keep/drop draw, so samples stay apart. The draws come
    from the model's generator (torch's default), never from the DP noise stream."""
    tag = batch_dim(node.args[0])
    return (tag, tag)  # output and keep-mask


register_batch_rule(aten.native_dropout_backward.default)(lambda node, B: batch_dim(node.args[0]))


@register_batch_rule(aten.log_sigmoid_forward.default)
def _log_sigmoid(node, B):
    tag = batch_dim(node.args[0])
    buffer = node.meta["val"][1]  # the CPU kernel's elementwise buffer; empty on CUDA
    return (tag, tag if buffer.shape == node.meta["val"][0].shape else None)


@register_batch_rule(aten.log_sigmoid_backward.default)
def _log_sigmoid_backward(node, B):
    return pointwise_rule(node, B) if batch_dim(node.args[2]) is not None else single_tag(node)
