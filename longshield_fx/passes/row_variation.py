"""Row variation of tensors that hold no sample: along which dimensions their entries differ.

``batch_dims`` sets ``node.meta["varies"]`` on every untagged tensor (parameters, constants,
masks, position ids) to ``{dim: Variation}``: the entries depend on the index along ``dim``
only modulo ``period``; ``origin`` names the op that made them differ. A dimension not listed
is uniform: every index holds the same values (a size-1 or expanded dimension,
``ones``/``full``/``zeros_like``, ``arange(T)`` broadcast over the batch). An op without a
variation rule below differs along every dimension (factories such as ``arange``, ``eye``,
``randperm``, ``rand``; parameters; unknown ops). ``batch_dims`` refuses per-sample data
combined with a tensor that varies along the dimension lined up with the batch: such a
sample's loss would depend on its row position.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from ._graph import CONSTANT_LIKE, REDUCTIONS, is_pointwise, module_of, norm_dim, permutation, reduced_dims, val

aten = torch.ops.aten


@dataclass(frozen=True)
class Variation:
    """Entries differ along a dimension, as a function of its index modulo ``period``.

    ``period`` divides the dimension's size (the size itself: no known structure);
    ``origin`` names the op that made them differ, for error messages. ``digits``, where
    set, says more: the entries depend on the index i only through ``(i // lo) % (hi // lo)``
    for each ``(lo, hi)`` (digits of i in a mixed radix, ``hi`` = ``period`` the largest),
    e.g. ``((2, 48),)`` for (24 positions, 2 batch rows) folded into 48 rows: the positions
    differ, the batch rows do not. ``period`` alone stays a sound summary: a dependence on
    i modulo it.
    """

    period: int
    origin: str
    digits: tuple | None = None

    @property
    def ranges(self) -> tuple:
        """The ``(lo, hi)`` digit ranges the entries depend on."""
        return self.digits or ((1, self.period),)


def _from_ranges(ranges, size: int, origin: str) -> Variation:
    """The variation along a dim of ``size`` that depends on these digit ranges (joined where one
    ends where the next begins). Ranges that do not fit the dim's mixed radix (``lo`` not dividing
    ``hi``, ``hi`` not dividing ``size``) or overlap make the dim vary with no known structure."""
    merged: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if hi % lo or size % hi or (merged and lo < merged[-1][1]):
            return Variation(size, origin)
        if merged and lo == merged[-1][1]:
            merged[-1][1] = hi
        else:
            merged.append([lo, hi])
    period = merged[-1][1]
    return Variation(period, origin) if merged[0][0] == 1 and len(merged) == 1 else \
        Variation(period, origin, tuple(map(tuple, merged)))


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


_VARIATION: dict = {}


def _variation_rule(*ops):
    def deco(fn):
        for op in ops:
            _VARIATION[op] = fn
        return fn
    return deco


def variation(node: fx.Node) -> dict[int, Variation]:
    """The variation of an untagged ``call_function`` node's output, from its inputs'."""
    if val(node).numel() == 0:
        return {}  # no entries, nothing that could differ from row to row
    rule = _VARIATION.get(node.target)
    if rule is None and is_pointwise(node.target):
        rule = _broadcast_variation
    return _everywhere(node) if rule is None else rule(node)


def _join(a: Variation | None, b: Variation) -> Variation:
    # Both periods divide the size, so their lcm does too.
    if a is None or a == b:
        return b
    return Variation(math.lcm(a.period, b.period), a.origin)


@_variation_rule(aten.full.default, aten.ones.default, aten.zeros.default, aten.empty.memory_format,
                 aten.empty_strided.default, aten.scalar_tensor.default, aten.fill.Tensor, *CONSTANT_LIKE)
def _uniform(node):
    return {}


def _broadcast_variation(node):
    shape = val(node).shape
    out: dict[int, Variation] = {}
    for x in node.all_input_nodes:
        for d, v in varies(x).items():
            pos = len(shape) - val(x).dim() + d
            out[pos] = _join(out.get(pos), v)
    return out


@_variation_rule(aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.unsqueeze.default,
                 aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)
def _reshape_variation(node):
    """A reshape maps runs of input dims onto runs of output dims with the same product.

    Within a run, each varying input dim's digit ranges are ranges of the run's flat index
    (scaled by the sizes after it); an output dim depends on the part of them within its own
    span of that index, so one whose span misses them all is uniform: the B part of (1, T)
    expanded to (B, T) and viewed as (B*T,), or of (T, B) viewed as (T*B,) and back.
    """
    a, b = list(val(node.args[0]).shape), list(val(node).shape)
    if 0 in a or math.prod(a) != math.prod(b):
        return _everywhere(node)
    vin, out = varies(node.args[0]), {}
    for run_a, run_b in _runs(a, b):
        flat, stride = [], 1
        for d in reversed(run_a):
            if d in vin:
                flat += [(lo * stride, hi * stride, vin[d].origin) for lo, hi in vin[d].ranges]
            stride *= a[d]
        stride = 1
        for e in reversed(run_b):
            span = (stride, stride * b[e])
            mine = [(max(lo, span[0]), min(hi, span[1]), origin) for lo, hi, origin in flat
                    if max(lo, span[0]) < min(hi, span[1])]
            if mine and b[e] > 1:
                origin = mine[0][2]
                if any(lo % stride or hi % stride for lo, hi, _ in mine):  # not aligned to the dim's digits
                    out[e] = Variation(b[e], origin)
                else:
                    out[e] = _from_ranges([(lo // stride, hi // stride) for lo, hi, _ in mine], b[e], origin)
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
    return {o: vin[i] for o, i in enumerate(permutation(node)) if i in vin}


@_variation_rule(aten.slice.Tensor)
def _slice_variation(node):
    out = dict(varies(node.args[0]))
    dim = norm_dim(node.args[1] if len(node.args) > 1 else 0, val(node).dim())
    n = val(node).shape[dim]
    if dim in out:
        out[dim] = Variation(n, out[dim].origin)
        if n == 1:
            del out[dim]
    return out


@_variation_rule(operator.getitem)
def _piece_variation(node):
    """A piece of ``split``/``chunk`` is a slice along the split dim, one of ``unbind`` a select;
    the other dims keep the input's variation. Other multi-output ops: unknown structure."""
    parent = node.args[0]
    src = parent.args[0] if parent.op == "call_function" else None
    if parent.target in (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default):
        dim = norm_dim(parent.args[2] if len(parent.args) > 2 else parent.kwargs.get("dim", 0), val(src).dim())
        out, n = dict(varies(src)), val(node).shape[dim]
        if dim in out:
            out[dim] = Variation(n, out[dim].origin)
            if n == 1:
                del out[dim]
        return out
    if parent.target == aten.unbind.int:
        dim = norm_dim(parent.args[1] if len(parent.args) > 1 else 0, val(src).dim())
        return {d - (d > dim): v for d, v in varies(src).items() if d != dim}
    return _everywhere(node)


@_variation_rule(aten.constant_pad_nd.default)
def _pad_variation(node):
    """A padded dim differs between the pad and the content (SDPA pads the mask of CUDA's
    memory-efficient attention to 16 columns); the others keep their variation."""
    out, shape, pad = dict(varies(node.args[0])), val(node).shape, node.args[1]
    for i in range(len(pad) // 2):
        d = len(shape) - 1 - i
        if (pad[2 * i] or pad[2 * i + 1]) and shape[d] > 1:
            out[d] = Variation(shape[d], out[d].origin if d in out else _describe(node))
    return out


@_variation_rule(aten.slice_scatter.default, aten.select_scatter.default)
def _scatter_variation(node):
    """``input`` with a slice (or one index) of dim ``dim`` replaced by ``src`` (an in-place
    ``x[..., a:b] = y``, functionalized): the other dims keep both tensors' variation; ``dim``
    differs between what was replaced and what was kept (M-RoPE's per-axis frequency sections)."""
    base, src = node.args[:2]
    rank = val(node).dim()
    dim = norm_dim(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0), rank)
    src_dims = list(range(rank)) if node.target == aten.slice_scatter.default else \
        [d for d in range(rank) if d != dim]
    out = dict(varies(base))
    for d_src, v in varies(src).items():
        d = src_dims[d_src]
        out[d] = _join(out.get(d), v)
    n = val(node).shape[dim]
    if n > 1:
        out[dim] = Variation(n, out[dim].origin if dim in out else _describe(node))
    return out


@_variation_rule(aten.select.int)
def _select_variation(node):
    dim = norm_dim(node.args[1], val(node.args[0]).dim())
    return {d - (d > dim): v for d, v in varies(node.args[0]).items() if d != dim}


@_variation_rule(aten.cat.default)
def _cat_variation(node):
    tensors = [t for t in node.args[0] if val(t).dim() == val(node).dim()]  # cat skips legacy (0,) inputs
    dim = norm_dim(node.args[1] if len(node.args) > 1 else 0, val(node).dim())
    out: dict[int, Variation] = {}
    for t in tensors:
        for d, v in varies(t).items():
            out[d] = _join(out.get(d), v) if d != dim else out.get(d, v)
    n = val(node).shape[dim]
    if n > 1:  # the pieces may hold different values even where each is uniform
        out[dim] = Variation(n, out[dim].origin if dim in out else _describe(node))
    return out


@_variation_rule(*REDUCTIONS)
def _reduction_variation(node):
    dims, keepdim = reduced_dims(node)
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
    dim = norm_dim(node.args[1], val(node).dim())
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
    dim = norm_dim(dim, val(node).dim())
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
