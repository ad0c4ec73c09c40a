"""``longshield::segment_outer``: one outer-product sum per contiguous segment of rows.

With packed documents (``compile(..., packed_units=U)``) a linear layer's per-unit weight
gradient is ``sum over the unit's tokens of g_t x_tᵀ``. Sorting the tokens by unit makes every
unit a contiguous segment of rows, and the per-unit gradients are then one grouped matmul:
the same FLOPs as the layer's ordinary weight gradient, never U times them (a one-hot
einsum would multiply by U).

``segment_outer(a, b, counts)``: ``a`` (N, p) and ``b`` (N, d) hold the rows sorted by
segment, ``counts`` (S,) int64 how many rows each segment holds (sum N); returns (S, p, d)
with ``out[s] = a[rows of s]ᵀ @ b[rows of s]`` (zero for an empty segment). For fp32/bf16/fp16
operands whose rows are 16-byte aligned it is one grouped matmul (CPU or CUDA); else one
matmul per segment (exact, any dtype).
"""
from __future__ import annotations

import torch

from .._torch import grouped_mm


def _grouped_mm_fits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype in (torch.float32, torch.bfloat16, torch.float16) and a.dtype == b.dtype
            and (a.shape[1] * a.element_size()) % 16 == 0 and (b.shape[1] * b.element_size()) % 16 == 0)


@torch.library.custom_op("longshield::segment_outer", mutates_args=())
def segment_outer(a: torch.Tensor, b: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    S, p, d = counts.shape[0], a.shape[1], b.shape[1]
    if _grouped_mm_fits(a, b):
        offsets = counts.cumsum(0).to(torch.int32)
        return grouped_mm(a.contiguous().t(), b.contiguous(), offsets)
    out = a.new_zeros(S, p, d)
    start = 0
    for s, n in enumerate(counts.tolist()):
        if n:
            out[s] = a[start:start + n].t() @ b[start:start + n]
        start += n
    return out


@segment_outer.register_fake
def _(a, b, counts):
    return a.new_empty(counts.shape[0], a.shape[1], b.shape[1])


@torch.library.custom_op("longshield::segment_sq_norm", mutates_args=())
def segment_sq_norm(a: torch.Tensor, b: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """(S,) float64: ``‖a[rows of s]ᵀ @ b[rows of s]‖²`` (Frobenius) of each segment, in float64,
    without holding the S products. A segment of n ≤ W = p·d/(p+d) rows (its two Grams cost no
    more than its product) by ghost norm, ⟨a_s a_sᵀ, b_s b_sᵀ⟩, all such segments at once: the
    rows cut into tiles of W, Grams of each tile with itself and with the next (a short segment
    spans at most two tiles), each entry kept where both rows are of one segment. A longer
    segment from its product, one at a time. Either way the float64 rounding is within
    2·γ_{n²+p·d+p+d+1}·A_s² of the exact value (A_s = Σ_t ‖a_t‖·‖b_t‖; ``clip`` adds that bound:
    the Grams' inner product sums n² terms, the product's squares p·d). A non-finite segment
    is non-finite alone: no other segment's norm reads its rows."""
    S, N, p, d = counts.shape[0], a.shape[0], a.shape[1], b.shape[1]
    W = max(1, p * d // (p + d))
    out = torch.zeros(S, dtype=torch.float64, device=a.device)
    segment = torch.repeat_interleave(torch.arange(S, device=a.device), counts, output_size=N)
    short = counts[segment] <= W
    K = -(-N // W)

    def tiles(x):
        x = torch.where(short[:, None], x.double(), 0.0)
        return torch.cat([x, x.new_zeros(K * W - N, x.shape[1])]).view(K, W, x.shape[1])

    x, y = tiles(a), tiles(b)
    seg = torch.cat([segment, segment.new_full((K * W - N,), -1)]).view(K, W)
    same = seg[:, :, None] == seg[:, None, :]
    # where, not a product with the mask: another segment's inf or nan times 0 would be nan here.
    row_sums = torch.where(same, (x @ x.transpose(1, 2)) * (y @ y.transpose(1, 2)), 0.0).sum(2)
    if K > 1:  # a segment spanning tiles k and k+1: its cross terms, counted twice (both orders)
        cross = torch.where(seg[:-1, :, None] == seg[1:, None, :],
                            (x[:-1] @ x[1:].transpose(1, 2)) * (y[:-1] @ y[1:].transpose(1, 2)), 0.0)
        row_sums[:-1] += 2 * cross.sum(2)
    out.index_add_(0, seg.view(-1).clamp(min=0), torch.where(seg.view(-1) >= 0, row_sums.view(-1), 0.0))
    start = 0
    for s, n in enumerate(counts.tolist()):
        if n > W:
            out[s] = (a[start:start + n].double().t() @ b[start:start + n].double()).pow(2).sum()
        start += n
    return out


@segment_sq_norm.register_fake
def _(a, b, counts):
    return a.new_empty(counts.shape[0], dtype=torch.float64)
