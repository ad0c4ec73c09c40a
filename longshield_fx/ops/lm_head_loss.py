"""The LM head, its cross-entropy and their gradients, chunk by chunk over the sequence.

``longshield::lm_head_loss`` is what the ``chunked_loss`` pass puts in place of
``logits = h @ w.T`` -> log-softmax -> NLL and their backward. It never holds more than one
chunk's logits: for each chunk of positions it forms the logits, the token losses, the logits'
gradient ``dz = g * (softmax - onehot(y))`` and from it the hidden states' gradient and the
head's per-sample gradient ``sum_t dz_bt ⊗ h_bt``, then drops the chunk's logits.
Forward and backward are one op because the joint graph already holds the loss cotangent, so
no logits are kept or recomputed between them.

The head's per-sample gradient comes in one of three forms (the op's third output):

- one row per sample (no ``units``, not ``rows``): a (B, V, d) accumulator;
- packed documents, dense (``units``): a (``slots``, V, d) accumulator, one per unit slot, each
  chunk's rows summed per slot present in it;
- packed documents, rows (``rows``): the logits' gradient itself, (N, V) for the N = B·T
  positions, row-major. With the hidden rows in the same order it is the two-operand form of a
  linear layer's per-unit gradient (``segment_outer`` of the two, each unit's rows named by its
  slot; ghost norm and book-keeping in ``clip``), and no (slots, V, d) tensor is made.
  Memory: N·V values in h's dtype instead of slots·V·d in fp32. That is the size of the
  whole batch's logits, which the chunking otherwise never holds at once, so ``chunked_loss``
  asks for it only where it (with the hidden rows) is smaller than the dense form.

The chunk's logits live in one buffer: the softmax and then its gradient are formed in place
(``exp(z - max)``, its row sums, then ``g * (p - onehot(y))``), where ``log_softmax`` would
need a second buffer for its output. Rounding follows the unchunked graph: logits in ``h``'s
dtype, the softmax in ``logits_dtype`` computed at least in fp32 (``log_softmax``'s own
accumulation type), the gradient cast back to ``h``'s dtype before the matmuls (and stored so
in the rows form). Each position's loss is ``log(sum) - (z_y - max)``, the terms
``log_softmax`` computes, so the two agree to an ulp (the row sum's order may differ). The
dense per-sample gradients are accumulated over chunks in fp32 and returned in ``w``'s dtype.

``longshield::head_weight_grad`` is the head's (summed) weight gradient ``dzᵀ h`` from the
rows form: the node the ``chunked_loss`` pass puts where the graph's weight gradient was, whose
per-sample rule gives ``per_sample`` the two operands.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ._dtypes import accumulation_dtype


def workspace_bytes(h: Tensor, w: Tensor, chunk: int, logits_dtype: torch.dtype, weight_grad: bool,
                    slots: int = 0, rows: bool = False) -> int:
    """Bytes the op holds beyond its inputs and outputs while a chunk is in flight (an upper
    bound): the chunk's logits in the softmax's dtype (``logits_dtype``, at least fp32; softmax
    and gradient are formed in that buffer), their matmul output in h's dtype when it differs
    (cast from, and back to), and for low-precision h the fp32 copy of the gradient for the
    accumulator; plus that fp32 (B or ``slots``, V, d) accumulator when w is in low precision; per unit
    slot (dense), the chunk's rows sorted by unit (a copy of its gradient and hidden states);
    and the chunk's hidden rows as one (B·c, d) copy where the slice is strided. The rows form
    (``rows``) has no accumulator and no other copies: the chunk's gradient goes straight into
    the (N, V) output. On CUDA,
    low-precision factors reach the accumulator without fp32 copies (``_add_product``), so
    there the bound is loose by those copies."""
    B, T, d_h = h.shape
    V, d = w.shape
    work = torch.promote_types(logits_dtype, torch.float32)
    chunk_rows = B * min(chunk, T)
    cast = h.element_size() if h.dtype != work else 0
    hidden_rows = chunk_rows * d_h * h.element_size() if B > 1 and chunk < T else 0
    if rows:
        return chunk_rows * V * (work.itemsize + cast) + hidden_rows
    acc = accumulation_dtype(w)
    per_logit = work.itemsize + cast + (acc.itemsize if h.dtype != acc else 0)
    sorted_copy = chunk_rows * (V + d_h) * max(4, h.element_size()) if slots else 0
    samples = slots or B
    accumulator = samples * V * d * acc.itemsize if weight_grad and w.dtype != acc else 0
    return chunk_rows * V * per_logit + sorted_copy + accumulator + hidden_rows


@torch.library.custom_op("longshield::lm_head_loss", mutates_args=())
def lm_head_loss(h: Tensor, w: Tensor, labels: Tensor, grad: Tensor, chunk: int, ignore_index: int,
                 logits_dtype: torch.dtype, weight_grad: bool, units: Tensor | None = None,
                 slots: int = 0, rows: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """Token losses, hidden-state gradient and per-sample head gradient of a causal-LM head.

    h: (B, T, d) hidden states; w: (V, d) head weight; labels: (B, T) int64 target of each
    position (``ignore_index``: no loss); grad: (B, T) the loss cotangent of each position.
    Returns loss (B, T) in ``logits_dtype`` (0 where ignored), grad_h (B, T, d) in h's dtype and
    the per-sample gradient of ``w``, (B, V, d) in w's dtype ((B, 0, d) without ``weight_grad``:
    a frozen head). ``chunk``: positions per chunk.

    Packed documents, dense: ``units`` (B, T) int64 names each position's unit slot, and the
    per-sample gradient is per slot, (``slots``, V, d): each slot's positions summed, one
    matmul per slot present in a chunk over its rows (the FLOPs of the per-row form, never
    ``slots`` times them).

    Packed documents, rows (``rows``): the third output is the logits' gradient (B·T, V) in h's
    dtype, its row i that of position i, row-major (see the module docstring). Needs
    ``weight_grad``.
    """
    B, T, d = h.shape
    loss = torch.zeros(B, T, dtype=logits_dtype, device=h.device)
    grad_h = torch.empty_like(h, memory_format=torch.contiguous_format)
    head = _HeadGrad(h, w, weight_grad, units, slots, rows)
    wt = w.t()
    work = torch.promote_types(logits_dtype, torch.float32)  # log_softmax accumulates in this
    for start in range(0, T, chunk):
        stop = min(start + chunk, T)
        # the chunk's rows (B·c, d), one matmul over them as the unchunked graph's over all rows
        # (on the strided slice matmul runs B small ones: 3.5x slower on the CPU at B = 128, c = 8)
        hc_rows = h[:, start:stop].reshape(-1, d)
        loss[:, start:stop], dz = _chunk(hc_rows, wt, labels[:, start:stop], grad[:, start:stop], ignore_index, work)
        grad_h[:, start:stop] = torch.matmul(dz, w)
        head.add(dz, hc_rows, start, stop)
    return loss, grad_h, head.result()


def _chunk(hc_rows: Tensor, wt: Tensor, y: Tensor, grad: Tensor, ignore_index: int,
           work: torch.dtype) -> tuple[Tensor, Tensor]:
    """One chunk's token losses (in ``work``) and logits' gradient (in the rows' dtype), (B, c)
    and (B, c, V), from its hidden rows (B·c, d) and the (B, c) targets ``y``."""
    counted = y != ignore_index
    target = torch.where(counted, y, 0).unsqueeze(-1)
    g = torch.where(counted, grad.to(work), 0).unsqueeze(-1)
    z = torch.mm(hc_rows, wt).view(*y.shape, -1).to(work)  # (B, c, V), the chunk's one logits buffer
    # log_softmax's own terms, row by row over V: z - max, the log of the sum of its exp.
    z.sub_(z.amax(-1, keepdim=True))
    z_y = z.gather(-1, target)
    total = z.exp_().sum(-1, keepdim=True)
    loss = torch.where(counted, (total.log() - z_y).squeeze(-1), 0)
    # d loss / d z = g * (softmax(z) - onehot(y)), in the same buffer.
    z.div_(total).mul_(g).scatter_add_(-1, target, -g)
    # A cast makes a copy: the softmax's buffer goes on return, before the caller's next chunk.
    return loss, z.to(hc_rows.dtype)


class _HeadGrad:
    """The head's per-sample gradient in the form the op was asked for (module docstring)."""

    def __init__(self, h: Tensor, w: Tensor, weight_grad: bool, units: Tensor | None, slots: int,
                 rows: bool):
        B, T, d = h.shape
        V = w.shape[0]
        self.w_dtype, self.units = w.dtype, units
        if rows:
            if not weight_grad:
                raise ValueError("lm_head_loss: rows (the rows form) needs weight_grad")
            self.rows = h.new_empty(B * T, V)
            self.acc = None
        else:
            self.rows = None
            self.acc = torch.zeros(slots if units is not None else B, V if weight_grad else 0, d,
                                   dtype=accumulation_dtype(w), device=h.device)

    def add(self, dz: Tensor, hc_rows: Tensor, start: int, stop: int) -> None:
        """Take one chunk's logits' gradient ``dz`` (B, c, V) and hidden rows ``hc_rows`` (B·c, d)."""
        if self.rows is not None:
            self.rows.view(dz.shape[0], -1, dz.shape[-1])[:, start:stop] = dz
        elif not self.acc.shape[1]:
            return  # a frozen head
        elif self.units is None:
            _add_product(self.acc, dz.transpose(1, 2), hc_rows.view(*dz.shape[:2], -1))
        else:
            _add_per_unit(self.acc, dz, hc_rows, self.units[:, start:stop])

    def result(self) -> Tensor:
        return self.rows if self.rows is not None else self.acc.to(self.w_dtype)


def _add_per_unit(per_unit: Tensor, dz: Tensor, h_rows: Tensor, units: Tensor) -> None:
    """``per_unit[s] += Σ_{positions of slot s} dz_t ⊗ h_t`` for the slots present in the chunk
    (a loop over those, not over every slot).

    The chunk's positions read row after row lie in runs of one slot (a unit continued in the
    next row is one run across the row end). Where there are at most twice as many runs as
    slots, each run is one product on the rows where they lie, and runs of one length whose
    slots follow one another (units of whole rows: long documents) are one batched product, as
    ``segment._evenly_spaced`` units' products are; otherwise the positions are sorted by slot
    and gathered, one product per slot (a gathered copy of the chunk's gradient costs about what
    a few products' calls do)."""
    flat = units.reshape(-1)
    dz_rows = dz.reshape(-1, dz.shape[-1])
    starts = torch.cat([flat.new_zeros(1), (flat[1:] != flat[:-1]).nonzero().flatten() + 1])
    run_slots = flat.index_select(0, starts)
    bounds, slots = starts.tolist() + [flat.numel()], run_slots.tolist()
    m, n = len(slots), flat.numel() // len(slots)
    if m > 1 and bounds == list(range(0, flat.numel() + 1, n)) and slots == list(range(slots[0], slots[0] + m)):
        _add_product(per_unit[slots[0]:slots[0] + m], dz_rows.view(m, n, -1).transpose(1, 2), h_rows.view(m, n, -1))
        return
    if m <= 2 * len(set(slots)):
        for slot, start, stop in zip(slots, bounds[:-1], bounds[1:]):
            _add_product(per_unit[slot], dz_rows[start:stop].t(), h_rows[start:stop])
        return
    slot_of, order = flat.sort(stable=True)
    present, counts = torch.unique_consecutive(slot_of, return_counts=True)
    dz_sorted, h_sorted = dz_rows.index_select(0, order), h_rows.index_select(0, order)
    start = 0
    for slot, n in zip(present.tolist(), counts.tolist()):
        _add_product(per_unit[slot], dz_sorted[start:start + n].t(), h_sorted[start:start + n])
        start += n


def _add_product(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """``acc += a @ b`` (batched when ``acc`` is 3-d) into ``acc`` (fp32, or float64).

    On CUDA, bf16 / fp16 factors go to the tensor cores as they are, accumulating in float32:
    the same products as upcasting them first (a product of two bf16 values is exact in
    float32), summed in another order, 12x faster on an H200, since float32 GEMMs with TF32 off
    run on the SIMT cores. Elsewhere they are upcast.
    """
    if acc.is_cuda and a.dtype in (torch.bfloat16, torch.float16):
        (torch.baddbmm if acc.dim() == 3 else torch.addmm)(acc, a, b, out_dtype=torch.float32, out=acc)
    elif acc.dim() == 3:
        acc.baddbmm_(a.to(acc.dtype), b.to(acc.dtype))
    else:
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


@lm_head_loss.register_fake
def _(h, w, labels, grad, chunk, ignore_index, logits_dtype, weight_grad, units=None, slots=0, rows=False):
    B, T, d = h.shape
    if rows:
        head = h.new_empty(B * T, w.shape[0])
    else:
        head = w.new_empty(slots if units is not None else B, w.shape[0] if weight_grad else 0, d)
    return h.new_empty(B, T, dtype=logits_dtype), torch.empty_like(h, memory_format=torch.contiguous_format), head


@torch.library.custom_op("longshield::head_weight_grad", mutates_args=())
def head_weight_grad(dz: Tensor, h: Tensor) -> Tensor:
    """The head's weight gradient ``dzᵀ h`` (V, d) from the logits' gradient rows dz (N, V) and
    the hidden rows h (N, d), paired row by row (``lm_head_loss``'s rows form and h's rows, both
    row-major over the positions). A graph that keeps per-sample gradients replaces it by its
    per-unit form (``chunked_loss``'s rule), so there it never runs."""
    return dz.t() @ h


@head_weight_grad.register_fake
def _(dz, h):
    return h.new_empty(dz.shape[1], h.shape[1])
