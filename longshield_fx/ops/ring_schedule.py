"""Where a sequence's tokens sit on the cp ranks of ring attention, and which chunk pairs each
rank computes against each K/V shard (``ops.ring_attention`` runs this schedule).

Layout ("head-tail" / zig-zag load balancing): a sequence of length ``T`` is cut into ``2*cp``
chunks of length ``c = T / (2*cp)``; cp rank ``r`` holds chunks ``r`` and ``2*cp-1-r``, concatenated
(local length ``2c = T/cp``). With a causal mask every rank then computes the same amount of work.

Per (query chunk, key chunk) pair with global chunk ids ``i`` / ``j``: ``j > i`` is skipped,
``j == i`` is causal, ``j < i`` is full. Pairs are fused into one kernel call per ring step:

* step 0 (own block): one causal call on the local ``2c x 2c`` block (the local layout is
  increasing in global position, so plain causal masking is exactly the pair rule);
* ``src < r``: both local query chunks attend to the first key chunk (one call, full);
* ``src > r``: the second (tail) query chunk attends to the whole block (one call, full).

Every rank therefore computes ``2*cp + 1`` chunk pairs (2 causal + ``2*cp - 1`` full) in ``cp`` calls.

Packed documents: ``_Documents`` gives each call its document-and-causal mask and leaves out the
rows that share no document in it (see ``ops.ring_attention``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "zigzag_index",
    "shard_sequence",
    "unshard_sequence",
    "blocks_per_rank",
    "block_plan",
    "pairs_skipped",
]


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
# Document masks of the blocks


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
