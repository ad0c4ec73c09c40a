"""The LM head, its cross-entropy and their gradients, chunk by chunk over the sequence.

``longshield::lm_head_loss`` is what the ``chunked_loss`` pass puts in place of
``logits = h @ w.T`` -> log-softmax -> NLL and their backward. It never holds more than one
chunk's logits: for each chunk of positions it forms the logits, the token losses, the logits'
gradient ``g * (softmax - onehot(y))`` and from it the hidden states' gradient and the head's
per-sample gradient ``sum_t dz_bt ⊗ h_bt`` (a (B, V, d) accumulator; with packed documents one
per unit slot), then drops the chunk.
Forward and backward are one op because the joint graph already holds the loss cotangent, so
no logits are kept or recomputed between them.

The chunk's logits live in one buffer: the softmax and then its gradient are formed in place
(``exp(z - max)``, its row sums, then ``g * (p - onehot(y))``), where ``log_softmax`` would
need a second buffer for its output. Rounding follows the unchunked graph: logits in ``h``'s
dtype, the softmax in ``logits_dtype`` computed at least in fp32 (``log_softmax``'s own
accumulation type), the gradient cast back to ``h``'s dtype before the matmuls. Each position's
loss is ``log(sum) - (z_y - max)``, the terms ``log_softmax`` computes, so the two agree to an
ulp (the row sum's order may differ). The per-sample gradient is accumulated over chunks in
fp32 and returned in ``w``'s dtype.
"""
from __future__ import annotations

import torch
from torch import Tensor


def workspace_bytes(h: Tensor, w: Tensor, chunk: int, logits_dtype: torch.dtype, weight_grad: bool,
                    slots: int = 0) -> int:
    """Bytes the op holds beyond its inputs and outputs while a chunk is in flight (an upper
    bound): the chunk's logits in the softmax's dtype (``logits_dtype``, at least fp32; softmax
    and gradient are formed in that buffer), their matmul output in h's dtype when it differs
    (cast from, and back to), and for low-precision h the fp32 copy of the gradient for the
    accumulator; plus that fp32 (B or ``slots``, V, d) accumulator when w is not fp32; per unit
    slot, the chunk's rows sorted by unit (a copy of its gradient and hidden states). On CUDA,
    low-precision factors reach the accumulator without fp32 copies (``_add_product``), so
    there the bound is loose by those copies."""
    B, T, d_h = h.shape
    V, d = w.shape
    work = torch.promote_types(logits_dtype, torch.float32)
    per_logit = (work.itemsize + (h.element_size() if h.dtype != work else 0)
                 + (4 if h.dtype != torch.float32 else 0))
    rows = B * min(chunk, T)
    sorted_copy = rows * (V + d_h) * 4 if slots else 0
    samples = slots or B
    return rows * V * per_logit + sorted_copy + (samples * V * d * 4 if weight_grad and w.dtype != torch.float32 else 0)


@torch.library.custom_op("longshield::lm_head_loss", mutates_args=())
def lm_head_loss(h: Tensor, w: Tensor, labels: Tensor, grad: Tensor, chunk: int, ignore_index: int,
                 logits_dtype: torch.dtype, weight_grad: bool, units: Tensor | None = None,
                 slots: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Token losses, hidden-state gradient and per-sample head gradient of a causal-LM head.

    h: (B, T, d) hidden states; w: (V, d) head weight; labels: (B, T) int64 target of each
    position (``ignore_index``: no loss); grad: (B, T) the loss cotangent of each position.
    Returns loss (B, T) in ``logits_dtype`` (0 where ignored), grad_h (B, T, d) in h's dtype and
    the per-sample gradient of ``w``, (B, V, d) in w's dtype ((B, 0, d) without ``weight_grad``:
    a frozen head). ``chunk``: positions per chunk.

    Packed documents: ``units`` (B, T) int64 names each position's unit slot, and the
    per-sample gradient is per slot, (``slots``, V, d): each slot's positions summed, one
    matmul per slot present in a chunk over its rows (the FLOPs of the per-row form, never
    ``slots`` times them).
    """
    B, T, d = h.shape
    V = w.shape[0]
    loss = torch.zeros(B, T, dtype=logits_dtype, device=h.device)
    grad_h = torch.empty_like(h, memory_format=torch.contiguous_format)
    per_sample = torch.zeros(slots if units is not None else B, V if weight_grad else 0, d, dtype=torch.float32,
                             device=h.device)
    wt = w.t()
    work = torch.promote_types(logits_dtype, torch.float32)  # log_softmax accumulates in this
    for start in range(0, T, chunk):
        stop = min(start + chunk, T)
        hc = h[:, start:stop]
        y = labels[:, start:stop]
        counted = y != ignore_index
        target = torch.where(counted, y, 0).unsqueeze(-1)
        g = torch.where(counted, grad[:, start:stop].to(work), 0).unsqueeze(-1)
        z = torch.matmul(hc, wt).to(work)  # (B, c, V), the chunk's one logits buffer
        # log_softmax's own terms, row by row over V: z - max, the log of the sum of its exp.
        z.sub_(z.amax(-1, keepdim=True))
        z_y = z.gather(-1, target)
        total = z.exp_().sum(-1, keepdim=True)
        loss[:, start:stop] = torch.where(counted, (total.log() - z_y).squeeze(-1), 0)
        # d loss / d z = g * (softmax(z) - onehot(y)), in the same buffer.
        z.div_(total).mul_(g).scatter_add_(-1, target, -g)
        dz = z.to(h.dtype)
        del z  # a cast made a copy: the softmax's buffer goes before the fp32 one comes
        grad_h[:, start:stop] = torch.matmul(dz, w)
        if weight_grad and units is None:
            _add_product(per_sample, dz.transpose(1, 2), hc)
        elif weight_grad:
            _add_per_unit(per_sample, dz, hc, units[:, start:stop])
    return loss, grad_h, per_sample.to(w.dtype)


def _add_per_unit(per_unit: Tensor, dz: Tensor, hc: Tensor, units: Tensor) -> None:
    """``per_unit[s] += Σ_{positions of slot s} dz_t ⊗ h_t`` for the slots present in the chunk."""
    order = units.reshape(-1).argsort(stable=True)
    counts = torch.bincount(units.reshape(-1), minlength=per_unit.shape[0]).tolist()
    dz_sorted = dz.reshape(-1, dz.shape[-1]).index_select(0, order)
    h_sorted = hc.reshape(-1, hc.shape[-1]).index_select(0, order)
    start = 0
    for slot, n in enumerate(counts):
        if n:
            _add_product(per_unit[slot], dz_sorted[start:start + n].t(), h_sorted[start:start + n])
        start += n


def _add_product(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """``acc += a @ b`` (batched when ``acc`` is 3-d) into the float32 ``acc``.

    On CUDA, bf16 / fp16 factors go to the tensor cores as they are, accumulating in float32:
    the same products as upcasting them first (a product of two bf16 values is exact in
    float32), summed in another order, 12x faster on an H200, since float32 GEMMs with TF32 off
    run on the SIMT cores. Elsewhere they are upcast.
    """
    if acc.is_cuda and a.dtype in (torch.bfloat16, torch.float16):
        (torch.baddbmm if acc.dim() == 3 else torch.addmm)(acc, a, b, out_dtype=torch.float32, out=acc)
    elif acc.dim() == 3:
        acc.baddbmm_(a.float(), b.float())
    else:
        acc.addmm_(a.float(), b.float())


@lm_head_loss.register_fake
def _(h, w, labels, grad, chunk, ignore_index, logits_dtype, weight_grad, units=None, slots=0):
    B, T, d = h.shape
    return (h.new_empty(B, T, dtype=logits_dtype), torch.empty_like(h, memory_format=torch.contiguous_format),
            w.new_empty(slots if units is not None else B, w.shape[0] if weight_grad else 0, d))
