"""Context-parallel causal ring attention as opaque ``torch.library`` custom ops.

A graph pass substitutes ``longshield::ring_attention`` / ``longshield::ring_attention_backward``
for ``aten._scaled_dot_product_flash_attention_for_cpu`` / its ``_backward`` in a captured aten
joint graph; each op stays a single node (``register_fake`` + ``register_autograd``).

Layout: each cp rank holds a zig-zag shard of the sequence (two chunks of ``2*cp``), and computes
the chunk pairs of ``ops.ring_schedule.block_plan`` against each K/V shard it holds.

Ring schedule (``cp`` steps): at step ``s`` rank ``r`` holds the K/V shard of rank ``src = (r-s) % cp``
(received from ``r-1``, forwarded to ``r+1``; the transfer of the next block overlaps the compute of
the current one). K/V travel un-repeated (``Hkv`` heads); GQA heads are expanded locally for the
kernel only.

Double ring (LoongTrain Alg. 2, ``inner`` = w < cp): the cp ranks form cp/w inner rings of w
consecutive ranks (rank = g*w + p), and the inner rings an outer ring. At outer step o rank
(g, p) holds the outer block of rank (g-o, p), passed one outer hop per step to (g+1, p) while
the inner ring rotates it w-1 times among (g, *): at inner step i the block of (g-o, p-i).
Every rank still meets every K/V block once (same pairs, same merge), so the result is
identical; the hops differ: w-1 inner hops per outer step and cp/w-1 outer hops, concurrent
(with inner rings inside a node, the outer hops are the only inter-node traffic and all
nodes' NICs carry them at once). ``inner=cp`` is the single ring.

Blocks are merged with their log-sum-exp (fp32 accumulation; float64 for float64 inputs). The
backward pass rotates K/V around the ring again, calls the per-block flash backward with the
GLOBAL (merged) ``out`` / ``lse`` (which gives the exact gradients of full attention: dq summed
over blocks, dk/dv per block), and sends the dk/dv accumulators (fp32, or float64) along with
their blocks; one extra hop returns them to their owner.

Packed documents (``segments``, (B, L) int64: each local token's document id, equal ids only
within one contiguous piece of a row): a query attends to an earlier key of the same row only if
both carry the same id. Every rank all-gathers the (small) ids of all shards once per call, so
it knows the ids of whichever K/V block it holds; each kernel call gets the block's
document-and-causal mask, and a row none of whose pairs in a call shares a document is left out
of the call, a call without rows skipped (``last_block_counts["forward_skipped"]``: (row, chunk
pair)s skipped). A query row with no key of its document in a block gets lse = -inf there (the
CPU kernel returns 0 for it), so the merge ignores the block for that row. On one rank (cp = 1) a
row attends run by run instead (``ops.document_attention``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from .._torch import resolve_process_group
from ._dtypes import accumulation_dtype
from .attention_kernels import _block_bwd, _block_fwd, _empty_flash_layout, _expand_heads, _flash_layout, _reduce_heads
from .document_attention import _one_rank_bwd, _one_rank_fwd
from .ring_schedule import _Documents, _sel, blocks_per_rank

__all__ = ["ring_attention", "ring_attention_backward", "last_block_counts"]

# Instrumentation, per process (= per cp rank), overwritten by each real (non-fake) call:
# "forward"/"backward": chunk pairs computed (skipped pairs not counted);
# "forward_calls"/"backward_calls": attention kernel calls (fused pairs);
# "forward_skipped"/"backward_skipped": (row, chunk pair)s left out for sharing no document.
last_block_counts: dict[str, int] = {}


def _rows(x: Tensor, rows: Tensor | None) -> Tensor:
    return x if rows is None else x.index_select(0, rows)


def _put_rows(dst: Tensor, rows: Tensor | None, x: Tensor) -> None:
    dst.copy_(x) if rows is None else dst.index_copy_(0, rows, x)


def _add_rows(dst: Tensor, rows: Tensor | None, x: Tensor) -> None:
    dst.add_(x) if rows is None else dst.index_add_(0, rows, x.to(dst.dtype))


# --------------------------------------------------------------------------------------------
# Ring communication


def _resolve_group(group_name: str, cp: int) -> tuple[dist.ProcessGroup, int]:
    group = resolve_process_group(group_name)
    size = dist.get_world_size(group)
    if size != cp:
        raise ValueError(f"process group {group_name!r} has {size} ranks, but cp={cp}")
    return group, dist.get_rank(group)


class _Exchange:
    """Send ``buf`` to group rank ``to`` and receive the same-shaped buffer from ``source``."""

    def __init__(self, buf: Tensor, group: dist.ProcessGroup, to: int, source: int):
        self._send = buf.contiguous()
        self._recv = torch.empty_like(self._send)
        self._works = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, self._send, group=group, group_peer=to),
                dist.P2POp(dist.irecv, self._recv, group=group, group_peer=source),
            ]
        )

    def wait(self) -> Tensor:
        for w in self._works:
            w.wait()
        self._send = None
        return self._recv


class _Rings:
    """Peers and block sources of the (double) ring of cp ranks with inner rings of ``w``."""

    def __init__(self, group, rank: int, cp: int, w: int):
        self.group, self.rank, self.cp, self.w = group, rank, cp, w
        self.outer = cp // w
        g, p = divmod(rank, w)
        self._g, self._p = g, p
        self.inner_peers = (g * w + (p + 1) % w, g * w + (p - 1) % w)  # (to, from)
        self.outer_peers = (((g + 1) % self.outer) * w + p, ((g - 1) % self.outer) * w + p)

    def source(self, o: int, i: int) -> int:
        """Whose K/V block this rank holds at outer step o, inner step i."""
        return ((self._g - o) % self.outer) * self.w + (self._p - i) % self.w

    def inner_exchange(self, buf: Tensor) -> _Exchange:
        return _Exchange(buf, self.group, *self.inner_peers)

    def outer_exchange(self, buf: Tensor) -> _Exchange:
        return _Exchange(buf, self.group, *self.outer_peers)


def _inner_ring(cp: int, inner: int) -> int:
    w = cp if inner in (0, cp) else inner
    if w < 1 or cp % w:
        raise ValueError(f"the inner ring size {inner} must divide cp={cp}")
    return w


def _check_shapes(q: Tensor, k: Tensor, v: Tensor, cp: int, segments: Tensor | None = None) -> int:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("ring_attention expects (B, H, L, D) tensors")
    if segments is not None and (segments.shape != (q.shape[0], q.shape[2]) or segments.is_floating_point()):
        raise ValueError(f"segments must be integer document ids of shape (B, L) = {(q.shape[0], q.shape[2])}, "
                         f"got {segments.dtype} {tuple(segments.shape)}")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"incompatible shapes q={tuple(q.shape)} k={tuple(k.shape)} v={tuple(v.shape)}")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"query heads {q.shape[1]} not a multiple of key/value heads {k.shape[1]}")
    if cp > 1 and q.shape[2] % 2 != 0:
        raise ValueError(f"local length {q.shape[2]} must be even (two zig-zag chunks)")
    return q.shape[1] // k.shape[1]


# --------------------------------------------------------------------------------------------
# Ops


@torch.library.custom_op("longshield::ring_attention", mutates_args=())
def ring_attention(
    q: Tensor, k: Tensor, v: Tensor, scale: float, group_name: str, cp: int, inner: int = 0,
    segments: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Causal attention of the local zig-zag shard against the whole (ring-distributed) sequence.

    q: (B, Hq, L, D), k/v: (B, Hkv, L, D), L = T/cp. ``inner``: the inner ring size w of a
    double ring (0 or cp: one ring). ``segments`` (B, L) int64: the local tokens' document ids
    (packed documents, see the module docstring). Returns out (B, Hq, L, D) in q's dtype and
    lse (B, Hq, L) (natural log) in fp32, float64 for float64 inputs (``accumulation_dtype``)."""
    groups = _check_shapes(q, k, v, cp, segments)
    w = _inner_ring(cp, inner)
    if cp == 1:  # one block, one kernel call: nothing to merge
        out, lse = _one_rank_fwd(q, k, v, scale, segments, groups)
        last_block_counts.update(forward=blocks_per_rank(1)[0], forward_calls=1, forward_skipped=0)
        return out, lse
    group, rank = _resolve_group(group_name, cp)
    rings = _Rings(group, rank, cp, w)
    B, Hq, L, D = q.shape
    acc = accumulation_dtype(q)
    acc_out = torch.zeros(B, Hq, L, D, dtype=acc, device=q.device)
    acc_lse = torch.full((B, Hq, L), float("-inf"), dtype=acc, device=q.device)
    outer_kv = torch.stack([k, v])  # travels un-repeated
    docs = _Documents.gathered(segments, group, cp)
    pairs = calls = 0
    for o in range(rings.outer):
        outer_ex = rings.outer_exchange(outer_kv) if o < rings.outer - 1 else None
        kv = outer_kv
        for i in range(w):
            ex = rings.inner_exchange(kv) if i < w - 1 else None
            kk, vv = _expand_heads(kv[0], groups), _expand_heads(kv[1], groups)
            src = rings.source(o, i)
            for qs, ks, causal, n, allowed, rows in docs.plan(cp, rank, src):
                out, lse = _block_fwd(*(_rows(x, rows) for x in (_sel(q, qs), _sel(kk, ks), _sel(vv, ks))),
                                      causal, scale, allowed)
                a_out, a_lse = _sel(acc_out, qs), _sel(acc_lse, qs)
                was_out, was_lse = _rows(a_out, rows), _rows(a_lse, rows)
                new = torch.logaddexp(was_lse, lse)
                finite = new.masked_fill(new == float("-inf"), 0.0)  # no key yet: keep 0 and -inf
                merged = was_out * torch.exp(was_lse - finite).unsqueeze(-1) + out.to(acc) * torch.exp(
                    lse - finite).unsqueeze(-1)
                _put_rows(a_out, rows, merged)
                _put_rows(a_lse, rows, new)
                pairs, calls = pairs + n, calls + 1
            if ex is not None:
                kv = ex.wait()
        if outer_ex is not None:
            outer_kv = outer_ex.wait()
    last_block_counts.update(forward=pairs, forward_calls=calls, forward_skipped=docs.skipped)
    return _flash_layout(acc_out.to(q.dtype)), _flash_layout(acc_lse)


@ring_attention.register_fake
def _(q, k, v, scale, group_name, cp, inner=0, segments=None):
    _check_shapes(q, k, v, cp, segments)
    _inner_ring(cp, inner)
    B, Hq, L, _ = q.shape
    return _empty_flash_layout(q.shape, q), _empty_flash_layout((B, Hq, L), q, accumulation_dtype(q))


@torch.library.custom_op("longshield::ring_attention_backward", mutates_args=())
def ring_attention_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    scale: float,
    group_name: str,
    cp: int,
    inner: int = 0,
    segments: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of :func:`ring_attention`: dq (B, Hq, L, D), dk/dv (B, Hkv, L, D) of the local
    K/V shard (summed over the GQA group and over all ranks' queries)."""
    groups = _check_shapes(q, k, v, cp, segments)
    w = _inner_ring(cp, inner)
    grad_out = grad_out.to(q.dtype)
    out = out.to(q.dtype)
    lse = lse.to(accumulation_dtype(q))
    if cp == 1:
        grads = _one_rank_bwd(grad_out, q, k, v, out, lse, scale, segments, groups)
        last_block_counts.update(backward=blocks_per_rank(1)[0], backward_calls=1, backward_skipped=0)
        return grads
    group, rank = _resolve_group(group_name, cp)
    rings = _Rings(group, rank, cp, w)
    dq = torch.zeros(q.shape, dtype=accumulation_dtype(q), device=q.device)
    outer_kv = torch.stack([k, v])
    outer_dkv_ex = None
    docs = _Documents.gathered(segments, group, cp)
    pairs = calls = 0
    for o in range(rings.outer):
        outer_ex = rings.outer_exchange(outer_kv) if o < rings.outer - 1 else None
        kv, dkv_ex = outer_kv, None
        for i in range(w):
            ex = rings.inner_exchange(kv) if i < w - 1 else None
            kk, vv = _expand_heads(kv[0], groups), _expand_heads(kv[1], groups)
            dkv = torch.zeros(kv.shape, dtype=accumulation_dtype(q), device=q.device)
            src = rings.source(o, i)
            for qs, ks, causal, n, allowed, rows in docs.plan(cp, rank, src):
                dq_b, dk_b, dv_b = _block_bwd(
                    _rows(_sel(grad_out, qs), rows).contiguous(),
                    _rows(_sel(q, qs), rows),
                    _rows(_sel(kk, ks), rows),
                    _rows(_sel(vv, ks), rows),
                    _rows(_sel(out, qs), rows).contiguous(),
                    _rows(_sel(lse, qs), rows).contiguous(),
                    causal,
                    scale,
                    allowed,
                )
                _add_rows(_sel(dq, qs), rows, dq_b)
                _add_rows(_sel(dkv[0], ks), rows, _reduce_heads(dk_b, groups))
                _add_rows(_sel(dkv[1], ks), rows, _reduce_heads(dv_b, groups))
                pairs, calls = pairs + n, calls + 1
            if dkv_ex is not None:  # accumulator of this block from the inner ranks before us
                dkv += dkv_ex.wait()
            if w > 1:
                dkv_ex = rings.inner_exchange(dkv)
            if ex is not None:
                kv = ex.wait()
        if dkv_ex is not None:  # the inner ring's last hop: this group's sum for the outer block
            dkv = dkv_ex.wait()
        if outer_dkv_ex is not None:  # the sum of the groups that held the outer block before
            dkv += outer_dkv_ex.wait()
        if rings.outer > 1:
            outer_dkv_ex = rings.outer_exchange(dkv)
        if outer_ex is not None:
            outer_kv = outer_ex.wait()
    if outer_dkv_ex is not None:  # the outer ring's last hop: our own block's gradient comes back
        dkv = outer_dkv_ex.wait()
    last_block_counts.update(backward=pairs, backward_calls=calls, backward_skipped=docs.skipped)
    # dk/dv are views of one buffer: custom ops may not return aliasing outputs, so copy.
    return _flash_layout(dq.to(q.dtype)), _flash_layout(dkv[0].to(k.dtype)), _flash_layout(dkv[1].to(v.dtype))


@ring_attention_backward.register_fake
def _(grad_out, q, k, v, out, lse, scale, group_name, cp, inner=0, segments=None):
    _check_shapes(q, k, v, cp, segments)
    _inner_ring(cp, inner)
    return _empty_flash_layout(q.shape, q), _empty_flash_layout(k.shape, k), _empty_flash_layout(v.shape, v)


def _setup_context(ctx, inputs, output):
    q, k, v, scale, group_name, cp, inner, segments = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, segments)
    ctx.scale, ctx.group_name, ctx.cp, ctx.inner = scale, group_name, cp, inner
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, segments = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dk, dv = torch.ops.longshield.ring_attention_backward(
        grad_out, q, k, v, out, lse, ctx.scale, ctx.group_name, ctx.cp, ctx.inner, segments
    )
    return dq, dk, dv, None, None, None, None, None


ring_attention.register_autograd(_backward, setup_context=_setup_context)
