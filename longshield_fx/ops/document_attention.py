"""Document attention on one rank (cp = 1): causal attention within each document of rows of
packed documents (``segments``, (B, L) document ids, equal ids only within one contiguous piece
of a row), the ``cp == 1`` case of ``longshield::ring_attention``.

A row attends run by run (a run: a row's contiguous piece of one document), with causal kernels
and no mask (a masked kernel computes every score of the row): on the CPU in buckets of runs of
one padded length (``_RunPlan``, made once per batch and shared by every layer; where most rows
are one run each, the kernel takes every row as it lies and only the others go into buckets), on a GPU in
fp16/bf16 as flash attention over variable-length runs (on Hopper a row that is one run goes to
cuDNN's causal kernel, faster there). A GPU in fp32 keeps the masked memory-efficient kernel, and
rows without documents are one causal kernel call (``ops.attention_kernels``).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .attention_kernels import (_block_bwd, _block_fwd, _cudnn, _cudnn_bwd, _cudnn_fwd, _expand_heads,
                                _flash_layout, _reduce_heads)
from ._dtypes import accumulation_dtype
from .ring_schedule import _ALL, _Documents

aten = torch.ops.aten


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
    """The buckets of a batch's document runs, and ``inverse`` (B*L,; len(rest)*L where ``rest``
    is set): where each token of the rows the buckets hold has its result in the buckets'
    results laid end to end.

    ``rest``: None, or (where at least ``_MOSTLY_WHOLE`` of the rows are one run each: long
    documents) the rows that are not, which alone the buckets hold. Then the kernel runs on
    every row as it lies (no gathered copy of the rows that are one run) and the rows ``rest``,
    attended run by run, replace their whole-row results: each row's results are its own, so
    what the kernel made of the rows ``rest`` (with their run-by-run lse, in the backward: any
    value, inf or nan included) is overwritten and reaches no other row."""

    def __init__(self, segments: Tensor, heads: int, head_dim: int):
        whole = (segments == segments[:, :1]).all(1)
        self.rest = (~whole).nonzero().squeeze(1) if int(whole.sum()) >= _MOSTLY_WHOLE * len(whole) else None
        if self.rest is not None:
            segments = segments.index_select(0, self.rest)
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


# The share of a batch's rows that are one run each from which the kernel runs on every row and
# the buckets hold the others alone: computing those few rows twice costs less than gathering
# and scattering all the others (rows of 256 tokens of Debian documentation, 124-125 of 128 rows
# one run: forward and backward 6-8% over the kernel alone on every row, against 14-31% with every
# row in buckets).
_MOSTLY_WHOLE = 0.75

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
    (``_RunPlan``; where most rows are one run, one call on every row first); K/V un-repeated
    (the CPU kernel takes GQA as it is). Returns out and lse in the flash layout, fresh tensors."""
    plan = _run_plan(segments, q.shape[1], q.shape[3])
    if plan is None or plan.rest is not None:  # every row, or most, one run: the kernel on the rows as they are
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
        out, lse = _in_flash_layout(out), _in_flash_layout(lse.to(accumulation_dtype(q)))
        if plan is not None:
            runs = _bucketed_fwd(plan, *(x.index_select(0, plan.rest) for x in (q, k, v)), scale)
            for whole, part in zip((out, lse), runs):
                whole.index_copy_(0, plan.rest, part)
        return out, lse
    return _bucketed_fwd(plan, q, k, v, scale)


def _bucketed_fwd(plan: "_RunPlan", q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """``_cpu_runs_fwd`` of the rows ``plan``'s buckets hold, one kernel call per bucket."""
    flat = [_tokens_major(x) for x in (q, k, v)]
    outs, lses = [], []
    for b in plan.buckets:
        if b.P == 1:
            o, l = _one_token_fwd(*(x.index_select(0, b.index) for x in flat), scale)
        else:
            o, l = (_flat_result(x) for x in aten._scaled_dot_product_flash_attention_for_cpu(
                *(b.gather(x) for x in flat), 0.0, True, scale=scale))
        outs.append(o)
        lses.append(l.to(accumulation_dtype(q)))
    return plan.scatter(outs, q.shape), plan.scatter(lses, q.shape[:3])


def _one_token_fwd(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Attention of one-token runs, (n, H, D) each (K/V un-repeated): a token that sees only itself
    puts all its weight on its own value, and its lse is its one score (what the kernel computes,
    without a call for each of the many padding tokens)."""
    groups = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(groups, 1) for x in (k, v))
    acc = accumulation_dtype(q)
    return v, (q.to(acc) * k.to(acc)).sum(-1) * scale


def _cpu_runs_bwd(go: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float,
                  segments: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of ``_cpu_runs_fwd``: dq, and dk/dv with K/V's (un-repeated) heads, in the flash
    layout, fresh tensors."""
    plan = _run_plan(segments, q.shape[1], q.shape[3])
    if plan is None or plan.rest is not None:
        grads = tuple(map(_in_flash_layout, aten._scaled_dot_product_flash_attention_for_cpu_backward(
            go, q, k, v, out, lse, 0.0, True, scale=scale)))
        if plan is not None:  # the rows run by run replace what the kernel made of them
            runs = _bucketed_bwd(plan, *(x.index_select(0, plan.rest) for x in (go, q, k, v, out, lse)), scale)
            for whole, part in zip(grads, runs):
                whole.index_copy_(0, plan.rest, part)
        return grads
    return _bucketed_bwd(plan, go, q, k, v, out, lse, scale)


def _bucketed_bwd(plan: "_RunPlan", go: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                  scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """``_cpu_runs_bwd`` of the rows ``plan``'s buckets hold."""
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
    out, lse = torch.empty_like(q), torch.empty(q.shape[:3], dtype=accumulation_dtype(q), device=q.device)
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
    return out.view(B, L, H, D).transpose(1, 2), lse.to(accumulation_dtype(q)).view(H, B, L).transpose(0, 1)


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
