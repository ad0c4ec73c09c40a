"""The ``clip`` pass: per-sample norms, clip factors and clipped sums, inside the graph.

Rewrites: the graph's outputs ``(per_sample_loss, *per-sample grads)`` into
``(masked loss sum, per-sample norms (B,), *clipped sums)`` where, for each trainable
parameter, clipped sum = sum_b factor_b * grad_b, in fp32.

The loss cotangent input doubles as the sample mask (1 real, 0 padding): padding rows get
a zero cotangent, and every per-sample quantity is passed through ``where(counted, ·, 0)``
so a padding row contributes exactly zero even when its data is garbage (inf/nan).
``counted`` is ``mask > 0`` and a finite per-sample norm: a real sample whose gradient has an
inf or nan (an inf feature, an fp16 overflow) also contributes exactly zero, so the
sensitivity stays ≤ C and the other samples' sums are untouched. The norms output keeps
the non-finite values of real rows, so the engine can count them.

Clipping (``ctx.config.clipping``):
- ``"flat"``: one norm over all parameters per sample, factor ``min(1, C / (‖g_b‖ + 1e-6))``
  (Opacus's formula).
- ``"per_layer"``: each parameter is a group with threshold ``C / sqrt(K)`` for K groups,
  so the thresholds' squares sum to C², factor ``min(1, C_k / (‖g_bk‖ + 1e-6))``.
- ``"automatic"``: ``C / (‖g_b‖ + γ)`` (Bu et al.), each contribution's norm below C.

Assumes: ``per_sample`` ran (``meta[PER_SAMPLE_GRAD]`` on each parameter placeholder). Guarantees: each sample's contribution to
the clipped sums has norm ≤ C·(1 + 1e-6) measured in float64: squared norms are summed in
float64 (in chunks of at most ``_NORM_CHUNK`` elements, so the float64 copy stays small)
and the clip factor is computed in float64, whatever the compute dtype; only its rounding
to fp32 (2**-24) and the fp32 product remain. Embedding gradients in sparse-row form are
clipped and summed from the token ids without a (B, V, H) tensor.

Layers the ``ghost_norm`` pass moved to the ``outer`` form (g_b = L_bᵀ R_b) get their norms
from float64 Gram matrices and their clipped sum from one fp32 matmul over all samples'
tokens (book-keeping), as in DP-ZeRO and Opacus' ghost clipping: the norms are float64 as
above, but that matmul's rounding (relative ~2**-24 of the summed terms) is shared among the
samples rather than bounded per sample.
"""
from __future__ import annotations

import math
from operator import getitem

import torch
import torch.fx as fx

from .._torch import c10d
from ._context import CP_SHARD_DIM, PER_SAMPLE_GRAD, PassContext
from ._graph import GraphBuilder, val
from .per_sample import PerSampleGrad, Rewriter

aten = torch.ops.aten
_EPS = 1e-6
_NORM_CHUNK = 2 ** 22  # elements per float64 copy when summing squares (32 MiB: below a large head's gradient)


def clip(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Replace per-sample gradient outputs by clipped sums (see the module docstring)."""
    cfg = ctx.config
    graph = gm.graph
    output = graph.output_node()
    loss = output.args[0][0]
    mask = ctx.captured.cotangent_placeholder()
    b = GraphBuilder(graph, ctx.captured.fake_mode)
    rw = Rewriter(gm, ctx)
    # Norms in the order the per-sample gradients become available: the last ones (the
    # first layer's, and under cp their reduce-scatters) get the most time to arrive.
    position = {n: i for i, n in enumerate(graph.nodes)}
    grads = {n: ctx.param_meta(n)[PER_SAMPLE_GRAD] for n in ctx.captured.param_names}
    names = sorted(grads, key=lambda n: _available_at(grads[n], position))
    with graph.inserting_before(output):
        real = b(aten.gt.Scalar, mask, 0)
        grams = {}  # one float64 Gram per ghost-norm operand (q, k and v read the same input)
        sq = {name: _sq_norm(rw, b, grads[name], grams) for name in names}
        if ctx.sp_size > 1:
            sq = _all_reduce_shard_norms(b, ctx, sq, per_parameter=cfg.clipping == "per_layer")
        parts = list(sq.values())
        total = parts[0]
        for part in parts[1:]:
            total = b(aten.add.Tensor, total, part)
        norm = b(aten.sqrt.default, total)
        keep = b(aten.logical_and.default, real, b(aten.isfinite.default, norm))
        if cfg.clipping == "flat":
            factor = _min1(b, _ratio(b, cfg.max_grad_norm, b(aten.add.Scalar, norm, _EPS)))
            factors = {name: factor for name in names}
        elif cfg.clipping == "automatic":
            factor = _ratio(b, cfg.max_grad_norm, b(aten.add.Scalar, norm, cfg.automatic_gamma))
            factors = {name: factor for name in names}
        else:  # per_layer
            threshold = cfg.max_grad_norm / math.sqrt(len(names))
            factors = {
                name: _min1(b, _ratio(b, threshold, b(aten.add.Scalar, b(aten.sqrt.default, sq[name]), _EPS)))
                for name in names}
        factors = {name: _fp32(b, b(aten.where.ScalarOther, keep, f, 0.0)) for name, f in factors.items()}
        sums = {name: _weighted_sum(rw, b, grads[name], factors[name], keep) for name in names}
        sums = [sums[name] for name in ctx.captured.param_names]
        loss_sum = b(aten.sum.default, b(aten.where.ScalarOther, keep, loss, 0.0))
        norms = b(aten.where.ScalarOther, real, norm, 0.0)
    output.args = ((loss_sum, norms, *sums),)
    graph.eliminate_dead_code()
    gm.recompile()
    return gm


def _available_at(g: PerSampleGrad, position: dict) -> int:
    return max(position[n] for n in g.nodes)


def _all_reduce_shard_norms(b, ctx: PassContext, sq: dict, per_parameter: bool) -> dict:
    """Sum squared norms of cp-sharded per-sample gradients over the cp group.

    Replicated (all-reduced) gradients already hold the full value on every rank and are
    left out. Flat clipping all-reduces B floats; per-layer clipping K x B.
    """
    sharded = [n for n in sq if ctx.param_meta(n).get(CP_SHARD_DIM) is not None]
    if not sharded:
        return sq
    sq = dict(sq)
    if per_parameter:
        stacked = b(aten.stack.default, [sq[n] for n in sharded])
        stacked = b(c10d.wait_tensor.default, b(c10d.all_reduce.default, stacked, "sum", ctx.sp_group_name))
        for i, n in enumerate(sharded):
            sq[n] = b(aten.select.int, stacked, 0, i)
        return sq
    partial = sq.pop(sharded[0])
    for n in sharded[1:]:
        partial = b(aten.add.Tensor, partial, sq.pop(n))
    sq["<sharded>"] = b(c10d.wait_tensor.default, b(c10d.all_reduce.default, partial, "sum", ctx.sp_group_name))
    return sq


def _ratio(b, c: float, x: fx.Node) -> fx.Node:
    """c / x, computed as torch computes ``c / tensor`` (reciprocal then scale)."""
    return b(aten.mul.Tensor, b(aten.reciprocal.default, x), c)


def _min1(b, x: fx.Node) -> fx.Node:
    return b(aten.clamp_max.default, x, 1.0)


def _fp32(b, x: fx.Node) -> fx.Node:
    return x if val(x).dtype == torch.float32 else b(aten._to_copy.default, x, dtype=torch.float32)


def _mask_rows(b, keep: fx.Node, x: fx.Node) -> fx.Node:
    """where(keep[b], x[b], 0) for a (B, ...) tensor."""
    shape = [val(keep).shape[0]] + [1] * (val(x).dim() - 1)
    return b(aten.where.ScalarOther, b(aten.view.default, keep, shape), x, 0.0)


def _concat_rows(b, g: PerSampleGrad):
    if len(g.rows) == 1:
        return g.rows[0]
    return (b(aten.cat.default, [i for i, _ in g.rows], 1), b(aten.cat.default, [v for _, v in g.rows], 1))


def _sq_norm(rw: Rewriter, b, g: PerSampleGrad, grams: dict) -> fx.Node:
    """Per-sample squared norm (B,) in float64."""
    if g.only_outer:
        return _ghost_sq_norm(b, *g.outer, grams)
    if g.dense is not None or g.outer:
        x = rw.densify(g)
        shape = val(x).shape
        if len(shape) == 1:
            x = b(aten.view.default, x, [shape[0], 1])
            shape = val(x).shape
        dims = list(range(1, len(shape)))
        chunks = -(-math.prod(shape) // _NORM_CHUNK)
        step = -(-shape[1] // chunks)
        total = None
        for start in range(0, shape[1], step):
            part = x if step == shape[1] else b(aten.slice.Tensor, x, 1, start, min(start + step, shape[1]))
            n = b(aten.linalg_vector_norm.default, part, 2, dims, False, dtype=torch.float64)
            sq = b(aten.mul.Tensor, n, n)
            total = sq if total is None else b(aten.add.Tensor, total, sq)
        return total
    return _rows_sq_norm(b, *_concat_rows(b, g), num_rows=g.shape[0])


def _ghost_sq_norm(b, left: fx.Node, right: fx.Node, grams: dict) -> fx.Node:
    """‖L_bᵀ R_b‖² = ⟨L_b L_bᵀ, R_b R_bᵀ⟩ (Frobenius), from (B, T, T) Grams in float64.

    float64 because the inner product cancels: it sums terms of both signs whose sizes are
    ‖L_b‖²‖R_b‖², far above the result when a sample's tokens pull the weight different
    ways, and an underestimated norm would let the sample through unclipped. The samples
    go in chunks whose float64 copies and Grams take no more bytes than the fp32 per-sample
    gradient they replace; a chunk's Gram of an input several layers read is formed once.
    """
    B, T, m = val(left).shape
    n = val(right).shape[2]
    per_chunk = max(1, B * m * n // (2 * (T * (m + n) + 2 * T * T)))
    parts = []
    for start in range(0, B, per_chunk):
        stop = min(B, start + per_chunk)
        for x in (left, right):
            if (x, start, stop) not in grams:
                x64 = b(aten._to_copy.default, x if stop - start == B else b(aten.slice.Tensor, x, 0, start, stop),
                        dtype=torch.float64)
                grams[x, start, stop] = b(aten.bmm.default, x64, b(aten.transpose.int, x64, 1, 2))
        product = b(aten.mul.Tensor, grams[left, start, stop], grams[right, start, stop])
        parts.append(b(aten.sum.dim_IntList, product, [1, 2]))
    return parts[0] if len(parts) == 1 else b(aten.cat.default, parts)


def _rows_sq_norm(b, indices: fx.Node, values: fx.Node, num_rows: int) -> fx.Node:
    """‖g_b‖² for g_b = sum_j values[b, j] placed at row indices[b, j], from the ids.

    Sort the (sample, row) keys; equal keys are adjacent, so a cumulative count of key
    changes numbers the segments; index_add sums each segment's rows; the squared norms
    of the segment sums add up per sample. Fixed shapes: (B*n, H) at most.
    """
    B, n = val(indices).shape
    H = math.prod(val(values).shape[2:])
    offsets = b(aten.mul.Tensor, b(aten.arange.default, B, device=val(indices).device), num_rows)
    keys = b(aten.view.default, b(aten.add.Tensor, indices, b(aten.unsqueeze.default, offsets, 1)), [B * n])
    sort = b(aten.sort.default, keys)
    sorted_keys, order = b(getitem, sort, 0), b(getitem, sort, 1)
    changed = b(aten.ne.Tensor, b(aten.slice.Tensor, sorted_keys, 0, 1, B * n),
                b(aten.slice.Tensor, sorted_keys, 0, 0, B * n - 1))
    new_segment = b(aten.cat.default, [b(aten.ones.default, [1], dtype=torch.bool, device=val(indices).device), changed])
    segment = b(aten.sub.Tensor, b(aten.cumsum.default, new_segment, 0), 1)
    values64 = b(aten._to_copy.default, values, dtype=torch.float64)
    rows = b(aten.index_select.default, b(aten.view.default, values64, [B * n, H]), 0, order)
    sums = b(aten.index_add.default, b(aten.zeros.default, [B * n, H], dtype=torch.float64, device=val(values).device),
             0, segment, rows)
    seg_sq = b(aten.sum.dim_IntList, b(aten.mul.Tensor, sums, sums), [1])
    sample_of_key = b(aten.div.Tensor_mode, sorted_keys, num_rows, rounding_mode="floor")
    seg_sample = b(aten.scatter.src, b(aten.zeros.default, [B * n], dtype=torch.int64, device=val(indices).device),
                   0, segment, sample_of_key)
    return b(aten.index_add.default, b(aten.zeros.default, [B], dtype=torch.float64, device=val(values).device),
             0, seg_sample, seg_sq)


def _weighted_sum(rw: Rewriter, b, g: PerSampleGrad, factor: fx.Node, keep: fx.Node) -> fx.Node:
    """sum_b factor[b] * g_b in fp32, with padding rows masked out."""
    if g.only_outer:  # book-keeping: one matmul over all tokens
        left, right = g.outer
        B, T, m = val(left).shape
        n = val(right).shape[2]
        scaled = b(aten.mul.Tensor, _mask_rows(b, keep, _fp32(b, left)), b(aten.view.default, factor, [B, 1, 1]))
        right = _mask_rows(b, keep, _fp32(b, right))
        return b(aten.mm.default, b(aten.t.default, b(aten.view.default, scaled, [B * T, m])),
                 b(aten.view.default, right, [B * T, n]))
    if g.dense is not None or g.outer:
        dense = rw.densify(g)
        out = b(aten.einsum.default, "b,b...->...", [factor, _mask_rows(b, keep, _fp32(b, dense))])
        return out
    V, row = g.shape[0], list(g.shape[1:])
    indices, values = _concat_rows(b, g)
    B, n = val(indices).shape
    scaled = b(aten.mul.Tensor, _mask_rows(b, keep, _fp32(b, values)), b(aten.view.default, factor, [B, 1] + [1] * len(row)))
    zeros = b(aten.zeros.default, [V, *row], dtype=torch.float32, device=val(values).device)
    # In place into fresh zeros: one (V, ...) buffer, not two (a large vocabulary's peak).
    return b(aten.index_add_.default, zeros, 0, b(aten.reshape.default, indices, [B * n]),
             b(aten.view.default, scaled, [B * n, *row]))


