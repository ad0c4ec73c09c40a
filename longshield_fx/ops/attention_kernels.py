"""Attention kernels of one block, the only device-specific code of the attention ops.

On CUDA: flash for fp16/bf16, memory-efficient for fp32 and for any block under a document mask
(all return lse), cuDNN's causal kernel for a row that is one document run on Hopper and later
(``ops.document_attention``). The CPU tests exercise only the CPU branch;
benchmarks/gpu_check.py checks the CUDA ones. Also the layouts the ops' results take, and the
GQA head expansion the kernels need.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ._dtypes import accumulation_dtype

aten = torch.ops.aten


def _block_fwd(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float,
               allowed: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Attention of one block -> (out, lse (B, H, Lq) natural log, in ``accumulation_dtype``). ``allowed``
    (B, 1, Lq, Lk) bool: the document mask (causality folded in); rows with no allowed key get lse = -inf."""
    bias = None if allowed is None else _bias(allowed, q)
    keyless_rows = bias is not None and not causal  # a diagonal (causal) block: every query sees itself
    causal = causal and bias is None
    if q.device.type == "cuda":
        if bias is None and q.dtype in (torch.float16, torch.bfloat16):
            out, lse, *_ = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        else:
            out, lse, *_ = aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, causal, scale=scale)
            lse = lse[..., : q.shape[2]]  # efficient attention pads lse to a multiple of 32
    else:
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias, scale=scale)
    lse = lse.to(accumulation_dtype(q))
    return out, lse.masked_fill(~allowed.any(-1), float("-inf")) if keyless_rows else lse


def _block_bwd(
    go: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float,
    allowed: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    bias = None if allowed is None else _bias(allowed, q)
    causal = causal and bias is None
    if q.device.type == "cuda":
        Lq, Lk = q.shape[2], k.shape[2]
        if bias is None and q.dtype in (torch.float16, torch.bfloat16):
            seed = torch.empty(2, dtype=torch.int64, device=q.device)  # unused without dropout
            offset = torch.empty((), dtype=torch.int64, device=q.device)
            return aten._scaled_dot_product_flash_attention_backward(
                go, q, k, v, out, lse, None, None, Lq, Lk, 0.0, causal, seed, offset, scale=scale
            )
        pad = -Lq % 32
        lse = torch.nn.functional.pad(lse, (0, pad)) if pad else lse
        seed = torch.empty((), dtype=torch.int64)
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            go, q, k, v, bias, out, lse, seed, seed, 0.0, [True, True, True, False], causal, scale=scale
        )
        return dq, dk, dv
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(
        go, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale
    )


def _cudnn(q: Tensor) -> bool:
    """Whether a row that is one document run (cp = 1) goes to cuDNN's causal attention: on Hopper
    and later, where its kernel is the fast one (an H200 at T = 32k, forward + backward: 36 ms
    against FA2's 56, benchmarks/results/gpu_h200.md), unless the user switched cuDNN's SDPA off.
    The ring's blocks (cp > 1) stay on flash: their backward takes the merged out and lse, which no
    GPU has checked with cuDNN's kernel yet (``benchmarks/gpu_check.py``'s ``ring_merge_exactness``)."""
    D = q.shape[-1]
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and D <= 128 and D % 8 == 0
            and torch.backends.cudnn.is_available() and torch.backends.cuda.cudnn_sdp_enabled()
            and torch.cuda.get_device_capability(q.device) >= (9, 0))


def _cudnn_fwd(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    out, lse, *_ = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
    return out, lse.to(accumulation_dtype(q)).reshape(q.shape[:3])


def _cudnn_bwd(go: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
               scale: float) -> tuple[Tensor, Tensor, Tensor]:
    unused = torch.zeros((), dtype=torch.int64, device=q.device)  # the dropout seed and offset: no dropout
    B, H, Lq, D = q.shape
    return aten._scaled_dot_product_cudnn_attention_backward(
        go.contiguous(), q, k, v, out.contiguous(), lse.reshape(B, H, Lq, 1).contiguous(), unused, unused, None, None,
        None, Lq, k.shape[2], 0.0, causal, scale=scale)


def _bias(allowed: Tensor, q: Tensor) -> Tensor:
    """The additive mask the kernels take (a boolean one must be in q's dtype on the CPU)."""
    B, _, Lq, Lk = allowed.shape
    bias = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(~allowed, float("-inf"))
    return bias.expand(B, q.shape[1], Lq, Lk) if q.device.type == "cuda" else bias


def _expand_heads(x: Tensor, groups: int) -> Tensor:
    """(B, Hkv, L, D) -> (B, Hkv*groups, L, D), query head h uses kv head h // groups."""
    if groups == 1:
        return x
    B, H, L, D = x.shape
    return x[:, :, None].expand(B, H, groups, L, D).reshape(B, H * groups, L, D)


def _reduce_heads(x: Tensor, groups: int) -> Tensor:
    if groups == 1:
        return x
    B, H, L, D = x.shape
    return x.view(B, H // groups, groups, L, D).sum(2)


def _flash_layout(x: Tensor) -> Tensor:
    """A copy of x (B, H, L, ...) with the strides the CPU flash kernels give: heads inner to L.

    The captured graph around attention was traced with those strides (it views the
    output after ``transpose(1, 2)``), so the ring ops must return the same layout. Always a
    copy: with one head ``contiguous()`` would return x itself, and dk/dv (views of one
    buffer) would alias, which a custom op's outputs may not.
    """
    return _empty_flash_layout(x.shape, x).copy_(x)


def _empty_flash_layout(shape, like: Tensor, dtype=None) -> Tensor:
    B, H, L, *rest = shape
    return like.new_empty((B, L, H, *rest), dtype=dtype or like.dtype).transpose(1, 2)
