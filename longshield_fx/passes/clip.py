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
to fp32 (2**-24; a factor below fp32's smallest normal number, 2**-126, is made 0: its sample
contributes nothing) and the fp32 product remain. Embedding gradients in sparse-row form are
clipped and summed from the token ids without a (B, V, H) tensor.

Packed documents (``ctx.packed_units`` = U): the samples are the U + 1 unit slots of
``per_sample`` (the last holds the padding tokens); a slot is counted when it holds tokens and is
not the padding slot, instead of by the cotangent, which stays 1 per row (the loss is per row;
what a row's padding adds to it is 0). Rows of embedding gradients carry their owner slot.
Norms and clipped sums come from the ops of ``ops/segment.py`` (``_PackedClip``), whose work
follows the tokens and units present, never the U + 1 slots: no (U+1, p, d) tensor is formed
for a linear weight, and no value depends on U.

Layers the ``ghost_norm`` pass moved to the ``outer`` form (g_b = L_bᵀ R_b) get their norms
from float64 Gram matrices (ghost norm) and their clipped sum from matmuls over all samples'
tokens (book-keeping). Both round on the per-token products l_bt r_btᵀ, whose size
A_b = Σ_t ‖l_bt‖‖r_bt‖ can be far above ‖g_b‖ when a sample's tokens cancel, so both are
bounded by A_b, not by ‖g_b‖, and counted against C (see ``_ghost_sq_norm`` and
``_book_keeping``): the squared norm is raised by its rounding bound, the book-keeping sum is
accumulated in float64, and its rounding bound, κ·A_b, joins the clip factor's denominator.
A sample with cancelling tokens is clipped as if its norm were κ·A_b, and then every
contribution, and the whole sum's rounding, stay within C·(1 + 1e-6) measured in float64.
"""
from __future__ import annotations

import math
from operator import getitem

import torch
import torch.fx as fx

from .._torch import c10d
from ._context import CP_SHARD_DIM, PER_SAMPLE_GRAD, PassContext
from ._graph import GraphBuilder, eliminate_dead_code, val
from ..ops._dtypes import accumulation_dtype
from .ghost_norm import outer_operands, products_held
from .per_sample import PerSampleGrad, Rewriter

aten = torch.ops.aten
_EPS = 1e-6
_FP32_TINY = torch.finfo(torch.float32).tiny  # 2**-126: a smaller factor is made 0 (its fp32 rounding is not relative)
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
        packed = _PackedClip(b, rw, ctx) if rw.packing else None
        real_samples = packed.real if packed else real
        grams = {}  # one float64 Gram per ghost-norm operand (q, k and v read the same input)
        sq, token_sizes = {}, {}  # token_sizes: A_b of each ghost layer (see _book_keeping)
        # Each dense per-sample gradient formed once: its norm and its clipped sum read the same
        # values (a CUDA index_add of repeated token ids adds in no fixed order, so two would round apart).
        dense = {}
        for name in names:
            if packed:
                sq[name], size = packed.sq_norm(name, grads[name])
                if size is not None:
                    token_sizes[name] = size
            elif grads[name].only_outer:
                sq[name], token_sizes[name] = _ghost_sq_norm(b, *grads[name].outer, grams)
            else:
                if grads[name].dense is not None or grads[name].outer:
                    dense[name] = rw.densify(grads[name])
                sq[name] = _sq_norm(b, grads[name], dense.get(name), samples=rw.B)
        if ctx.sp_size > 1:
            sq = _all_reduce_shard_norms(b, ctx, sq, per_parameter=cfg.clipping == "per_layer")
        parts = list(sq.values())
        total = parts[0]
        for part in parts[1:]:
            total = b(aten.add.Tensor, total, part)
        norm = b(aten.sqrt.default, total)
        keep = b(aten.logical_and.default, real_samples, b(aten.isfinite.default, norm))
        per_layer = cfg.clipping == "per_layer"
        # Each ghost layer's book-keeping rounding bound, κ·A_b, counted against C. Per layer,
        # the ghost layers' thresholds C/sqrt(K) add up to (ghost layers)/sqrt(K) times C.
        thresholds = len(token_sizes) / math.sqrt(len(names)) if per_layer else 1.0
        rounding = {name: packed.rounding(size, grads[name], thresholds) if packed
                    else b(aten.mul.Tensor, size, _book_keeping_kappa(grads[name], thresholds, rw.B))
                    for name, size in token_sizes.items()}
        if cfg.clipping == "flat":
            denominator = _plus(b, b(aten.add.Scalar, norm, _EPS), rounding.values())
            factors = dict.fromkeys(names, _min1(b, _ratio(b, cfg.max_grad_norm, denominator)))
        elif cfg.clipping == "automatic":
            denominator = _plus(b, b(aten.add.Scalar, norm, cfg.automatic_gamma), rounding.values())
            factors = dict.fromkeys(names, _ratio(b, cfg.max_grad_norm, denominator))
        else:  # per_layer
            threshold = cfg.max_grad_norm / math.sqrt(len(names))
            factors = {}
            for name in names:
                denominator = b(aten.add.Scalar, b(aten.sqrt.default, sq[name]), _EPS)
                denominator = _plus(b, denominator, [rounding[name]] if name in rounding else [])
                factors[name] = _min1(b, _ratio(b, threshold, denominator))
        # A factor below fp32's smallest normal number rounds to fp32 with an error far above 2**-24
        # of it (a gradient norm above ~1e38·C): its sample contributes 0 instead. Once per factor
        # (flat clipping has one for every parameter).
        usable = {}
        for f in factors.values():
            if f not in usable:
                normal = b(aten.logical_and.default, keep, b(aten.ge.Scalar, f, _FP32_TINY))
                usable[f] = b(aten.where.ScalarOther, normal, f, 0.0)
        factors = {name: usable[f] for name, f in factors.items()}
        if packed:
            sums = {name: packed.clipped_sum(name, grads[name], factors[name], keep) for name in names}
        else:
            sums = {name: _book_keeping(b, *grads[name].outer, factors[name], keep) if grads[name].only_outer
                    else _weighted_sum(b, grads[name], _fp32(b, factors[name]), keep, dense.get(name))
                    for name in names}
        sums = [sums[name] for name in ctx.captured.param_names]
        # Packed: the loss is per row and not covered by ε either way; its padding tokens add 0.
        loss_sum = b(aten.sum.default, b(aten.where.ScalarOther, real if rw.packing else keep, loss, 0.0))
        norms = b(aten.where.ScalarOther, real_samples, norm, 0.0)
    output.args = ((loss_sum, norms, *sums),)
    eliminate_dead_code(graph)
    gm.recompile()
    return gm


class _PackedClip:
    """Norms and clipped sums of packed documents' per-unit gradients (see the module docstring),
    each by work that follows the units present, never the U + 1 slots:

    - ``ghost_norm``'s ``outer`` form: ghost norm per unit (``segment_sq_norm``) and book-keeping
      over the kept units' token rows (``segment_book_keeping``);
    - a linear weight's per-unit products (``segment_outer`` of two token-row operands, the
      ``per-unit`` method): each present unit's product formed once, its norm taken as it is
      formed, the products kept until the factors are known (``segment_outer_norms``, as many as
      ``ghost_norm.products_held``; further ones are formed again) and the kept units' scaled and
      summed (``segment_outer_clipped_sum``);
    - any other dense (U+1, ...) per-unit gradient (the head's accumulator, biases, norm
      weights): the rows of the present or kept slots only (``unit_sq_norms``,
      ``unit_weighted_sum``);
    - embedding rows: as unpacked, by owner.

    ``counts`` are the unit slots' token counts, all-reduced over sp ranks (a unit may have its
    tokens on another rank), with the padding slot U given none: it is no sample, and no op
    reads its rows."""

    def __init__(self, b, rw: Rewriter, ctx: PassContext):
        self.b, self.rw, self.packing = b, rw, rw.packing
        self.local = ctx.sp_size == 1  # the token rows hold every token of a unit
        self.counts = self.packing.unit_counts
        if self.local:
            self.position = {n: i for i, n in enumerate(b.graph.nodes)}  # where segment_outer_norms may go
        else:  # a unit's tokens may lie on other ranks too
            self.counts = b(c10d.wait_tensor.default, b(c10d.all_reduce.default, b(aten.clone.default, self.counts),
                                                       "sum", ctx.sp_group_name))
        self.real = b(aten.gt.Scalar, self.counts, 0)  # (U+1,) bool: the unit slots that hold tokens
        self.row_norms = {}  # float64 ‖x_t‖ per ghost operand (q, k and v read the same input)
        self.held = {}  # per-unit products' name -> what segment_outer_clipped_sum reads back
        self.dense = {}  # name -> its (U+1, ...) per-unit gradient

    def sq_norm(self, name: str, g: PerSampleGrad) -> tuple[fx.Node, fx.Node | None]:
        """(U+1,) float64 squared norms, and A_u for a ghost layer (else None)."""
        b = self.b
        if g.only_outer:
            return self._ghost_sq_norm(*g.outer)
        operands = outer_operands(g) if self.local else None
        if operands is not None and val(operands[0]).dim() == 2:  # token rows read by unit (segment_outer)
            left, right = operands
            N, m, n = val(left).shape[0], val(left).shape[1], val(right).shape[1]
            capacity = products_held(N, self.packing.rows, self.packing.U, m, n)
            # Formed where the weight's gradient was, as soon as both operands are: where every
            # product is held, the operands are let go there, not kept (with every layer's)
            # until the clip factors are known (llama3.2-1b, 2 x 32k rows: 98 GiB of them).
            later = max(left, right, self.counts, key=self.position.__getitem__)
            with b.graph.inserting_before(later.next):
                out = b(torch.ops.longshield.segment_outer_norms.default, left, right, self.packing.unit,
                        self.counts, capacity)
                sq, held = b(getitem, out, 0), b(getitem, out, 1)
            self.held[name] = (left, right, held, sq)
            return sq, None
        if g.dense is not None or g.outer:
            self.dense[name] = self.rw.densify(g)
            return b(torch.ops.longshield.unit_sq_norms.default, self.dense[name], self.counts), None
        return _rows_sq_norm(b, *_concat_rows(b, g), num_rows=g.shape[0], samples=self.rw.B), None

    def clipped_sum(self, name: str, g: PerSampleGrad, factor: fx.Node, keep: fx.Node) -> fx.Node:
        """Σ_u factor_u g_u over the kept units, in fp32 (``factor`` is 0 where not ``keep``)."""
        b = self.b
        if g.only_outer:
            return b(torch.ops.longshield.segment_book_keeping.default, *g.outer, self.packing.unit, self.counts,
                     factor, keep)
        if name in self.held:
            left, right, held, sq = self.held[name]
            if val(held).shape[0] >= self.packing.U:  # every unit's product is held: the sum reads no token row
                left = right = None  # so the layer's operands are let go after its norms, as unpacked
            return b(torch.ops.longshield.segment_outer_clipped_sum.default, left, right, self.packing.unit,
                     self.counts, held, sq, _fp32(b, factor), keep)
        if name in self.dense:
            return b(torch.ops.longshield.unit_weighted_sum.default, self.dense[name], _fp32(b, factor), keep)
        return _weighted_sum(b, g, _fp32(b, factor), keep, None)  # embedding rows: never densified here

    def rounding(self, size: fx.Node, g: PerSampleGrad, threshold_sum: float) -> fx.Node:
        """κ_u·A_u, unit u's share of the book-keeping sum's rounding bound (``_book_keeping``), with
        κ_u = γ_{N+1}·(N/n_u)·threshold_sum/2.5e-7 for a unit of n_u of the N token rows: then
        f_u·A_u ≤ C·2.5e-7·n_u/(γ_{N+1}·N·threshold_sum), and over the kept units, whose n_u add up
        to at most N, the sum's rounding γ_{N+1}·Σ_u f_u·A_u stays below 2.5e-7·C, as unpacked.
        Counted by tokens rather than by the U + 1 slots (``_book_keeping_kappa``'s count of
        samples), it depends on no slot count: the same tokens are clipped alike at any U (a unit
        of N/(U+1) tokens gets the unpacked κ; a shorter one more, a longer one less)."""
        b = self.b
        tokens = val(g.outer[0]).shape[0]
        per_token = _gamma(tokens + 1) * tokens * threshold_sum / 2.5e-7
        n_u = b(aten.clamp_min.default, b(aten._to_copy.default, self.counts, dtype=torch.float64), 1.0)
        return b(aten.div.Tensor, b(aten.mul.Tensor, size, per_token), n_u)

    def _ghost_sq_norm(self, left: fx.Node, right: fx.Node) -> tuple[fx.Node, fx.Node]:
        """``_ghost_sq_norm`` for packed documents: L and R are the N token rows, and each unit's
        squared norm comes from its own rows (``longshield::segment_sq_norm``), raised by
        its float64 rounding bound 2·γ_{n_u²+m·n+m+n+1}·A_u² (n_u: the unit's tokens; the op sums
        n_u² Gram terms for a short unit, m·n squares of its product for a long one); A_u sums the
        unit's ‖l_t‖·‖r_t‖ in float64, each operand's row norms formed once."""
        b = self.b
        m, n = val(left).shape[1], val(right).shape[1]
        sq = b(torch.ops.longshield.segment_sq_norm.default, left, right, self.packing.unit, self.counts)
        for x in (left, right):
            if x not in self.row_norms:
                self.row_norms[x] = b(aten.linalg_vector_norm.default, x, 2, [1], False, dtype=torch.float64)
        token_products = b(aten.mul.Tensor, self.row_norms[left], self.row_norms[right])
        size = b(aten.index_add.default, b(aten.zeros.default, [self.packing.U + 1], dtype=torch.float64,
                                           device=val(left).device), 0, self.packing.unit, token_products)
        n_u = b(aten._to_copy.default, self.counts, dtype=torch.float64)
        ku = b(aten.mul.Tensor, b(aten.add.Scalar, b(aten.mul.Tensor, n_u, n_u), m * n + m + n + 1), 2.0 ** -53)
        gamma = b(aten.div.Tensor, ku, b(aten.rsub.Scalar, ku, 1.0))
        bound = b(aten.mul.Tensor, b(aten.mul.Tensor, b(aten.mul.Tensor, size, size), gamma), 2.0)
        return b(aten.add.Tensor, sq, bound), size


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


def _plus(b, x: fx.Node, terms) -> fx.Node:
    for t in terms:
        x = b(aten.add.Tensor, x, t)
    return x


def _min1(b, x: fx.Node) -> fx.Node:
    return b(aten.clamp_max.default, x, 1.0)


def _fp32(b, x: fx.Node) -> fx.Node:
    return _as(b, x, torch.float32)


def _as(b, x: fx.Node, dtype: torch.dtype) -> fx.Node:
    return x if val(x).dtype == dtype else b(aten._to_copy.default, x, dtype=dtype)


def _mask_rows(b, keep: fx.Node, x: fx.Node) -> fx.Node:
    """where(keep[b], x[b], 0) for a (B, ...) tensor."""
    shape = [val(keep).shape[0]] + [1] * (val(x).dim() - 1)
    return b(aten.where.ScalarOther, b(aten.view.default, keep, shape), x, 0.0)


def _concat_rows(b, g: PerSampleGrad) -> tuple:
    """One ``rows`` entry holding all of ``g``'s: (indices, values) per sample, or packed
    (indices, values, owner) flat."""
    if len(g.rows) == 1:
        return g.rows[0]
    dim = 0 if len(g.rows[0]) == 3 else 1
    return tuple(b(aten.cat.default, list(parts), dim) for parts in zip(*g.rows))


def _sq_norm(b, g: PerSampleGrad, dense: fx.Node | None, *, samples: int) -> fx.Node:
    """Per-sample squared norm (B,) in float64 of a gradient held densely (``dense``: its
    ``densify``) or as rows."""
    if dense is not None:
        x = dense
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
    return _rows_sq_norm(b, *_concat_rows(b, g), num_rows=g.shape[0], samples=samples)


def _gamma(k: int) -> float:
    """Higham's γ_k = k·u / (1 − k·u) for float64 (u = 2**-53): a sum or dot product of k terms
    in float64, in any order, is within γ_k · Σ|terms| of the exact value."""
    ku = k * 2.0 ** -53
    return ku / (1 - ku)


def _sample_chunks(B: int, T: int, m: int, n: int) -> list[tuple[int, int]]:
    """Sample ranges whose float64 copies of L and R and (T, T) Grams take no more bytes than
    the fp32 (B, m, n) per-sample gradient the ghost layer replaces."""
    per_chunk = max(1, B * m * n // (2 * (T * (m + n) + 2 * T * T)))
    return [(start, min(B, start + per_chunk)) for start in range(0, B, per_chunk)]


def _float64_rows(b, x: fx.Node, start: int, stop: int) -> fx.Node:
    B = val(x).shape[0]
    return b(aten._to_copy.default, x if stop - start == B else b(aten.slice.Tensor, x, 0, start, stop),
             dtype=torch.float64)


def _ghost_sq_norm(b, left: fx.Node, right: fx.Node, grams: dict) -> tuple[fx.Node, fx.Node]:
    """(an upper bound on ‖L_bᵀ R_b‖², A_b = Σ_t ‖l_bt‖·‖r_bt‖), both (B,) float64.

    ‖L_bᵀ R_b‖² = ⟨L_b L_bᵀ, R_b R_bᵀ⟩ (Frobenius), from (B, T, T) Grams in float64. The
    inner product cancels: it sums T² terms of both signs, each at most ‖l_t‖‖l_s‖‖r_t‖‖r_s‖,
    so its float64 rounding is at most γ_{m+n+1+T²}·A_b², however small the result. That bound
    (doubled, for the rounding of A_b itself) is added, so the norm is never underestimated and
    a sample whose tokens cancel is not let through unclipped. A_b comes free from the Grams'
    diagonals (‖l_t‖², ‖r_t‖²). The samples go in chunks (``_sample_chunks``); a chunk's Gram of
    an input several layers read is formed once.
    """
    B, T, m = val(left).shape
    n = val(right).shape[2]
    sq_parts, size_parts = [], []
    for start, stop in _sample_chunks(B, T, m, n):
        for x in (left, right):
            if (x, start, stop) not in grams:
                x64 = _float64_rows(b, x, start, stop)
                grams[x, start, stop] = b(aten.bmm.default, x64, b(aten.transpose.int, x64, 1, 2))
        gl, gr = grams[left, start, stop], grams[right, start, stop]
        sq_parts.append(b(aten.sum.dim_IntList, b(aten.mul.Tensor, gl, gr), [1, 2]))
        token_products = b(aten.mul.Tensor, b(aten.diagonal.default, gl, 0, 1, 2), b(aten.diagonal.default, gr, 0, 1, 2))
        size_parts.append(b(aten.sum.dim_IntList, b(aten.sqrt.default, token_products), [1]))
    sq = sq_parts[0] if len(sq_parts) == 1 else b(aten.cat.default, sq_parts)
    size = size_parts[0] if len(size_parts) == 1 else b(aten.cat.default, size_parts)
    bound = b(aten.mul.Tensor, b(aten.mul.Tensor, size, size), 2 * _gamma(m + n + 1 + T * T))
    return b(aten.add.Tensor, sq, bound), size


def _book_keeping_kappa(g: PerSampleGrad, threshold_sum: float, samples: int) -> float:
    """κ such that clipping with κ·A_b in the denominator bounds the float64 book-keeping sum's
    rounding, over the whole batch of ``samples`` samples, by 2.5e-7·C (``threshold_sum`` =
    Σ thresholds / C)."""
    tokens = val(g.outer[0]).shape[:-1].numel()
    return _gamma(tokens + 1) * samples * threshold_sum / 2.5e-7


def _book_keeping(b, left: fx.Node, right: fx.Node, factor: fx.Node, keep: fx.Node) -> fx.Node:
    """Σ_b f_b L_bᵀ R_b in float64, chunk by chunk of samples, returned in fp32.

    Why float64, and why the factor holds κ·A_b: the sum's rounding falls on the per-token
    products, not on the (clipped) per-sample gradients. Each of its coordinates is a dot
    product of B·T terms (plus the scaling by f_b), so, in any order of summation, the Frobenius
    error is at most γ_{BT+1}·Σ_b f_b A_b. A factor with κ·A_b in its denominator makes every
    f_b A_b ≤ C/κ, and κ (``_book_keeping_kappa``) then puts the whole error below 2.5e-7·C: a
    sample's own contribution is within C·(1 + 2.5e-7) in float64, and adding or removing a
    sample moves the other samples' rounding by at most 5e-7·C. In fp32 the same bound would
    need κ ~ 10**9 times larger, clipping every sample far below C. The last rounding to fp32
    is relative 2**-24 per coordinate, as for every fp32 gradient.
    """
    B, T, m = val(left).shape
    n = val(right).shape[2]
    total = None
    for start, stop in _sample_chunks(B, T, m, n):
        rows = (stop - start) * T
        part = slice(start, stop)
        scaled = b(aten.mul.Tensor, _float64_rows(b, _mask_rows(b, keep, left), start, stop),
                   b(aten.view.default, _rows_of(b, factor, part, B), [stop - start, 1, 1]))
        r64 = _float64_rows(b, _mask_rows(b, keep, right), start, stop)
        lt = b(aten.t.default, b(aten.view.default, scaled, [rows, m]))
        r64 = b(aten.view.default, r64, [rows, n])
        total = b(aten.mm.default, lt, r64) if total is None else b(aten.addmm.default, total, lt, r64)
    return b(aten._to_copy.default, total, dtype=torch.float32)


def _rows_of(b, x: fx.Node, part: slice, B: int) -> fx.Node:
    return x if part.stop - part.start == B else b(aten.slice.Tensor, x, 0, part.start, part.stop)


def _rows_sq_norm(b, indices: fx.Node, values: fx.Node, owner: fx.Node | None = None, *, num_rows: int,
                  samples: int) -> fx.Node:
    """‖g_b‖² for g_b = sum_j values[b, j] placed at row indices[b, j], from the ids (packed:
    sum over j with owner[j] = b of values[j] placed at row indices[j]).

    Sort the (sample, row) keys; equal keys are adjacent, so a cumulative count of key
    changes numbers the segments; index_add sums each segment's rows; the squared norms
    of the segment sums add up per sample. Fixed shapes: (B*n, H) at most.
    """
    if owner is None:
        B, n = val(indices).shape
        H = math.prod(val(values).shape[2:])
        offsets = b(aten.mul.Tensor, b(aten.arange.default, B, device=val(indices).device), num_rows)
        keys = b(aten.view.default, b(aten.add.Tensor, indices, b(aten.unsqueeze.default, offsets, 1)), [B * n])
    else:
        B, n = 1, val(indices).shape[0]
        H = math.prod(val(values).shape[1:])
        keys = b(aten.add.Tensor, indices, b(aten.mul.Tensor, owner, num_rows))
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
    return b(aten.index_add.default, b(aten.zeros.default, [samples], dtype=torch.float64,
                                        device=val(values).device), 0, seg_sample, seg_sq)


def _weighted_sum(b, g: PerSampleGrad, factor: fx.Node, keep: fx.Node, dense: fx.Node | None) -> fx.Node:
    """sum_b factor[b] * g_b in fp32, with padding rows masked out: of ``dense`` (g's
    ``densify``, the tensor its norm was taken from) where g has one, else of g's rows. A float64
    gradient is scaled in float64 and cast after (``ops._dtypes.accumulation_dtype``: cast first, a kept
    sample's value beyond fp32's range would be inf, and the sum inf or nan everywhere)."""
    if dense is not None:
        acc = accumulation_dtype(val(dense))
        total = b(aten.einsum.default, "b,b...->...", [_as(b, factor, acc), _mask_rows(b, keep, _as(b, dense, acc))])
        return _fp32(b, total)
    V, row = g.shape[0], list(g.shape[1:])
    indices, values, *owner = _concat_rows(b, g)
    acc = accumulation_dtype(val(values))
    if owner:  # packed: each row scaled by its unit's factor, a row of a unit not kept is 0 (even inf/nan)
        shape = [-1] + [1] * len(row)
        factor_of_row = b(aten.view.default, b(aten.index_select.default, _as(b, factor, acc), 0, owner[0]), shape)
        keep_of_row = b(aten.view.default, b(aten.index_select.default, keep, 0, owner[0]), shape)
        scaled = b(aten.where.ScalarOther, keep_of_row, b(aten.mul.Tensor, _as(b, values, acc), factor_of_row), 0.0)
        zeros = b(aten.zeros.default, [V, *row], dtype=torch.float32, device=val(values).device)
        return b(aten.index_add_.default, zeros, 0, indices, _fp32(b, scaled))
    B, n = val(indices).shape
    scaled = b(aten.mul.Tensor, _mask_rows(b, keep, _as(b, values, acc)),
               b(aten.view.default, _as(b, factor, acc), [B, 1] + [1] * len(row)))
    scaled = _fp32(b, scaled)
    zeros = b(aten.zeros.default, [V, *row], dtype=torch.float32, device=val(values).device)
    # In place into fresh zeros: one (V, ...) buffer, not two (a large vocabulary's peak).
    return b(aten.index_add_.default, zeros, 0, b(aten.reshape.default, indices, [B * n]),
             b(aten.view.default, scaled, [B * n, *row]))


