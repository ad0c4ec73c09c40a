"""The one dtype rule the ops share."""
from __future__ import annotations

import torch


def accumulation_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype in which values of ``x``'s dtype are accumulated, scaled and summed: fp32 (bf16 and
    fp16 values are exact in it), float64 for float64. Never lower than the input's: attention's
    lse (the CPU kernel's backward takes it in this dtype), the ring's accumulators, the head's
    per-sample gradient (the unrewritten graph's matmul is in this dtype), and the clipped sums'
    scaling (cast to fp32 before it, a float64 value beyond fp32's range with a finite norm would be
    inf, and inf times its factor inf or nan in every coordinate of the sum)."""
    return torch.promote_types(x.dtype, torch.float32)
