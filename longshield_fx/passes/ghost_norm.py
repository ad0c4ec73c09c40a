"""The ``ghost_norm`` pass: per layer, ghost norm + book-keeping instead of per-sample gradients.

Rewrites: a parameter whose per-sample gradient is one einsum over its tokens,
g_b = L_bᵀ R_b with L (B, T, m) and R (B, T, n) (a linear weight: its output gradients and
its inputs, in either orientation), into the ``outer`` form of ``PerSampleGrad`` when the
cost model below prefers it. ``clip`` then never forms the (B, m, n) per-sample gradient
(the einsum dies once ``clip`` replaces the graph's outputs); it computes

- the norm by ghost norm (Li et al. 2022): ‖g_b‖² = ⟨L_b L_bᵀ, R_b R_bᵀ⟩, two (T, T) Gram
  matrices per sample, in float64 (one Gram serves every layer that reads the same input,
  e.g. q, k and v);
- the clipped sum by book-keeping (Bu et al. 2023, DP-ZeRO): Σ_b f_b L_bᵀ R_b over the kept L
  and R, accumulated in float64 with its rounding bound counted in the clip factor (``clip``).

Cost model, per layer: ghost when 2T(m+n) ≤ m·n. The Grams cost B·T²·(m+n) float64
multiply-adds where the per-sample einsum cost B·T·m·n in the compute dtype; counting a
float64 one as two (this CPU; see docs/benchmarks.md), ghost is then no slower, and the L
and R it keeps until the clip (B·T·(m+n) values) are at most half the (B, m, n) per-sample
gradient. DP-ZeRO's rule, 2T² ≤ m·n, compares only the Grams' size with the gradient's;
measured here (``benchmarks/ghost_norm.py``: one Linear(1024, 1024), B=8) ghost took 1.00×
the per-sample time at T=256 but 1.82× at T=512 and 3.43× at T=1024 (B=4), where that rule still
picks it at T=512. So ghost pays for short sequences and wide layers: many samples of short
text, not long documents.

Where it stops paying, and why the pass is not in the pipeline under context parallelism:
a rank holds T/cp tokens of each sample, and its local Grams miss the cross-rank terms
⟨L_r L_sᵀ, R_r R_sᵀ⟩ (r ≠ s). Forming them needs the other ranks' activations (the
output-stationary all-gather, bytes growing with T) while the reduce-scatter of the partial
per-sample gradient (bytes independent of T) gives the norm directly. Long contexts are
also where ghost loses on its own terms: at T = 4096 it needs m·n ≥ 8192·(m+n), which no
Llama 3 layer has (the 8B model's MLP, 14336×4096, pays up to T = 1592).

Packed documents (``ctx.packed_units`` = U): a linear weight's per-unit gradients are products
over the token rows, each unit's own (``longshield::segment_outer`` of two operands); ``clip``
forms them only for the units present and takes each norm as it is formed (the per-unit
method, ``per-sample`` in ``inspect``). The ``outer`` form keeps the two token-row operands instead,
and ``clip`` takes each unit's norm from its own rows (``longshield::segment_sq_norm``: Grams
for a short unit, the unit's product for a long one) and the clipped sum by book-keeping over
the kept units' tokens. Both cost what the tokens and units present cost, never what the U + 1
slots would, so the choice (``packed_prefers_ghost``) compares time, per layer of m·n weights
read by N token rows holding P units of n̄ = N/P tokens, in fp32 multiply-adds:

- per-unit: the products, N·m·n, and per unit a pass over its m·n product (its float64 norm,
  its share of the clipped sum: 45 each) and a matmul call (4·10⁵); the products kept from the
  norms to the sum are bounded by twice the layer's token rows (``products_held``), and any
  further ones are formed a second time;
- ghost: the book-keeping, N·m·n, and the Grams, N·n̄·(m+n) for units of n̄ ≤ W = m·n/(m+n)
  tokens (else each unit's product, N·m·n), all in float64 (4 each).

The constants were measured on one CPU core. Left out: the ghost ops' own overhead (about 1 ms
a layer at N = 2048, gathers and Python), so the rule keeps ghost up to units of about 20
tokens, where per-unit is already the faster from about 12. How many units a batch holds is
known only when it runs; the rule takes P = 4 per row (``expected_units``): a guess at the
units present, never the slots reserved, so the same rows choose the same methods at any U, and
each method's work follows the batch's units.
Either choice is exact for any P.

Assumes: ``per_sample`` ran on a training graph in one process (cp = 1). Guarantees: every
trainable parameter's placeholder has ``meta[NORM_METHOD]``, the method ``clip`` will use
and why; a parameter moved to the ``outer`` form has exactly the same per-sample gradient
(the einsum's operands are kept as they are).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..packing import unit_slots_per_row
from ._context import NORM_METHOD, PER_SAMPLE_GRAD, PER_SAMPLE_RULE, PassContext
from ._graph import val
from .per_sample import PerSampleGrad

aten = torch.ops.aten


def prefers_ghost(T: int, m: int, n: int) -> bool:
    """Ghost norm for a (m, n) weight read by T tokens per sample: its float64 Grams cost no
    more than the per-sample einsum (a float64 multiply-add counted as two), see above."""
    return 2 * T * (m + n) <= m * n


# The packed cost model's constants, in fp32 multiply-adds of a matmul (0.011 ns each on this
# CPU, one core; measured with the segment ops on 2048 tokens and 32x64 to 256x256 weights):
_PER_UNIT_PASS = 45  # each element of a unit's product: its float64 norm, its share of the sum (0.5 ns)
_PER_UNIT_CALL = 400_000  # each unit's matmul call in the grouped matmul (4 µs)
_FLOAT64 = 4  # a float64 multiply-add of the Grams and the book-keeping (bk: 0.9 ms, fp32 mm: 0.25 ms)


def expected_units(rows: int) -> int:
    """The units a packed batch of ``rows`` rows is taken to hold when the graph is built: 4 per
    row. A guess at the units present, not the slots: ``train`` reserves up to 16 per row
    (``packing.unit_slots_per_row``) so that short documents find a slot, and taking every slot
    to hold a unit would price units of a few tokens, for which ghost norm (in float64) wins,
    where a batch of longer units runs twice as slow by it. Not U (the slots reserved): a method,
    and so a value, would then depend on it."""
    return max(1, 4 * rows)


def _held_at_most(N: int, rows: int, m: int, n: int) -> int:
    """``products_held`` before its bound by U: as many as ``train``'s slots, within twice the
    layer's N token rows."""
    slots = rows * unit_slots_per_row(N // rows)
    return max(1, min(slots, 2 * N * (m + n) // (m * n)))


def products_held(N: int, rows: int, U: int, m: int, n: int) -> int:
    """How many per-unit products of an (m, n) weight ``clip`` keeps from their norms to the
    clipped sum (``segment_outer_norms``' capacity): as many as ``train``'s slots (16 per row
    at T = 256, 4 from T = 1024: ``packing.unit_slots_per_row``), at most U, within twice the
    layer's N token rows (the memory the ghost form would keep instead); further ones are formed
    again (the same products: only the speed depends on how many are held). Rows of short
    documents hold more units than the cost model's guess (4 per row): holding only that many,
    a tiny Llama's step on 2 rows of 11 units took 40 ms instead of 30, forming the rest twice."""
    return max(1, min(U, _held_at_most(N, rows, m, n)))


def packed_prefers_ghost(N: int, rows: int, m: int, n: int) -> tuple[bool, str]:
    """Ghost norm for a packed (m, n) weight read by N token rows in ``rows`` rows, and the
    comparison, in multiply-adds (see the module docstring); whatever the unit slots U."""
    units = expected_units(rows)
    tokens = -(-N // units)  # a unit's, on average
    each = _PER_UNIT_PASS * m * n + _PER_UNIT_CALL
    again = max(0, units - _held_at_most(N, rows, m, n))  # products formed a second time
    per_unit = N * m * n + units * each + again * (tokens * m * n + each)
    ghost = _FLOAT64 * (N * m * n + N * min(tokens * (m + n), m * n))
    compare = "≤" if ghost <= per_unit else ">"
    why = f"ghost {ghost:.3g} {compare} per-unit {per_unit:.3g} multiply-adds, {units} units of {tokens} tokens"
    return ghost <= per_unit, why


def ghost_norm(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Move linear weights' per-sample gradients to the ``outer`` form where the cost model
    prefers ghost norm + book-keeping (see the module docstring)."""
    for name in ctx.captured.param_names:
        meta = ctx.param_meta(name)
        g = meta[PER_SAMPLE_GRAD]
        operands = outer_operands(g)
        if operands is None:
            meta[NORM_METHOD] = f"per-sample (rule {meta.get(PER_SAMPLE_RULE, '?')})"
            continue
        left, right = operands
        if ctx.packed_units:
            N, m, n = val(left).shape[0], val(left).shape[1], val(right).shape[1]
            ghost, compare = packed_prefers_ghost(N, gm.meta["packing"].rows, m, n)
        else:
            T, m, n = val(left).shape[1], val(left).shape[2], val(right).shape[2]
            ghost = prefers_ghost(T, m, n)
            compare = f"2T(p+d)={2 * T * (m + n)} {'≤' if ghost else '>'} p·d={m * n}"
        if ghost:
            meta[PER_SAMPLE_GRAD] = PerSampleGrad(g.shape, outer=(left, right))
            meta[NORM_METHOD] = f"ghost ({compare})"
        else:
            meta[NORM_METHOD] = f"per-sample ({compare})"
    return gm


def outer_operands(g: PerSampleGrad) -> tuple[fx.Node, fx.Node] | None:
    """(L, R) with g_b = L_bᵀ R_b if ``g`` is one einsum "btm,btn->bmn", possibly transposed per
    sample or cast (a bf16 weight's gradient cast to its fp32 parameter: ``clip`` forms norms in
    float64 and sums in fp32 from L and R themselves, so the cast's rounding is skipped, not
    added); else None (embeddings' rows, sums, tied or concatenated pieces)."""
    node, swap = g.dense, False
    if g.rows or g.outer or node is None:
        return None
    while True:
        if node.target == aten.permute.default and node.meta.get("per_sample"):
            if list(node.args[1]) != [0, 2, 1]:
                return None
            node, swap = node.args[0], not swap
        elif _is_cast(node):
            node = node.args[0]
        else:
            break
    if node.target == torch.ops.longshield.segment_outer.default:  # packed: token rows
        L, R = node.args[:2]
        return (R, L) if swap else (L, R)
    if node.target != aten.einsum.default or len(node.args[1]) != 2:
        return None
    inputs, out = node.args[0].split("->")
    left, right = inputs.split(",")
    if not (len(left) == len(right) == len(out) == 3 and right[:2] == left[:2] and out == left[0] + left[2] + right[2]):
        return None
    L, R = node.args[1]
    return (R, L) if swap else (L, R)


def _is_cast(node: fx.Node) -> bool:
    """A ``_to_copy`` that changes only the dtype."""
    if node.target != aten._to_copy.default or len(node.args) != 1:
        return False
    kwargs = dict(node.kwargs)
    return (set(kwargs) <= {"dtype", "layout", "device"} and kwargs.get("layout", torch.strided) == torch.strided
            and val(node).device == val(node.args[0]).device)
