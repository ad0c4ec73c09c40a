"""The LM head, its cross-entropy and their gradients, chunk by chunk over the sequence.

``longshield::lm_head_loss`` is what the ``chunked_loss`` pass puts in place of
``logits = h @ w.T`` -> log-softmax -> NLL and their backward. It never holds more than one
chunk's logits: for each chunk of positions it forms the logits, the token losses, the logits'
gradient ``g * (softmax - onehot(y))`` and from it the hidden states' gradient and the head's
per-sample gradient ``sum_t dz_bt ⊗ h_bt`` (a (B, V, d) accumulator), then drops the chunk.
Forward and backward are one op because the joint graph already holds the loss cotangent, so
no logits are kept or recomputed between them.

Rounding follows the unchunked graph: logits in ``h``'s dtype, cast to ``logits_dtype`` for
the softmax, their gradient cast back to ``h``'s dtype before the matmuls. The per-sample
gradient is accumulated over chunks in fp32 and returned in ``w``'s dtype.
"""
from __future__ import annotations

import torch
from torch import Tensor


def workspace_bytes(h: Tensor, w: Tensor, chunk: int, logits_dtype: torch.dtype, weight_grad: bool) -> int:
    """Bytes the op holds beyond its inputs and outputs while a chunk is in flight (an upper
    bound): the chunk's logits in h's dtype, their ``logits_dtype`` copy (turned into the
    gradient in place), its cast back and, for low-precision h, its fp32 copy for the
    accumulator; plus that fp32 (B, V, d) accumulator when w is not fp32."""
    B, T, _ = h.shape
    V, d = w.shape
    chunk_bytes = B * min(chunk, T) * V * (2 * h.element_size() + logits_dtype.itemsize
                                           + (4 if h.dtype != torch.float32 else 0))
    return chunk_bytes + (B * V * d * 4 if weight_grad and w.dtype != torch.float32 else 0)


@torch.library.custom_op("longshield::lm_head_loss", mutates_args=())
def lm_head_loss(h: Tensor, w: Tensor, labels: Tensor, grad: Tensor, chunk: int, ignore_index: int,
                 logits_dtype: torch.dtype, weight_grad: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Token losses, hidden-state gradient and per-sample head gradient of a causal-LM head.

    h: (B, T, d) hidden states; w: (V, d) head weight; labels: (B, T) int64 target of each
    position (``ignore_index``: no loss); grad: (B, T) the loss cotangent of each position.
    Returns loss (B, T) in ``logits_dtype`` (0 where ignored), grad_h (B, T, d) in h's dtype and
    the per-sample gradient of ``w``, (B, V, d) in w's dtype ((B, 0, d) without ``weight_grad``:
    a frozen head). ``chunk``: positions per chunk.
    """
    B, T, d = h.shape
    V = w.shape[0]
    loss = torch.zeros(B, T, dtype=logits_dtype, device=h.device)
    grad_h = torch.empty_like(h, memory_format=torch.contiguous_format)
    per_sample = torch.zeros(B, V if weight_grad else 0, d, dtype=torch.float32, device=h.device)
    wt = w.t()
    for start in range(0, T, chunk):
        stop = min(start + chunk, T)
        hc = h[:, start:stop]
        z = torch.matmul(hc, wt).to(logits_dtype)  # (B, c, V)
        y = labels[:, start:stop]
        counted = y != ignore_index
        target = torch.where(counted, y, 0).unsqueeze(-1)
        # The unchunked graph's kernels on each chunk (log_softmax reduces over V row by row),
        # so each position's loss and gradient round as they would there.
        logp = torch.log_softmax(z, dim=-1)
        loss[:, start:stop] = torch.where(counted, -logp.gather(-1, target).squeeze(-1), 0)
        # d loss / d z = g * (softmax(z) - onehot(y)), formed in logp's buffer.
        g = torch.where(counted, grad[:, start:stop].to(logp.dtype), 0).unsqueeze(-1)
        dz = logp.exp_().mul_(g)
        dz.scatter_add_(-1, target, -g)
        dz = dz.to(h.dtype)
        grad_h[:, start:stop] = torch.matmul(dz, w)
        if weight_grad:
            per_sample.baddbmm_(dz.transpose(1, 2).float(), hc.float())
    return loss, grad_h, per_sample.to(w.dtype)


@lm_head_loss.register_fake
def _(h, w, labels, grad, chunk, ignore_index, logits_dtype, weight_grad):
    B, T, d = h.shape
    return (h.new_empty(B, T, dtype=logits_dtype), torch.empty_like(h, memory_format=torch.contiguous_format),
            w.new_empty(B, w.shape[0] if weight_grad else 0, d))
