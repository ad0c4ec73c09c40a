"""Context-parallel causal ring attention as opaque ``torch.library`` custom ops.

A graph pass substitutes ``longshield::ring_attention`` / ``longshield::ring_attention_backward``
for ``aten._scaled_dot_product_flash_attention_for_cpu`` / its ``_backward`` in a captured aten
joint graph; each op stays a single node (``register_fake`` + ``register_autograd``).

Layout ("head-tail" / zig-zag load balancing): a sequence of length ``T`` is cut into ``2*cp``
chunks of length ``c = T / (2*cp)``; cp rank ``r`` holds chunks ``r`` and ``2*cp-1-r``, concatenated
(local length ``2c = T/cp``). With a causal mask every rank then computes the same amount of work.

Ring schedule (``cp`` steps): at step ``s`` rank ``r`` holds the K/V shard of rank ``src = (r-s) % cp``
(received from ``r-1``, forwarded to ``r+1``; the transfer of the next block overlaps the compute of
the current one). K/V travel un-repeated (``Hkv`` heads); GQA heads are expanded locally for the
kernel only. Per (query chunk, key chunk) pair with global chunk ids ``i`` / ``j``: ``j > i`` is
skipped, ``j == i`` is causal, ``j < i`` is full. Pairs are fused into one kernel call per step:

* step 0 (own block): one causal call on the local ``2c x 2c`` block (the local layout is
  increasing in global position, so plain causal masking is exactly the pair rule);
* ``src < r``: both local query chunks attend to the first key chunk (one call, full);
* ``src > r``: the second (tail) query chunk attends to the whole block (one call, full).

Every rank therefore computes ``2*cp + 1`` chunk pairs (2 causal + ``2*cp - 1`` full) in ``cp`` calls.

Double ring (LoongTrain Alg. 2, ``inner`` = w < cp): the cp ranks form cp/w inner rings of w
consecutive ranks (rank = g*w + p), and the inner rings an outer ring. At outer step o rank
(g, p) holds the outer block of rank (g-o, p), passed one outer hop per step to (g+1, p) while
the inner ring rotates it w-1 times among (g, *): at inner step i the block of (g-o, p-i).
Every rank still meets every K/V block once (same pairs, same merge), so the result is
identical; the hops differ: w-1 inner hops per outer step and cp/w-1 outer hops, concurrent
(with inner rings inside a node, the outer hops are the only inter-node traffic and all
nodes' NICs carry them at once). ``inner=cp`` is the single ring.

Blocks are merged with their log-sum-exp (fp32 accumulation). The backward pass rotates K/V around
the ring again, calls the per-block flash backward with the GLOBAL (merged) ``out`` / ``lse`` (which
gives the exact gradients of full attention: dq summed over blocks, dk/dv per block), and sends the
fp32 dk/dv accumulators along with their blocks; one extra hop returns them to their owner.

Packed documents (``segments``, (B, L) int64: each local token's document id, equal ids only
within one contiguous piece of a row): a query attends to an earlier key of the same row only if
both carry the same id. Every rank all-gathers the (small) ids of all shards once per call, so
it knows the ids of whichever K/V block it holds; each kernel call gets the block's
document-and-causal mask, and a row none of whose pairs in a call shares a document is left out
of the call, a call without rows skipped (``last_block_counts["forward_skipped"]``: (row, chunk
pair)s skipped). A query row with no key of its
document in a block gets lse = -inf there (the CPU kernel returns 0 for it), so the merge
ignores the block for that row. On one rank (cp = 1) a row attends run by run instead, with
causal kernels and no mask (a masked kernel computes every score of the row): on the CPU in
groups of runs of one padded length, on a GPU in fp16/bf16 as flash attention over
variable-length runs (on Hopper a row that is one run goes to cuDNN's causal kernel, faster there).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from .._torch import resolve_process_group

__all__ = [
    "zigzag_index",
    "shard_sequence",
    "unshard_sequence",
    "ring_attention",
    "ring_attention_backward",
    "blocks_per_rank",
    "block_plan",
    "pairs_skipped",
    "last_block_counts",
]

aten = torch.ops.aten

# Instrumentation, per process (= per cp rank), overwritten by each real (non-fake) call:
# "forward"/"backward": chunk pairs computed (skipped pairs not counted);
# "forward_calls"/"backward_calls": attention kernel calls (fused pairs);
# "forward_skipped"/"backward_skipped": (row, chunk pair)s left out for sharing no document.
last_block_counts: dict[str, int] = {}


# --------------------------------------------------------------------------------------------
# Layout helpers


def _check_divisible(T: int, cp: int) -> None:
    if cp < 1:
        raise ValueError(f"cp must be >= 1, got {cp}")
    if T % (2 * cp) != 0:
        raise ValueError(
            f"zig-zag context parallelism needs the sequence length to be divisible by 2*cp: "
            f"T={T} is not divisible by 2*cp={2 * cp} (pad the sequence to a multiple of {2 * cp})"
        )


def zigzag_index(T: int, cp: int, rank: int) -> Tensor:
    """Global positions (LongTensor of length ``T // cp``) held by cp ``rank``: chunks
    ``rank`` and ``2*cp-1-rank`` of ``2*cp`` equal chunks, in that order."""
    _check_divisible(T, cp)
    if not 0 <= rank < cp:
        raise ValueError(f"rank must be in [0, {cp}), got {rank}")
    c = T // (2 * cp)
    head = torch.arange(rank * c, (rank + 1) * c)
    tail = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)
    return torch.cat([head, tail])


def shard_sequence(x: Tensor, cp: int, rank: int, dim: int = 1) -> Tensor:
    """The zig-zag shard of ``x`` (sequence along ``dim``) held by cp ``rank``."""
    idx = zigzag_index(x.shape[dim], cp, rank).to(x.device)
    return x.index_select(dim, idx)


def unshard_sequence(shards: list[Tensor], cp: int, dim: int = 1) -> Tensor:
    """Inverse of :func:`shard_sequence`: ``shards[r]`` is rank r's shard."""
    if len(shards) != cp:
        raise ValueError(f"expected {cp} shards, got {len(shards)}")
    local = shards[0].shape[dim]
    T = local * cp
    _check_divisible(T, cp)
    for r, s in enumerate(shards):
        if s.shape[dim] != local:
            raise ValueError(f"shard {r} has length {s.shape[dim]} along dim {dim}, expected {local}")
    cat = torch.cat(list(shards), dim=dim)
    pos = torch.cat([zigzag_index(T, cp, r) for r in range(cp)])  # global position of cat[i]
    inv = torch.empty_like(pos)
    inv[pos] = torch.arange(T)
    return cat.index_select(dim, inv.to(cat.device))


# --------------------------------------------------------------------------------------------
# Block schedule

_ALL = "all"  # a whole local shard (both chunks) in a plan entry


def _chunk_ids(cp: int, rank: int) -> tuple[int, int]:
    return rank, 2 * cp - 1 - rank


def block_plan(cp: int, rank: int, src: int) -> list[tuple[int | str, int | str, bool, int]]:
    """Kernel calls of ``rank`` against the K/V shard of ``src``.

    Entries ``(q_sel, k_sel, is_causal, n_pairs)``; ``q_sel``/``k_sel`` are a local chunk index
    (0 = head, 1 = tail) or ``"all"``. Derived from the per-pair rule on global chunk ids, then
    fused (pairs sharing a query or key chunk with the same mask go into one call)."""
    qids, kids = _chunk_ids(cp, rank), _chunk_ids(cp, src)
    pairs = {
        (i, j): qids[i] == kids[j] for i in (0, 1) for j in (0, 1) if kids[j] <= qids[i]
    }  # (local q chunk, local k chunk) -> causal
    if cp == 1 or (
        set(pairs) == {(0, 0), (1, 0), (1, 1)} and pairs[(0, 0)] and pairs[(1, 1)] and not pairs[(1, 0)]
    ):
        # Diagonal block: local positions increase with global ones, so causal on the whole
        # square local block is exactly (causal, skip / full, causal).
        return [(_ALL, _ALL, True, 3)]
    full = {p for p, causal in pairs.items() if not causal}
    plan: list[tuple[int | str, int | str, bool, int]] = []
    if len(full) == 4:
        return [(_ALL, _ALL, False, 4)]
    for i in (0, 1):
        if {(i, 0), (i, 1)} <= full:
            plan.append((i, _ALL, False, 2))
            full -= {(i, 0), (i, 1)}
    for j in (0, 1):
        if {(0, j), (1, j)} <= full:
            plan.append((_ALL, j, False, 2))
            full -= {(0, j), (1, j)}
    plan += [(i, j, False, 1) for (i, j) in sorted(full)]
    plan += [(i, j, True, 1) for (i, j), causal in sorted(pairs.items()) if causal]
    return plan


def blocks_per_rank(cp: int) -> list[int]:
    """Number of (non-skipped) chunk pairs each cp rank computes in one forward pass
    (``2*cp + 1`` for every rank with the zig-zag layout)."""
    return [
        sum(n for s in range(cp) for *_, n in block_plan(cp, r, (r - s) % cp)) for r in range(cp)
    ]


def pairs_skipped(segments: Tensor, cp: int) -> tuple[int, int]:
    """((row, chunk pair)s skipped, (row, chunk pair)s in all) of every cp rank's forward over rows
    of packed documents with document ids ``segments`` (B, T): the sum of the ranks'
    ``forward_skipped``, and B times the chunk pairs of the schedule, computed without a process
    group."""
    shards = [shard_sequence(segments, cp, r) for r in range(cp)]
    skipped = total = 0
    for r in range(cp):
        docs = _Documents(shards[r], shards)
        for src in range(cp):
            total += segments.shape[0] * sum(n for *_, n in block_plan(cp, r, src))
            for _ in docs.plan(cp, r, src):
                pass
        skipped += docs.skipped
    return skipped, total


def _sel(x: Tensor, which: int | str, dim: int = 2) -> Tensor:
    if which == _ALL:
        return x
    c = x.shape[dim] // 2
    return x.narrow(dim, which * c, c)


# --------------------------------------------------------------------------------------------
# Per-block kernels (the only device-specific code). On CUDA: flash for fp16/bf16, flash over
# variable-length document runs for a whole row of packed documents (cp == 1) in fp16/bf16,
# memory-efficient for fp32 and for any other block under a document mask (all return lse).
# The CPU tests exercise only the CPU branch; benchmarks/gpu_check.py checks the CUDA ones.


def _block_fwd(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float,
               allowed: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Attention of one block -> (out, lse (B, H, Lq) fp32 natural log). ``allowed`` (B, 1, Lq, Lk)
    bool: the document mask (causality folded in); rows with no allowed key get lse = -inf."""
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
    lse = lse.float()
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
    return out, lse.float().reshape(q.shape[:3])


def _cudnn_bwd(go: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
               scale: float) -> tuple[Tensor, Tensor, Tensor]:
    unused = torch.zeros((), dtype=torch.int64, device=q.device)  # the dropout seed and offset: no dropout
    B, H, Lq, D = q.shape
    return aten._scaled_dot_product_cudnn_attention_backward(
        go.contiguous(), q, k, v, out.contiguous(), lse.reshape(B, H, Lq, 1).contiguous(), unused, unused, None, None,
        None, Lq, k.shape[2], 0.0, causal, scale=scale)


def _rows_by_runs(segments: Tensor) -> tuple[Tensor, Tensor]:
    """(the rows that are one document run, the other rows), as row indices."""
    one = (segments == segments[:, :1]).all(1)
    return one.nonzero().squeeze(1), (~one).nonzero().squeeze(1)


def _whole_row_mask(segments: Tensor | None) -> Tensor | None:
    """The document-and-causal mask of a whole row against itself (cp == 1); None without documents."""
    return _Documents.gathered(segments, None, 1).allowed(_ALL, 0, _ALL, True)


def _by_document_runs(q: Tensor, segments: Tensor | None) -> bool:
    """Whether a whole-row call (cp == 1) attends run by run, with causal kernels that take no mask
    (a masked kernel computes all T^2 scores of a row): on the CPU, and on a GPU in half precision
    (flash over variable-length runs); a GPU in fp32 keeps the masked memory-efficient kernel."""
    if segments is None:
        return False
    return q.device.type == "cpu" or (q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16))


def _document_runs(segments: Tensor) -> Tensor:
    """cu_seqlens (int32) of the (B, L) ids read row after row as one sequence of runs: a run is
    a row's contiguous piece of one document, so a document continued in the next row is a new
    run there, as its mask says."""
    B, L = segments.shape
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    first = starts.flatten().nonzero().squeeze(1)
    return torch.cat([first, first.new_tensor([B * L])]).to(torch.int32)


def _longest(cu: Tensor) -> int:
    """The longest run of ``cu``, which the varlen flash kernels take as a Python int."""
    return int((cu[1:] - cu[:-1]).max())


def _tokens_major(x: Tensor) -> Tensor:
    """(B, H, L, D) -> (B*L, H, D), the layout of the varlen kernels and of the CPU's buckets of
    runs (a view when x is laid out tokens-major, as the kernels and the model's projections give it)."""
    B, H, L, D = x.shape
    return x.transpose(1, 2).reshape(B * L, H, D)


# On the CPU a row of packed documents attends run by run: the runs of the batch are gathered
# into buckets of one padded length P (one causal kernel call per bucket, the padding after each
# run where causality hides it from the run's own queries), on a flat tokens-major layout
# (B*L, H, D), the layout the kernels read and write, so that a gather is one index_select and
# the outputs of all buckets come back in one. The plan (which run goes where) depends on the
# document ids only, so it is made once per batch and shared by every layer's forward and backward.

# What a bucket costs, forward + backward, in µs on one AVX-512 core (tiny Llama's shapes,
# torch 2.13): a kernel call and its gathers ~60, and a padded sequence per head ~0.4 plus a
# term in P (P + 40) whose factor grows with the head dimension. Only the speed depends on
# these numbers (which runs share a padded length), never a result.
_CALL_US = 60.0


def _sequence_us(P: int, heads: int, head_dim: int) -> float:
    """The cost of one padded sequence of length P in a bucket (see ``_CALL_US``)."""
    return heads * (0.4 + (0.0005 + 0.00009 * head_dim) * P * (P + 40))


def _fitted_length(length: int, L: int) -> int:
    """The shortest padded length a run of ``length`` tokens may get: a power of two up to 16,
    then a multiple of 16 (the kernel works in blocks of 16 queries; a length between two
    multiples costs as much as the next one, or more), of 32 above 256, 64 above 512 and so on (padding
    under 1/8 of a long run, and few distinct lengths to choose buckets from); never above L."""
    if length <= 16:
        return min(1 << (length - 1).bit_length(), L)
    step = max(16, 1 << ((length - 1).bit_length() - 4))
    return min(-(-length // step) * step, L)


def _bucket_lengths(fitted: list[int], counts: list[int], heads: int, head_dim: int) -> list[int]:
    """The padded length of each fitted length (sorted, distinct, ``counts`` runs each): runs of
    consecutive fitted lengths share the longest's bucket where one kernel call fewer saves more
    than padding them costs (dynamic programming over the splits; a few dozen lengths)."""
    m = len(fitted)
    best, first = [0.0] + [float("inf")] * m, [0] * (m + 1)
    for j in range(1, m + 1):  # best[j]: the first j fitted lengths in buckets; the last = fitted[i-1 .. j-1]
        seq, n = _sequence_us(fitted[j - 1], heads, head_dim), 0
        for i in range(j, 0, -1):
            n += counts[i - 1]
            cost = best[i - 1] + _CALL_US + n * seq
            if cost < best[j]:
                best[j], first[j] = cost, i
    lengths, j = [0] * m, m
    while j:
        lengths[first[j] - 1:j] = [fitted[j - 1]] * (j - first[j] + 1)
        j = first[j] - 1
    return lengths


class _Bucket:
    """``n`` runs padded to ``P`` tokens: ``index`` (n*P,) the token (of the B*L read row after row)
    at each place, a run's padding repeating its last token; ``padding`` the places that are
    padding (None if none).

    Repeating the last token keeps the backward finite: a padding query is that token, its lse the
    token's, so its probabilities exp(s - lse) stay at most 1, and its output gradient is set to 0,
    so it adds exactly nothing to its run's dk and dv."""

    def __init__(self, P: int, starts: Tensor, lengths: Tensor):
        self.P, self.n = P, len(starts)
        offsets = torch.arange(P, device=starts.device)
        self.index = (starts[:, None] + torch.minimum(offsets, lengths[:, None] - 1)).flatten()
        self.valid = (offsets < lengths[:, None]).flatten()
        padding = (~self.valid).nonzero().squeeze(1)
        self.padding = padding if len(padding) else None

    def gather(self, flat: Tensor, zero_padding: bool = False) -> Tensor:
        """(n, H, P, ...) of ``flat`` (B*L, H, ...): the kernels take the strided view as it is."""
        x = flat.index_select(0, self.index)
        if zero_padding and self.padding is not None:
            x.index_fill_(0, self.padding, 0)
        return x.view(self.n, self.P, *flat.shape[1:]).transpose(1, 2)


class _RunPlan:
    """The buckets of a batch's document runs, and ``inverse`` (B*L,): where each token's result
    is in the buckets' results laid end to end."""

    def __init__(self, segments: Tensor, heads: int, head_dim: int):
        B, L = segments.shape
        cu = _document_runs(segments).long()
        starts, lengths = cu[:-1], cu[1:] - cu[:-1]
        fitted = [_fitted_length(n, L) for n in lengths.tolist()]
        # One-token runs (each padding token is one) skip the kernel (``_one_token_fwd``): they stay
        # a bucket of their own, whatever the cost of a call.
        distinct = sorted(set(fitted) - {1})
        counts = [fitted.count(f) for f in distinct]  # a few hundred runs at most per batch
        bucket = {1: 1, **dict(zip(distinct, _bucket_lengths(distinct, counts, heads, head_dim)))}
        padded = torch.tensor([bucket[f] for f in fitted], device=segments.device)
        self.buckets = [_Bucket(P, starts[padded == P], lengths[padded == P]) for P in padded.unique().tolist()]
        self.inverse = torch.empty(B * L, dtype=torch.long, device=segments.device)
        offset = 0
        for b in self.buckets:
            places = torch.arange(offset, offset + b.n * b.P, device=segments.device)
            self.inverse[b.index[b.valid]] = places[b.valid]
            offset += b.n * b.P

    def scatter(self, parts: list[Tensor], shape: torch.Size) -> Tensor:
        """The buckets' results ``parts`` ((n*P, H, ...) each, in bucket order) -> (B, H, L, ...) in
        the flash layout (heads inner to L), a fresh tensor."""
        B, H, L, *rest = shape
        whole = parts[0] if len(parts) == 1 else torch.cat(parts)
        return whole.index_select(0, self.inverse).view(B, L, H, *rest).transpose(1, 2)


def _in_flash_layout(x: Tensor) -> Tensor:
    """A kernel's fresh result in the flash layout: itself where the kernel laid it out so (it
    follows its inputs' layout), else a copy."""
    return x if x.transpose(1, 2).is_contiguous() else _flash_layout(x)


def _flat_result(x: Tensor) -> Tensor:
    """A kernel's (n, H, P, ...) result as (n*P, H, ...): a view, since the kernel lays its results out
    as its inputs, which a bucket gathers tokens-major."""
    n, H, P, *rest = x.shape
    return x.transpose(1, 2).reshape(n * P, H, *rest)


# One plan: the last batch's ids (a copy, so a change in place cannot go unseen), the heads and
# head dimension it was made for, and the plan (None: every row is one run).
_last_plan: tuple[Tensor, tuple[int, int], _RunPlan | None] | None = None


def _run_plan(segments: Tensor, heads: int, head_dim: int) -> _RunPlan | None:
    """The plan of ``segments``' runs (None when every row is one run), made once per batch: every
    layer's forward and backward get the same ids, and comparing them costs far less than a plan."""
    global _last_plan
    last = _last_plan
    if (last is not None and last[1] == (heads, head_dim) and last[0].shape == segments.shape
            and last[0].dtype == segments.dtype and last[0].device == segments.device
            and torch.equal(last[0], segments)):
        return last[2]
    one_run = bool((segments == segments[:, :1]).all())
    plan = None if one_run else _RunPlan(segments, heads, head_dim)
    _last_plan = (segments.clone(), (heads, head_dim), plan)
    return plan


def _cpu_runs_fwd(q: Tensor, k: Tensor, v: Tensor, scale: float, segments: Tensor) -> tuple[Tensor, Tensor]:
    """Causal flash attention within each document run, one kernel call per bucket of runs
    (``_RunPlan``); K/V un-repeated (the CPU kernel takes GQA as it is). Returns out and lse in the
    flash layout, fresh tensors."""
    plan = _run_plan(segments, q.shape[1], q.shape[3])
    if plan is None:  # every row is one run: the kernel on the rows as they are
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
        return _in_flash_layout(out), _in_flash_layout(lse.float())
    flat = [_tokens_major(x) for x in (q, k, v)]
    outs, lses = [], []
    for b in plan.buckets:
        if b.P == 1:
            o, l = _one_token_fwd(*(x.index_select(0, b.index) for x in flat), scale)
        else:
            o, l = (_flat_result(x) for x in aten._scaled_dot_product_flash_attention_for_cpu(
                *(b.gather(x) for x in flat), 0.0, True, scale=scale))
        outs.append(o)
        lses.append(l.float())
    return plan.scatter(outs, q.shape), plan.scatter(lses, q.shape[:3])


def _one_token_fwd(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Attention of one-token runs, (n, H, D) each (K/V un-repeated): a token that sees only itself
    puts all its weight on its own value, and its lse is its one score (what the kernel computes,
    without a call for each of the many padding tokens)."""
    groups = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(groups, 1) for x in (k, v))
    return v, (q.float() * k.float()).sum(-1) * scale


def _cpu_runs_bwd(go: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float,
                  segments: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of ``_cpu_runs_fwd``: dq, and dk/dv with K/V's (un-repeated) heads, in the flash
    layout, fresh tensors."""
    plan = _run_plan(segments, q.shape[1], q.shape[3])
    if plan is None:
        return tuple(map(_in_flash_layout, aten._scaled_dot_product_flash_attention_for_cpu_backward(
            go, q, k, v, out, lse, 0.0, True, scale=scale)))
    B, H, L, _ = q.shape
    tgo, *flat = [_tokens_major(x) for x in (go, q, k, v, out)] + [lse.transpose(1, 2).reshape(B * L, H)]
    grads = ([], [], [])
    for b in plan.buckets:
        if b.P == 1:
            block = _one_token_bwd(tgo.index_select(0, b.index), k.shape[1])
        else:
            block = (_flat_result(g) for g in aten._scaled_dot_product_flash_attention_for_cpu_backward(
                b.gather(tgo, zero_padding=True), *(b.gather(x) for x in flat), 0.0, True, scale=scale))
        for parts, g in zip(grads, block):
            parts.append(g)
    return tuple(plan.scatter(parts, x.shape) for parts, x in zip(grads, (q, k, v)))


def _one_token_bwd(go: Tensor, kv_heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of ``_one_token_fwd`` from go (n, H, D): a weight that is 1 whatever the scores
    gives q and k none, and v the output gradient (summed over the query heads that share it)."""
    n, H, D = go.shape
    zeros = go.new_zeros((n, kv_heads, D))
    return go.new_zeros((n, H, D)), zeros, go.view(n, kv_heads, H // kv_heads, D).sum(2)


def _runs_fwd(q: Tensor, k: Tensor, v: Tensor, scale: float, segments: Tensor) -> tuple[Tensor, Tensor]:
    """Causal attention within each document run on a GPU (no mask, no work across documents;
    the CPU's is ``_cpu_runs_fwd``). With cuDNN's kernel (``_cudnn``), rows that are one run (a
    document longer than a row) are plain causal blocks for it, and only the other rows go to
    flash over variable-length runs."""
    whole, rest = _rows_by_runs(segments) if _cudnn(q) else (None, None)
    if whole is None or not len(whole):
        return _varlen_fwd(q, k, v, scale, segments)
    if not len(rest):
        return _cudnn_fwd(q, k, v, True, scale)
    out, lse = torch.empty_like(q), torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    for rows, (o, l) in ((whole, _cudnn_fwd(*(x.index_select(0, whole) for x in (q, k, v)), True, scale)),
                         (rest, _varlen_fwd(*(x.index_select(0, rest) for x in (q, k, v)), scale,
                                            segments.index_select(0, rest)))):
        out.index_copy_(0, rows, o)
        lse.index_copy_(0, rows, l)
    return out, lse


def _runs_bwd(go: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float,
              segments: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    whole, rest = _rows_by_runs(segments) if _cudnn(q) else (None, None)
    if whole is None or not len(whole):
        return _varlen_bwd(go, q, k, v, out, lse, scale, segments)
    if not len(rest):
        return _cudnn_bwd(go, q, k, v, out, lse, True, scale)
    grads = [torch.empty_like(x) for x in (q, k, v)]
    for rows, part in ((whole, _cudnn_bwd(*(x.index_select(0, whole) for x in (go, q, k, v, out, lse)), True, scale)),
                       (rest, _varlen_bwd(*(x.index_select(0, rest) for x in (go, q, k, v, out, lse)), scale,
                                          segments.index_select(0, rest)))):
        for full, g in zip(grads, part):
            full.index_copy_(0, rows, g)
    return tuple(grads)


def _varlen_fwd(q: Tensor, k: Tensor, v: Tensor, scale: float, segments: Tensor) -> tuple[Tensor, Tensor]:
    """Flash attention over every document run of the rows, as variable-length sequences."""
    B, H, L, D = q.shape
    cu = _document_runs(segments)
    longest = _longest(cu)
    out, lse, *_ = aten._flash_attention_forward(
        _tokens_major(q), _tokens_major(k), _tokens_major(v), cu, cu, longest, longest, 0.0, True, False,
        scale=scale)
    return out.view(B, L, H, D).transpose(1, 2), lse.float().view(H, B, L).transpose(0, 1)


def _varlen_bwd(go: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float,
                segments: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    B, H, L, D = q.shape
    cu = _document_runs(segments)
    longest = _longest(cu)
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)  # no dropout
    unused = torch.empty(0, device=q.device)
    grads = aten._flash_attention_backward(
        _tokens_major(go), _tokens_major(q), _tokens_major(k), _tokens_major(v), _tokens_major(out),
        lse.transpose(0, 1).reshape(H, B * L).contiguous(), cu, cu, longest, longest, 0.0, True, rng_state,
        unused, scale=scale)
    return tuple(g.view(B, L, H, D).transpose(1, 2) for g in grads)


def _bias(allowed: Tensor, q: Tensor) -> Tensor:
    """The additive mask the kernels take (a boolean one must be in q's dtype on the CPU)."""
    B, _, Lq, Lk = allowed.shape
    bias = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(~allowed, float("-inf"))
    return bias.expand(B, q.shape[1], Lq, Lk) if q.device.type == "cuda" else bias


def _rows(x: Tensor, rows: Tensor | None) -> Tensor:
    return x if rows is None else x.index_select(0, rows)


def _put_rows(dst: Tensor, rows: Tensor | None, x: Tensor) -> None:
    dst.copy_(x) if rows is None else dst.index_copy_(0, rows, x)


def _add_rows(dst: Tensor, rows: Tensor | None, x: Tensor) -> None:
    dst.add_(x) if rows is None else dst.index_add_(0, rows, x.to(dst.dtype))


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


class _Documents:
    """The document ids of every shard (``segments`` of the module docstring), or none: one
    document per row, plain causal attention."""

    def __init__(self, local: Tensor | None, shards: list[Tensor] | None):
        self.local, self.shards = local, shards
        self.skipped = 0  # (row, chunk pair)s skipped: no document shared

    @classmethod
    def gathered(cls, segments: Tensor | None, group, cp: int) -> "_Documents":
        """This rank's ids and every cp rank's, all-gathered over ``group``."""
        if segments is None or cp == 1:
            return cls(segments, None if segments is None else [segments])
        shards = [torch.empty_like(segments) for _ in range(cp)]
        dist.all_gather(shards, segments.contiguous(), group=group)
        return cls(segments, shards)

    def plan(self, cp: int, rank: int, src: int):
        """``block_plan``'s entries with their masks (None without documents) and the rows to
        compute (None: all). A row none of whose query and key tokens share a document is left out
        of the call, a call without rows is left out, and both are counted in ``skipped``."""
        for qs, ks, causal, n in block_plan(cp, rank, src):
            allowed = self.allowed(qs, src, ks, causal)
            if allowed is None or causal:  # a causal entry is a diagonal block: every token sees itself
                yield qs, ks, causal, n, allowed, None
                continue
            shared = allowed.flatten(1).any(1)
            kept = int(shared.sum())
            self.skipped += n * (shared.numel() - kept)
            if kept == shared.numel():
                yield qs, ks, causal, n, allowed, None
            elif kept:
                rows = shared.nonzero().squeeze(1)
                yield qs, ks, causal, n, allowed.index_select(0, rows), rows

    def allowed(self, qs, src: int, ks, causal: bool) -> Tensor | None:
        """(B, 1, Lq, Lk) bool: query i may attend to key j (same document, and j <= i within a
        causal entry); None without documents."""
        if self.shards is None:
            return None
        sq, sk = _sel(self.local, qs, dim=1), _sel(self.shards[src], ks, dim=1)
        same = sq[:, :, None] == sk[:, None, :]
        if causal:
            same &= torch.ones(same.shape[1:], dtype=torch.bool, device=same.device).tril()
        return same[:, None]


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
    lse (B, Hq, L) fp32 (natural log)."""
    groups = _check_shapes(q, k, v, cp, segments)
    w = _inner_ring(cp, inner)
    if cp == 1:  # one block, one kernel call: nothing to merge
        out, lse = _one_rank_fwd(q, k, v, scale, segments, groups)
        last_block_counts.update(forward=blocks_per_rank(1)[0], forward_calls=1, forward_skipped=0)
        return out, lse
    group, rank = _resolve_group(group_name, cp)
    rings = _Rings(group, rank, cp, w)
    B, Hq, L, D = q.shape
    acc_out = torch.zeros(B, Hq, L, D, dtype=torch.float32, device=q.device)
    acc_lse = torch.full((B, Hq, L), float("-inf"), dtype=torch.float32, device=q.device)
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
                merged = was_out * torch.exp(was_lse - finite).unsqueeze(-1) + out.float() * torch.exp(
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


def _one_rank_fwd(q: Tensor, k: Tensor, v: Tensor, scale: float, segments: Tensor | None,
                  groups: int) -> tuple[Tensor, Tensor]:
    """cp == 1: (out, lse) in the flash layout, fresh tensors. Packed documents on the CPU attend
    in buckets of runs with K/V un-repeated and come back in that layout already; every other call
    repeats the K/V heads for the kernel and copies its result into the layout."""
    if _by_document_runs(q, segments) and q.device.type == "cpu":
        return _cpu_runs_fwd(q, k, v, scale, segments)
    kk, vv = _expand_heads(k, groups), _expand_heads(v, groups)
    if _by_document_runs(q, segments):
        out, lse = _runs_fwd(q, kk, vv, scale, segments)
    else:
        out, lse = _block_fwd(q, kk, vv, True, scale, _whole_row_mask(segments))
    return _flash_layout(out), _flash_layout(lse)


def _one_rank_bwd(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float,
                  segments: Tensor | None, groups: int) -> tuple[Tensor, Tensor, Tensor]:
    """cp == 1: the gradients of ``_one_rank_fwd`` (dk, dv with K/V's heads), in the flash layout,
    fresh tensors."""
    if _by_document_runs(q, segments) and q.device.type == "cpu":
        return _cpu_runs_bwd(grad_out, q, k, v, out, lse, scale, segments)
    kk, vv = _expand_heads(k, groups), _expand_heads(v, groups)
    if _by_document_runs(q, segments):
        dq, dk, dv = _runs_bwd(grad_out, q, kk, vv, out, lse, scale, segments)
    else:
        dq, dk, dv = _block_bwd(grad_out.contiguous(), q, kk, vv, out.contiguous(), lse.contiguous(), True,
                                scale, _whole_row_mask(segments))
    return (_flash_layout(dq), _flash_layout(_reduce_heads(dk, groups).to(k.dtype)),
            _flash_layout(_reduce_heads(dv, groups).to(v.dtype)))


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


@ring_attention.register_fake
def _(q, k, v, scale, group_name, cp, inner=0, segments=None):
    _check_shapes(q, k, v, cp, segments)
    _inner_ring(cp, inner)
    B, Hq, L, _ = q.shape
    return _empty_flash_layout(q.shape, q), _empty_flash_layout((B, Hq, L), q, torch.float32)


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
    lse = lse.float()
    if cp == 1:
        grads = _one_rank_bwd(grad_out, q, k, v, out, lse, scale, segments, groups)
        last_block_counts.update(backward=blocks_per_rank(1)[0], backward_calls=1, backward_skipped=0)
        return grads
    group, rank = _resolve_group(group_name, cp)
    rings = _Rings(group, rank, cp, w)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
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
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
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
