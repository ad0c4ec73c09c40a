"""The per-sample rules of the ``per_sample`` pass, one per gradient op (see its docstring):
weight-gradient reductions over the batch rewritten to keep it (linear, grouped linear, sums,
norms, embeddings and per-token expert weights as sparse rows, convolutions), and the ops
between such a reduction and a parameter's gradient output, applied to each sample's piece.
Registered when ``longshield_fx.passes`` is imported; users add theirs with
``longshield_fx.per_sample_rule``.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..errors import UnsupportedModelError
from ._graph import permutation, val
from .batch_dims import BatchDim, batch_dim
from .per_sample import PerSampleGrad, Rewriter, _dense, _input_rep, per_sample_rule

aten = torch.ops.aten


def _contraction(labels_a: str, labels_b: str, labels_out: str):
    """The rule for a matmul whose contracted dim ``k`` holds the folded batch (B*T rows):
    the same contraction as an einsum that keeps ``b``. ``mm`` is "mk,kn->mn"; ``bmm`` with
    a leading group dim (grouped linear layers) "gmk,gkn->gmn"."""

    def rule(rw: Rewriter, node: fx.Node) -> PerSampleGrad:
        a, b = node.args
        if rw.packing and (batch_dim(a) is not None or batch_dim(b) is not None):
            return _packed_linear(rw, node)
        if batch_dim(a) is None and batch_dim(b) is None:  # a piece already reduced upstream
            if a in rw.batch_derived and b not in rw.batch_derived:
                return _dense(rw, node, rw.call(aten.matmul.default, _input_rep(rw, node, a), b))
            if b in rw.batch_derived and a not in rw.batch_derived:
                return _dense(rw, node, rw.call(aten.matmul.default, a, _input_rep(rw, node, b)))
            raise UnsupportedModelError(f"parameter {rw.param!r}: product of two gradient pieces at {node.name}")
        a, b = _pair_shared_rows(rw, a, labels_a, b, labels_b)
        tags = [_operand_tag(x, labels) for x, labels in ((a, labels_a), (b, labels_b))]
        if all(tags) and tags[0][0] == tags[1][0] == "k" and tags[0][1].at(0) != tags[1][1].at(0):
            raise UnsupportedModelError(
                f"parameter {rw.param!r}: {node.name} pairs rows of operands whose samples are laid out "
                f"differently ({tags[0][1]}, {tags[1][1]})")
        operands = [_contracted_operand(rw, node, x, labels) for x, labels in ((a, labels_a), (b, labels_b))]
        (xa, la), (xb, lb) = operands
        return _dense(rw, node, rw.call(aten.einsum.default, f"{la},{lb}->b{labels_out}", [xa, xb]))

    return rule


def _packed_linear(rw: Rewriter, node: fx.Node) -> PerSampleGrad:
    """``mm(a, b)`` contracting the B*T token rows, per unit slot: both operands as token rows in
    the batch's order, each unit's product over its own rows (``longshield::segment_outer``)."""
    a, b = node.args
    left = _token_rows(rw, node, a, contracted_dim=1)
    right = _token_rows(rw, node, b, contracted_dim=0)
    packing = rw.packing
    out = rw.call(torch.ops.longshield.segment_outer.default, left, right, packing.unit, packing.counts)
    return _dense(rw, node, out)


def _token_rows(rw: Rewriter, node: fx.Node, x: fx.Node, contracted_dim: int) -> fx.Node:
    """A 2-D matmul operand as (B*T, other dim), whether it holds the tokens on its contracted
    dim itself or through a transpose of a tagged tensor."""
    tag = batch_dim(x)
    if tag is not None and tag.dim == contracted_dim:
        if contracted_dim == 1:
            x = rw.call(aten.t.default, x)
            x.meta["batch_dim"] = BatchDim(0, tag.inner, tag.outer)
        return rw.packing.tokens(rw.param, x)[0]
    if x.target in (aten.t.default, aten.transpose.int, aten.permute.default) and val(x).dim() == 2 \
            and batch_dim(x.args[0]) is not None and batch_dim(x.args[0]).dim == 1 - contracted_dim:
        return rw.packing.tokens(rw.param, x.args[0])[0]
    raise rw.packing.unsupported(rw.param, node)


def _pair_shared_rows(rw: Rewriter, a: fx.Node, labels_a: str, b: fx.Node, labels_b: str) -> tuple:
    """Where one operand holds the batch on the contracted dim and the other holds no sample
    (a linear layer applied to a constant, ZAYA's ``v_proj(zeros)`` for the first token's
    delayed value), the contraction pairs their rows by index: sample b's part of the sum is
    over b's rows of both. The shared operand is tagged like its partner so both unfold alike."""
    tags = [_operand_tag(x, labels) for x, labels in ((a, labels_a), (b, labels_b))]
    for i, (x, labels) in enumerate(((a, labels_a), (b, labels_b))):
        partner = tags[1 - i]
        if tags[i] is None and partner is not None and partner[0] == "k" and x not in rw.batch_derived:
            shared = _tagged_copy(rw, x, partner[1].at(labels.index("k")))
            return (shared, b) if i == 0 else (a, shared)
    return a, b


def _tagged_copy(rw: Rewriter, x: fx.Node, tag: BatchDim) -> fx.Node:
    """A contiguous copy of ``x``, which holds no sample, tagged ``tag``: the layout of the
    per-sample tensor it is paired with element by element, so ``unfold`` splits both alike."""
    out = rw.call(aten.clone.default, x, memory_format=torch.contiguous_format)
    out.meta["batch_dim"] = tag
    return out


def _sample_major(rw: Rewriter, x: fx.Node, tag: BatchDim) -> fx.Node:
    """Rows tiled in blocks, (outer, B, inner) (XLNet's (T, B) layout folded into T*B rows), as
    (B, outer * inner) in x's place: each sample's rows together, like an untiled (B, T)."""
    shape, d = list(val(x).shape), tag.dim
    split = rw.call(aten.reshape.default, x, shape[:d] + [tag.outer, rw.B, tag.inner] + shape[d + 1:])
    leading = rw.call(aten.clone.default, rw.call(aten.movedim.int, split, d + 1, 0),
                      memory_format=torch.contiguous_format)
    return rw.call(aten.view.default, leading, [rw.B] + shape[:d] + [tag.outer * tag.inner] + shape[d + 1:])


def _operand_tag(x: fx.Node, labels: str) -> tuple[str, BatchDim] | None:
    """(label of the batch dim, tag) of an operand, looking through a transpose of a tagged tensor."""
    if x.target in (aten.t.default, aten.transpose.int, aten.permute.default) and batch_dim(x.args[0]) is not None:
        perm = permutation(x)
        return labels[perm.index(batch_dim(x.args[0]).dim)], batch_dim(x.args[0])
    tag = batch_dim(x)
    return None if tag is None else (labels[tag.dim], tag)


def _contracted_operand(rw: Rewriter, node: fx.Node, x: fx.Node, labels: str) -> tuple[fx.Node, str]:
    """``x`` unfolded to (B, ...) with its einsum labels; looks through a transpose of a tagged tensor."""
    if x.target in (aten.t.default, aten.transpose.int, aten.permute.default) and batch_dim(x.args[0]) is not None:
        perm = permutation(x)
        x, labels = x.args[0], "".join(labels[perm.index(j)] for j in range(len(labels)))
    tag = batch_dim(x)
    if tag is None:
        raise UnsupportedModelError(f"parameter {rw.param!r}: {node.name} contracts per-sample data with shared data")
    if labels[tag.dim] != "k":
        raise UnsupportedModelError(f"parameter {rw.param!r}: {node.name} keeps the batch in an output dim")
    if tag.outer != 1:
        return _sample_major(rw, x, tag), "b" + labels[: tag.dim] + "t" + labels[tag.dim + 1:]
    xu, _ = rw.unfold(x)
    return xu, "b" + labels[: tag.dim] + ("t" if tag.inner != 1 else "") + labels[tag.dim + 1:]


per_sample_rule(aten.mm.default, name="linear")(_contraction("mk", "kn", "mn"))
per_sample_rule(aten.bmm.default, name="grouped_linear")(_contraction("gmk", "gkn", "gmn"))


@per_sample_rule(aten.sum.dim_IntList, aten.sum.default, name="sum")
def _sum(rw: Rewriter, node: fx.Node) -> PerSampleGrad:
    x = node.args[0]
    rank = val(x).dim()
    dims = node.args[1] if len(node.args) > 1 and node.args[1] else list(range(rank))
    dims = [d % rank for d in dims] if rank else []
    out_shape = list(val(node).shape)
    if batch_dim(x) is not None:
        if batch_dim(x).dim not in dims:
            raise UnsupportedModelError(f"parameter {rw.param!r}: {node.name} keeps the batch dimension")
        return _dense(rw, node, rw.per_sample_sum(x, dims, out_shape))
    keepdim = len(node.args) > 2 and node.args[2]
    y = rw.call(aten.sum.dim_IntList, _input_rep(rw, node, x), [d + 1 for d in dims], keepdim)
    return _dense(rw, node, y)


def _affine(rw: Rewriter, node: fx.Node, grad_out: fx.Node, x: fx.Node, dims: list, x_hat) -> PerSampleGrad:
    """A norm's affine weight (output 1: sums ``grad_out * x_hat()`` over ``dims``) or bias (sums
    ``grad_out``) gradient, per sample; ``x_hat()`` builds the normalised ``x``, for the weight only."""
    piece = grad_out
    if node.args[1] == 1:
        normalised = x_hat()
        normalised.meta["batch_dim"] = batch_dim(x)
        piece = rw.call(aten.mul.Tensor, grad_out, normalised)
        piece.meta["batch_dim"] = batch_dim(x)
    return _dense(rw, node, rw.per_sample_sum(piece, dims, list(val(node).shape)))


@per_sample_rule((aten.native_layer_norm_backward.default, 1), (aten.native_layer_norm_backward.default, 2),
                 name="layer_norm")
def _layer_norm(rw: Rewriter, node: fx.Node) -> PerSampleGrad:
    grad_out, x, normalized_shape, mean, rstd = node.args[0].args[:5]
    lead = list(range(val(x).dim() - len(normalized_shape)))
    return _affine(rw, node, grad_out, x, lead,
                   lambda: rw.call(aten.mul.Tensor, rw.call(aten.sub.Tensor, x, mean), rstd))


@per_sample_rule((aten.native_batch_norm_backward.default, 1), (aten.native_batch_norm_backward.default, 2),
                 name="batch_norm_eval")
def _batch_norm_eval(rw: Rewriter, node: fx.Node) -> PerSampleGrad:
    """Eval-mode batch norm (the batch rule refuses training mode): per channel (dim 1), x_hat is
    (x - running_mean) / sqrt(running_var + eps)."""
    grad_out, x, _, running_mean, running_var = node.args[0].args[:5]
    eps = node.args[0].args[8]
    channel = [1, -1] + [1] * (val(x).dim() - 2)

    def x_hat():
        mean = rw.call(aten.view.default, running_mean, channel)
        rstd = rw.call(aten.view.default, rw.call(aten.rsqrt.default, rw.call(aten.add.Scalar, running_var, eps)),
                       channel)
        return rw.call(aten.mul.Tensor, rw.call(aten.sub.Tensor, x, mean), rstd)

    return _affine(rw, node, grad_out, x, [d for d in range(val(x).dim()) if d != 1], x_hat)


@per_sample_rule((aten.native_group_norm_backward.default, 1), (aten.native_group_norm_backward.default, 2),
                 name="group_norm")
def _group_norm(rw: Rewriter, node: fx.Node) -> PerSampleGrad:
    """Per channel (dim 1): x_hat normalised by its row's group mean and rstd (N, groups)."""
    grad_out, x, mean, rstd = node.args[0].args[:4]

    def x_hat():
        N, groups = val(mean).shape
        grouped = rw.call(aten.view.default, x, [N, groups, -1])
        grouped.meta["batch_dim"] = batch_dim(x)
        centred = rw.call(aten.sub.Tensor, grouped, rw.call(aten.unsqueeze.default, mean, 2))
        x_hat = rw.call(aten.mul.Tensor, centred, rw.call(aten.unsqueeze.default, rstd, 2))
        return rw.call(aten.view.default, x_hat, list(val(x).shape))

    return _affine(rw, node, grad_out, x, [d for d in range(val(x).dim()) if d != 1], x_hat)


@per_sample_rule(aten.embedding_dense_backward.default, name="embedding")
def _embedding(rw: Rewriter, node: fx.Node) -> PerSampleGrad:
    grad, indices, num_weights, padding_idx, scale_grad_by_freq = node.args
    if scale_grad_by_freq:
        raise UnsupportedModelError(
            f"parameter {rw.param!r}: embedding with scale_grad_by_freq=True scales by in-batch counts, "
            "which mixes samples. Way out: scale_grad_by_freq=False.")
    B = rw.B
    H = val(node).shape[1]
    if rw.packing:
        return _packed_embedding(rw, node)
    if batch_dim(grad) is not None:
        values, _ = rw.unfold(grad)
    else:
        values = _input_rep(rw, node, grad)
    n = val(values).numel() // (B * H)
    values = rw.rows(values, [B, n, H])
    if batch_dim(indices) is not None:
        ids, _ = rw.unfold(indices)
        ids = rw.rows(ids, [B, n])
    elif val(indices).numel() == B * n:  # ids shared by the samples but laid out per row (OPT's positions)
        ids = rw.call(aten.reshape.default, indices, [B, n])
    else:
        ids = rw.call(aten.expand.default, rw.call(aten.view.default, indices, [1, n]), [B, n])
    if padding_idx is not None and padding_idx >= 0:
        is_pad = rw.call(aten.unsqueeze.default, rw.call(aten.eq.Scalar, ids, padding_idx), 2)
        values = rw.call(aten.mul.Tensor, values, rw.call(aten.logical_not.default, is_pad))
    return PerSampleGrad(tuple(val(node).shape), None, ((ids, values),))


def _packed_embedding(rw: Rewriter, node: fx.Node) -> PerSampleGrad:
    """An embedding's gradient with packed documents: one sparse row per token, owned by the
    token's unit slot."""
    grad, indices, _, padding_idx, _ = node.args
    packing = rw.packing
    if batch_dim(grad) is None or batch_dim(indices) is None:
        raise packing.unsupported(rw.param, node)
    values = packing.tokens(rw.param, grad)[0]
    ids = packing.tokens(rw.param, indices)[0]
    if padding_idx is not None and padding_idx >= 0:
        is_pad = rw.call(aten.unsqueeze.default, rw.call(aten.eq.Scalar, ids, padding_idx), 1)
        values = rw.call(aten.mul.Tensor, values, rw.call(aten.logical_not.default, is_pad))
    return PerSampleGrad(tuple(val(node).shape), None, ((ids, values, packing.unit),))


_ZEROS = {aten.zeros.default, aten.new_zeros.default, aten.zeros_like.default}


@per_sample_rule(aten.index_put.default, aten._index_put_impl.default, name="indexed_rows")
def _index_put(rw: Rewriter, node: fx.Node) -> PerSampleGrad:
    """A table read at per-sample indices (``w[ids]``, e.g. MoE expert weights): its gradient
    adds each read's gradient into the row it read, kept as sparse rows per sample. Ids shared
    by the samples but laid out per row (Whisper's positions ``arange(T)`` repeated over the
    batch) pair element by element with the per-sample gradient rows they add."""
    table, indices, values = node.args[:3]
    accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
    ids = indices[0] if len(indices) == 1 else None
    if accumulate and ids is not None and batch_dim(ids) is None and ids not in rw.batch_derived \
            and batch_dim(values) is None and table.target in _ZEROS:
        return _shared_rows(rw, node, ids, values)
    if accumulate and ids is not None and batch_dim(ids) is None and batch_dim(values) is not None \
            and batch_dim(values).dim < val(ids).dim() and val(ids).shape == val(values).shape[:val(ids).dim()]:
        ids = _tagged_copy(rw, ids, batch_dim(values))
    if not accumulate or ids is None or batch_dim(ids) is None or batch_dim(values) is None:
        raise UnsupportedModelError(
            f"parameter {rw.param!r}: {node.name} writes into the gradient other than by adding rows at "
            "per-sample indices; no per-sample rule covers it. Way out: freeze the parameter.")
    if table.target in _ZEROS:
        base = PerSampleGrad(tuple(val(node).shape))
    elif table in rw.batch_derived:
        base = rw.rep(table)
    else:
        raise UnsupportedModelError(f"parameter {rw.param!r}: {node.name} adds rows into a constant table")
    ids_u, _ = rw.unfold(ids)
    values_u, _ = rw.unfold(values)
    n = val(ids_u).numel() // rw.B
    rows = (rw.rows(ids_u, [rw.B, n]), rw.rows(values_u, [rw.B, n, *val(node).shape[1:]]))
    return rw.add(base, PerSampleGrad(tuple(val(node).shape), None, (rows,)))


def _shared_rows(rw: Rewriter, node: fx.Node, ids: fx.Node, values: fx.Node) -> PerSampleGrad:
    """A table read at ids shared by every sample (``pos[arange(T)]`` broadcast over the batch):
    the gradient rows were summed over the batch before the index_put adds them at the ids, so
    each sample's rows (the per-sample form of ``values``) go to the same ids."""
    if val(values).shape[:val(ids).dim()] != val(ids).shape:
        raise UnsupportedModelError(
            f"parameter {rw.param!r}: {node.name} adds gradient rows that do not pair one to one with its "
            "indices. Way out: freeze the parameter.")
    n = val(ids).numel()
    rows = rw.view(rw.densify(rw.rep(values)), [rw.B, n, *val(node).shape[1:]])
    shared = rw.call(aten.expand.default, rw.call(aten.view.default, ids, [1, n]), [rw.B, n])
    return PerSampleGrad(tuple(val(node).shape), None, ((shared, rows),))


@per_sample_rule((aten.convolution_backward.default, 1), (aten.convolution_backward.default, 2), name="conv")
def _conv(rw: Rewriter, node: fx.Node) -> PerSampleGrad:
    """Per-sample conv weight gradients as ONE grouped convolution_backward: the batch folded
    into the channels (B*groups groups), so sample b's input only meets its own output grad.
    Bias: the output gradient summed over positions."""
    conv = node.args[0]
    grad, x, weight, _, stride, padding, dilation, transposed, output_padding, groups = conv.args[:10]
    B = rw.B
    if transposed or batch_dim(grad) != BatchDim(0, 1) or batch_dim(x) != BatchDim(0, 1):
        raise UnsupportedModelError(
            f"parameter {rw.param!r}: no per-sample rule for a transposed convolution or one over a "
            f"folded batch ({conv.name}). Way out: freeze the parameter.")
    if node.args[1] == 2:
        return _dense(rw, node, rw.call(aten.sum.dim_IntList, grad, list(range(2, val(grad).dim()))))
    w_shape = list(val(weight).shape)
    folded = [rw.call(aten.reshape.default, t, [1, B * val(t).shape[1], *val(t).shape[2:]]) for t in (grad, x)]
    weights = rw.call(aten.repeat.default, weight, [B] + [1] * (len(w_shape) - 1))
    both = rw.call(aten.convolution_backward.default, *folded, weights, None, stride, padding, dilation,
                   False, output_padding, B * groups, [False, True, False])
    per_sample = rw.call(operator.getitem, both, 1)
    return _dense(rw, node, rw.view(per_sample, [B, *w_shape]))


# --- ops between a reduction and the gradient output, applied per sample ---------------

@per_sample_rule(aten.view.default, aten._unsafe_view.default, aten.reshape.default, name="view")
def _view(rw: Rewriter, node: fx.Node) -> PerSampleGrad:
    g = rw.rep(node.args[0])
    shape = list(val(node).shape)
    if g.rows and list(g.shape) == shape:
        return g
    return _dense(rw, node, rw.view(rw.densify(g), [rw.B, *shape]))


@per_sample_rule(aten.t.default, aten.transpose.int, aten.permute.default, name="transpose")
def _transpose(rw: Rewriter, node: fx.Node) -> PerSampleGrad:
    x = rw.densify(rw.rep(node.args[0]))
    return _dense(rw, node, rw.permute(x, [0] + [p + 1 for p in permutation(node)]))


@per_sample_rule(aten.add.Tensor, name="add")
def _add(rw: Rewriter, node: fx.Node) -> PerSampleGrad:
    a, b = node.args[:2]
    if len(node.args) > 2 or node.kwargs.get("alpha", 1) != 1:
        raise UnsupportedModelError(f"parameter {rw.param!r}: add with alpha at {node.name}")
    return rw.add(rw.rep(a), rw.rep(b))


@per_sample_rule(aten.mul.Tensor, aten.div.Tensor, aten.mul.Scalar, aten.div.Scalar, name="scale")
def _scale(rw: Rewriter, node: fx.Node) -> PerSampleGrad:
    a, b = node.args[:2]
    if isinstance(b, fx.Node) and b in rw.batch_derived:
        if node.target in (aten.div.Tensor, aten.div.Scalar) or a in rw.batch_derived:
            raise UnsupportedModelError(f"parameter {rw.param!r}: {node.name} divides/multiplies gradient pieces")
        a, b = b, a
    if isinstance(b, fx.Node) and val(b) is not None and val(b).dim() > 0:
        x = rw.densify(rw.rep(a))
        return _dense(rw, node, rw.call(node.target, x, b))
    g = rw.rep(a)
    dense = rw.call(node.target, g.dense, b) if g.dense is not None else None
    rows = tuple((i, rw.call(node.target, v, b), *o) for i, v, *o in g.rows)
    return PerSampleGrad(g.shape, dense, rows)


@per_sample_rule(aten.neg.default, name="scale")
def _neg(rw: Rewriter, node: fx.Node) -> PerSampleGrad:
    g = rw.rep(node.args[0])
    dense = rw.call(aten.neg.default, g.dense) if g.dense is not None else None
    return PerSampleGrad(g.shape, dense, tuple((i, rw.call(aten.neg.default, v), *o) for i, v, *o in g.rows))


@per_sample_rule(aten._to_copy.default, aten.clone.default, aten.detach.default, aten.alias.default,
                 name="cast")
def _cast(rw: Rewriter, node: fx.Node) -> PerSampleGrad:
    g = rw.rep(node.args[0])
    dense = rw.call(node.target, g.dense, *node.args[1:], **node.kwargs) if g.dense is not None else None
    rows = tuple((i, rw.call(node.target, v, *node.args[1:], **node.kwargs), *o) for i, v, *o in g.rows)
    return PerSampleGrad(g.shape, dense, rows)


@per_sample_rule(aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, name="view")
def _squeeze(rw: Rewriter, node: fx.Node) -> PerSampleGrad:
    x = rw.densify(rw.rep(node.args[0]))
    return _dense(rw, node, rw.view(x, [rw.B, *val(node).shape]))


@per_sample_rule(aten.cat.default, aten.stack.default, name="view")
def _cat(rw: Rewriter, node: fx.Node) -> PerSampleGrad:
    """Pieces of a parameter's gradient laid side by side (hyper-connection weights)."""
    pieces = node.args[0]
    if not all(p in rw.batch_derived for p in pieces):
        raise UnsupportedModelError(f"parameter {rw.param!r}: {node.name} joins gradient pieces with constants")
    dim = node.args[1] if len(node.args) > 1 else 0
    dense = [rw.densify(rw.rep(p)) for p in pieces]
    return _dense(rw, node, rw.call(node.target, dense, dim % val(node).dim() + 1))


@per_sample_rule(aten.slice.Tensor, aten.select.int, name="view")
def _slice(rw: Rewriter, node: fx.Node) -> PerSampleGrad:
    x = rw.densify(rw.rep(node.args[0]))
    dim = node.args[1] % val(node.args[0]).dim() if len(node.args) > 1 else 0
    return _dense(rw, node, rw.call(node.target, x, dim + 1, *node.args[2:]))


@per_sample_rule(aten.slice_backward.default, aten.select_backward.default, name="view")
def _slice_backward(rw: Rewriter, node: fx.Node) -> PerSampleGrad:
    """A parameter used through a slice or an index: its gradient zero-padded back to size."""
    grad, sizes, dim, *rest = node.args
    x = rw.densify(rw.rep(grad))
    return _dense(rw, node, rw.call(node.target, x, [rw.B, *sizes], dim % len(sizes) + 1, *rest))


@per_sample_rule(aten.diagonal.default, name="view")
def _diagonal(rw: Rewriter, node: fx.Node) -> PerSampleGrad:
    """A parameter used through ``diag(v)``: its gradient is the diagonal of the (n, n) one."""
    x = rw.densify(rw.rep(node.args[0]))
    rank = val(node.args[0]).dim()
    offset, dim1, dim2 = (list(node.args[1:]) + [0, 0, 1][len(node.args) - 1:])[:3]
    return _dense(rw, node, rw.call(aten.diagonal.default, x, offset, dim1 % rank + 1, dim2 % rank + 1))


@per_sample_rule(aten.diagonal_backward.default, aten.diag_embed.default, name="view")
def _diagonal_backward(rw: Rewriter, node: fx.Node) -> PerSampleGrad:
    """A parameter used through ``diagonal(W)``: its gradient set on the diagonal of zeros
    (``diag_embed``: a vector's gradient written along a new diagonal)."""
    x = rw.densify(rw.rep(node.args[0]))
    if node.target == aten.diagonal_backward.default:
        grad, sizes, offset, dim1, dim2 = node.args
        rank = len(sizes)
        return _dense(rw, node, rw.call(node.target, x, [rw.B, *sizes], offset, dim1 % rank + 1, dim2 % rank + 1))
    rank = val(node).dim()
    offset, dim1, dim2 = (list(node.args[1:]) + [0, -2, -1][len(node.args) - 1:])[:3]
    return _dense(rw, node, rw.call(node.target, x, offset, dim1 % rank + 1, dim2 % rank + 1))


@per_sample_rule(aten.expand.default, name="view")
def _expand(rw: Rewriter, node: fx.Node) -> PerSampleGrad:
    """A parameter broadcast in the forward (e.g. ``w.sum()`` used by every sample)."""
    x = rw.densify(rw.rep(node.args[0]))
    lead = [rw.B] + [1] * (val(node).dim() - val(node.args[0]).dim())
    x = rw.view(x, lead + list(val(node.args[0]).shape))
    return _dense(rw, node, rw.call(aten.expand.default, x, [rw.B, *val(node).shape]))


@per_sample_rule(aten._embedding_bag_backward.default, aten._embedding_bag_dense_backward.default,
                 name="embedding_bag")
def _embedding_bag(rw: Rewriter, node: fx.Node) -> PerSampleGrad:
    """Sample b's bag is its n indices (``_embedding_bag``'s batch rule checked the offsets): sum
    mode adds ``w_bj * grad_b`` to row ``ids_bj``, mean mode ``grad_b / bag_size_b``, max mode
    ``grad_b[d]`` to entry (argmax_bd, d). Sparse rows, as for ``embedding``."""
    sparse = node.target == aten._embedding_bag_backward.default
    grad, indices = node.args[:2]
    maximum_indices = node.args[5] if sparse else node.args[4]
    bag_size = node.args[4] if sparse else node.args[3]
    rest = node.args[6:] if sparse else node.args[5:]
    num_weights, scale_grad_by_freq, mode = rest[:3]
    psw = rest[4] if sparse else rest[3]
    padding_idx = (rest[5] if sparse else rest[4]) if len(rest) > (5 if sparse else 4) else -1
    if scale_grad_by_freq:
        raise UnsupportedModelError(
            f"parameter {rw.param!r}: embedding bag with scale_grad_by_freq=True scales by in-batch counts, "
            "which mixes samples. Way out: scale_grad_by_freq=False.")
    B, D = rw.B, val(node).shape[1]
    g, _ = rw.unfold(grad)  # (B, D)
    if mode == 2:  # max: each (b, d) goes to one row
        ids, _ = rw.unfold(maximum_indices)
        values = rw.call(aten.diag_embed.default, g)  # values[b, d, :] = e_d * grad[b, d]
        return PerSampleGrad(tuple(val(node).shape), None, ((rw.rows(ids, [B, D]), values),))
    n = val(indices).shape[0] // B
    ids = rw.call(aten.view.default, indices, [B, n])
    values = rw.call(aten.expand.default, rw.call(aten.unsqueeze.default, g, 1), [B, n, D])
    if mode == 1:
        size = rw.call(aten.clamp_min.default, rw.call(aten.view.default, bag_size, [B, 1, 1]), 1)
        values = rw.call(aten.div.Tensor, values, size)
    if isinstance(psw, fx.Node):
        values = rw.call(aten.mul.Tensor, values, rw.call(aten.view.default, psw, [B, n, 1]))
    if padding_idx is not None and padding_idx >= 0:
        keep = rw.call(aten.logical_not.default, rw.call(aten.eq.Scalar, ids, padding_idx))
        values = rw.call(aten.mul.Tensor, values, rw.call(aten.unsqueeze.default, keep, 2))
    return PerSampleGrad(tuple(val(node).shape), None, ((rw.rows(ids, [B, n]), rw.rows(values, [B, n, D])),))
