"""Batch rules for ops that pick, place or reorder entries: index, gather, scatter, topk,
stack, padding, slice_scatter.

Along the batch dimension such an op puts a record in another row (or several rows, or
none), so a sample's loss would depend on where the sampler put it: refused
(``RowPosition``), except indexing the batch dimension with ``arange`` of its own size (the
identity, as in last-token pooling ``logits[arange(B), last]``). Along every other
dimension the batch dimension passes through; its new position follows the op's shape
semantics (for advanced indexing: the broadcast index dims replace the indexed dims in
place when those are adjacent, else they lead). Registered when ``longshield_fx.passes`` is
imported.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ._graph import norm_dim, val
from .batch_dims import (BatchDim, Mixing, RowPosition, batch_dim, no_rule, register_batch_rule, single_tag,
                         weights_only)

aten = torch.ops.aten

_MOVES_ROWS = "it moves rows along the batch dimension, so row i holds the record of another row"
_FLATTENS_ROWS = ("a boolean mask over the batch dimension (x[mask]) flattens every sample's kept entries into one "
                  "list, so where a sample's entries land depends on the other samples (as the flat ids and offsets "
                  "of an EmbeddingBag built from x[mask] and cumsum do). Keep the batch dimension instead: mask by "
                  "multiplying or torch.where, and give nn.EmbeddingBag a (B, n) input padded with padding_idx, one "
                  "bag per sample")


@register_batch_rule(aten.index_select.default, aligned=weights_only)
def _index_select(node, B):
    tag = batch_dim(node.args[0])
    if tag is None or batch_dim(node.args[2]) is not None:
        raise Mixing("indexes along the batch dimension")
    if norm_dim(node.args[1], val(node).dim()) == tag.dim:
        raise RowPosition(_MOVES_ROWS)
    return tag


@register_batch_rule(aten.flip.default, aten.roll.default)
def _flip_roll(node, B):
    tag = batch_dim(node.args[0])
    rank = val(node).dim()
    if node.target == aten.flip.default:
        dims = node.args[1]
    else:
        dims = node.args[2] if len(node.args) > 2 else node.kwargs.get("dims", [])
    if not dims or tag.dim in [norm_dim(d, rank) for d in dims]:  # roll without dims rolls the flattened tensor
        raise RowPosition(_MOVES_ROWS)
    return tag


@register_batch_rule(aten.take.default)
def _take(node, B):
    if batch_dim(node.args[0]) is not None:
        raise RowPosition("it reads the per-sample tensor as one flat list, so an output entry comes from "
                           "whichever row the index names")
    no_rule(node)


# --- gather / scatter: the index has the rank of the data, dims correspond one to one ---------

@register_batch_rule(aten.gather.default)
def _gather(node, B):
    """out[..., i, ...] = self[..., index[..., i, ...], ...] along ``dim``."""
    self, dim, index = node.args[:3]
    tag = single_tag(node)
    if norm_dim(dim, val(node).dim()) == tag.dim:
        raise RowPosition(_MOVES_ROWS)
    if val(node).shape[tag.dim] != B * tag.inner:
        raise Mixing("gathers a per-sample index from a table without the batch dimension")
    return tag


@register_batch_rule(aten.scatter.src, aten.scatter.value, aten.scatter_add.default, aten.scatter_reduce.two)
def _scatter(node, B):
    """Writes ``src`` (or a value) into ``self`` at ``index`` along ``dim``."""
    tag = single_tag(node)
    if norm_dim(node.args[1], val(node).dim()) == tag.dim:
        raise RowPosition(_MOVES_ROWS)
    if val(node).shape[tag.dim] != B * tag.inner:
        raise Mixing("scatters every sample's rows into one tensor")  # a weight gradient: per_sample rewrites it
    return tag


@register_batch_rule(aten.topk.default)
def _topk(node, B):
    tag = single_tag(node)
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", -1)
    if norm_dim(dim, val(node.args[0]).dim()) == tag.dim:
        raise Mixing("ranks entries along the batch dimension")
    return (tag, tag)


@register_batch_rule(aten.stack.default)
def _stack(node, B):
    tensors = node.args[0]
    if any(batch_dim(t) is None for t in tensors):
        raise Mixing("stacks per-sample data with data shared by all samples")
    tag = single_tag(node)
    dim = norm_dim(node.args[1] if len(node.args) > 1 else 0, val(node).dim())
    return BatchDim(tag.dim + (dim <= tag.dim), tag.inner)


@register_batch_rule(aten.constant_pad_nd.default)
def _pad(node, B):
    tag = batch_dim(node.args[0])
    pad, rank = node.args[1], val(node).dim()
    padded = {rank - 1 - i // 2 for i, p in enumerate(pad) if p != 0}
    if tag.dim in padded:
        raise Mixing("pads along the batch dimension")
    return tag


@register_batch_rule(aten.slice_scatter.default)
def _slice_scatter(node, B):
    """``self`` with ``src`` written into a slice of ``dim``; a slice of every row is fine."""
    self, src = node.args[:2]
    dim = norm_dim(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0), val(node).dim())
    tag = batch_dim(self) or batch_dim(src)
    if any(batch_dim(t) not in (None, tag) for t in (self, src)):
        raise Mixing("writes samples held in one dimension into a tensor holding them in another")
    if dim == tag.dim and val(src).shape[dim] != val(node).shape[dim]:
        raise RowPosition(_MOVES_ROWS)
    return tag


# --- advanced indexing: index.Tensor and its backward index_put -------------------------------

class _Layout:
    """Where the dims of ``x[indices]`` go (torch's advanced-indexing rule): the index tensors
    broadcast to ``rank`` dims, which replace the indexed dims in place when those are
    adjacent and lead the output otherwise; the other dims keep their order."""

    def __init__(self, x_rank: int, indices):
        self.indexed = [i for i, t in enumerate(indices) if t is not None]
        self.rank = max(val(indices[i]).dim() for i in self.indexed)
        first, last = self.indexed[0], self.indexed[-1]
        self.start = first if self.indexed == list(range(first, last + 1)) else 0  # index dims land here
        self.kept = [d for d in range(x_rank) if d not in self.indexed]

    def kept_dim(self, d: int) -> int:
        """Output position of un-indexed input dim ``d``."""
        before = sum(k < d for k in self.kept)
        return d if d < self.start else before + self.rank

    def index_dim(self, index: fx.Node, d: int) -> int:
        """Output position of dim ``d`` of one index tensor (broadcast from the right)."""
        return self.start + self.rank - val(index).dim() + d


def _is_own_arange(node, rows: int) -> bool:
    """``arange(rows)`` along an index tensor's first dim (other dims of size 1), possibly cast
    or viewed: indexing the batch dimension with it is the identity."""
    v = val(node)
    if v is None or v.dim() == 0 or v.shape[0] != rows or v.numel() != rows:
        return False
    while isinstance(node, fx.Node) and node.target in (aten._to_copy.default, aten.view.default,
                                                         aten.unsqueeze.default, aten.clone.default,
                                                         aten.alias.default):
        node = node.args[0]
    if not isinstance(node, fx.Node) or node.target not in (aten.arange.default, aten.arange.start):
        return False
    start, end = (0, node.args[0]) if node.target == aten.arange.default else node.args[:2]
    return start == 0 and end == rows and node.kwargs.get("step", 1) == 1


def _index_tag(node, B) -> BatchDim | None:
    """Batch tag of ``x[indices]`` (see the module docstring), without the alignment check."""
    x, indices = node.args
    layout = _Layout(val(x).dim(), indices)
    tag = batch_dim(x)
    tagged = [indices[i] for i in layout.indexed if batch_dim(indices[i]) is not None]
    from_index = {BatchDim(layout.index_dim(t, batch_dim(t).dim), batch_dim(t).inner) for t in tagged}
    if tag is not None and tag.dim in layout.indexed:
        identity = indices[tag.dim]
        if val(identity).dtype == torch.bool:
            raise RowPosition(_FLATTENS_ROWS)
        if tag.inner != 1 or not _is_own_arange(identity, B):
            raise RowPosition(_MOVES_ROWS)
        from_index.add(BatchDim(layout.index_dim(identity, 0), 1))
    elif tag is not None:
        from_index.add(BatchDim(layout.kept_dim(tag.dim), tag.inner))
    if len(from_index) > 1:
        raise Mixing(f"its data and index tensors hold samples in different dimensions {sorted(from_index, key=str)}")
    return from_index.pop() if from_index else None


def _indices_aligned(x_rank: int, indices, position: int, inner: int, B: int) -> list:
    """Untagged index tensors meet the batch where it lies (``position`` in the output of
    ``x[indices]``) in their broadcast dims; ``arange(B)`` on the batch is the identity."""
    layout = _Layout(x_rank, indices)
    found = []
    for i in layout.indexed:
        t = indices[i]
        if batch_dim(t) is not None or _is_own_arange(t, B):
            continue
        d = position - layout.index_dim(t, 0)
        if 0 <= d < val(t).dim():
            found.append((t, d, inner))
    return found


def _index_aligned(node, tag, B):
    return _indices_aligned(val(node.args[0]).dim(), node.args[1], tag.dim, tag.inner, B)


def _index_put_aligned(node, tag, B):
    x = node.args[0]
    if batch_dim(x) is None and _masked_fill(*node.args[:3]) is not None:
        return [(x, tag.dim, tag.inner)]  # what the mask keeps of x must be the same for every sample
    values = batch_dim(node.args[2])
    if values is None:
        return []
    return _indices_aligned(val(node).dim(), node.args[1], values.dim, values.inner, B)


@register_batch_rule(aten.index.Tensor, aligned=_index_aligned)
def _index(node, B):
    return _index_tag(node, B)


def _masked_fill(x, indices, values):
    """``x[mask] = value`` with one boolean mask over x's leading dims and one value for every
    masked entry (Gemma3 zeroing its image-token ids): ``where(mask, value, x)``, elementwise, so
    it moves nothing; its output holds the samples where x or the mask does. None: another kind."""
    if len(indices) != 1 or not isinstance(indices[0], fx.Node) or not isinstance(values, fx.Node):
        return None
    mask = indices[0]
    if val(mask).dtype != torch.bool or tuple(val(mask).shape) != tuple(val(x).shape[:val(mask).dim()]) \
            or val(values).numel() != 1 or batch_dim(values) is not None:
        return None
    tags = {t for t in (batch_dim(x), batch_dim(mask)) if t is not None}
    if len(tags) > 1:
        raise Mixing(f"its mask and the tensor it writes hold samples in different dimensions {sorted(tags, key=str)}")
    return tags.pop()


@register_batch_rule(aten.index_put.default, aten._index_put_impl.default, aligned=_index_put_aligned)
def _index_put(node, B):
    """``index``'s backward: ``values`` written (or added) at ``indices`` into ``x``. Into a tensor
    without the batch dimension it sums every sample's rows (a weight gradient, which the
    per_sample pass rewrites); otherwise the batch dim maps back the way ``index`` mapped it."""
    x, indices, values = node.args[:3]
    masked = _masked_fill(x, indices, values)
    if masked is not None:
        return masked
    layout = _Layout(val(node).dim(), indices)
    vtag = batch_dim(values)
    if batch_dim(x) is not None:
        tag = batch_dim(x)
        if tag.dim in layout.indexed:
            if not _is_own_arange(indices[tag.dim], B):
                raise RowPosition(_MOVES_ROWS)
            lands = layout.index_dim(indices[tag.dim], 0)
        else:
            lands = layout.kept_dim(tag.dim)
        if vtag is not None and vtag != BatchDim(lands, tag.inner):
            raise Mixing("writes one sample's values into another sample's rows")
        return tag
    if vtag is None:
        raise Mixing("writes at per-sample indices into a tensor shared by all samples")
    for d in range(val(node).dim()):
        if d in layout.kept and layout.kept_dim(d) == vtag.dim:
            return BatchDim(d, vtag.inner)
    for d in layout.indexed:
        index = indices[d]
        if _is_own_arange(index, B) and layout.index_dim(index, 0) == vtag.dim:
            return BatchDim(d, 1)
    raise Mixing("sums every sample's rows into one tensor")


def _bags_are_samples(offsets, inner: int, B: int, include_last: bool) -> bool:
    """``offsets`` is ``arange(0, B*inner, inner)`` (nn.EmbeddingBag on a (B, inner) input): bag i
    is sample i's ``inner`` rows, nothing else."""
    if not (isinstance(offsets, fx.Node) and offsets.target == aten.arange.start_step):
        return False
    start, end, step = offsets.args[:3]
    return start == 0 and step == inner and val(offsets).shape[0] == B + include_last and end <= (B + 1) * inner


def _embedding_bag_aligned(node, tag, B):
    """Untagged per-sample weights (B*inner rows, one per index) meet the batch along dim 0."""
    psw = node.args[6] if len(node.args) > 6 else None
    inner = batch_dim(node.args[1]).inner
    return [(psw, 0, inner)] if isinstance(psw, fx.Node) and batch_dim(psw) is None else []


@register_batch_rule(aten._embedding_bag.default, aten._embedding_bag_forward_only.default,
                     aligned=_embedding_bag_aligned)
def _embedding_bag(node, B):
    """Bags of rows of a shared table: per sample when each bag is one sample's indices (a (B, n)
    input; ``offsets`` checked to be ``arange(0, B*n, n)``). Outputs: the (B, D) bags, the
    per-index bag ids, the bag sizes, and (max mode) the (B, D) argmax rows."""
    weight, indices, offsets = node.args[:3]
    if batch_dim(weight) is not None:
        raise Mixing("looks up rows of a per-sample table")
    tag = batch_dim(indices)
    include_last = bool(node.args[7]) if len(node.args) > 7 else False
    if tag is None or tag.dim != 0 or tag.outer != 1 or batch_dim(offsets) is not None \
            or not _bags_are_samples(offsets, tag.inner, B, include_last):
        raise Mixing("its bags (offsets) do not follow the samples' rows; give nn.EmbeddingBag a (B, n) "
                     "input, one bag per sample")
    out = []
    for i, v in enumerate(node.meta["val"]):
        if i == 1 and v.dim() == 1 and v.shape[0] == B * tag.inner:
            out.append(tag)  # the bag of each index
        elif v.dim() >= 1 and v.shape[0] == B and v.numel():
            out.append(BatchDim(0, 1))
        else:
            out.append(None)
    return tuple(out)


@register_batch_rule(aten._embedding_bag_backward.default, aten._embedding_bag_dense_backward.default)
def _embedding_bag_backward(node, B):
    raise Mixing("sums gradient rows of all samples into one table")
