"""Packed documents: several privacy units per row, each unit still one sample.

A unit (a document, or every document of one person) is held as pieces of at most T tokens:
each document cut into rows' worth of tokens, its last piece shorter. ``pack_documents``
places the pieces of many units into physical batches of B rows of T tokens, first-fit
decreasing, so short documents share rows instead of each padding a row of its own. Every
unit's pieces go into one physical batch (its gradient is clipped whole there), a piece never
straddles two rows, and a physical batch holds at most U units: its unit slots.

What is left once B rows would no longer be filled goes into batches of B/2, B/4, ... rows
(at least 2; ``row_counts``): the largest that the remaining tokens fill, then smaller ones, so
a logical batch's last batches are not mostly padding; or into one larger batch, where that
holds them in no more rows (no more padding, in fewer runs of the graph). The engine captures
each row count once (a fixed set of shapes, not one per logical batch size); which ones a
logical batch used depends on the units drawn and, like how many physical batches it needed, is
not released.

A physical batch is four (B, T) tensors, ``PackedBatch.tensors()``: the token ids, the
labels (-100 on padding), the position of each token within its piece (0 at the piece's first
token, and on every padding token) and the unit slot of each token (U for padding). ``PackedCausalLMLoss`` attends within
a piece only and never predicts a piece's first token from the piece before it, and
``compile(..., packed_units=U)`` clips and sums per unit slot, so a unit's gradient is what
it would be with each of its pieces in a row of its own.

A unit longer than one physical batch (more than B rows' worth of pieces) keeps the pieces
that fit, longest first, and the dropped tokens are counted (``PackingStats.dropped_tokens``):
choose B·T above the longest unit to train on everything.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from .data import PoissonBatches


@dataclasses.dataclass
class PackedBatch:
    """One physical batch of packed units (see the module docstring). ``members[s]`` is the
    index, in the caller's list of units, of the unit in slot s."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    units: torch.Tensor
    members: list[int]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """``(input_ids, labels, position_ids, units)``: what ``engine.accumulate`` takes."""
        return self.input_ids, self.labels, self.position_ids, self.units


@dataclasses.dataclass
class PackingStats:
    """What packing cost: token slots that hold padding, units per row, tokens left out."""

    batches: int
    token_slots: int
    padding_slots: int
    units: int
    rows_used: int
    pieces: int
    dropped_tokens: int
    truncated_units: int

    @property
    def padding_fraction(self) -> float:
        return self.padding_slots / self.token_slots if self.token_slots else 0.0

    @property
    def pieces_per_row(self) -> float:
        return self.pieces / self.rows_used if self.rows_used else 0.0


def unit_pieces(documents: Sequence[Sequence[int]], seq_len: int) -> list[list[int]]:
    """A unit's documents cut into pieces of at most ``seq_len`` tokens; a piece of fewer than
    2 tokens predicts nothing and is left out."""
    pieces = []
    for doc in documents:
        doc = list(doc)
        pieces += [doc[i:i + seq_len] for i in range(0, len(doc), seq_len) if len(doc) - i >= 2]
    return pieces


def pack_documents(units: Sequence[Sequence[Sequence[int]]], *, seq_len: int, rows: int, unit_slots: int,
                   pad_id: int = 0) -> tuple[list[PackedBatch], PackingStats]:
    """Pack ``units`` (each a list of documents, each a list of token ids) into physical batches
    of at most ``rows`` x ``seq_len`` tokens holding at most ``unit_slots`` units each (see the
    module docstring). Units without a piece of 2 tokens are left out (no slot)."""
    if seq_len < 2 or rows < 2 or unit_slots < 1:
        raise ValueError(f"pack_documents: need seq_len >= 2, rows >= 2 (the engine runs no packed batch of one row), "
                         f"unit_slots >= 1, got {seq_len}, {rows}, {unit_slots}")
    pieces = [sorted(unit_pieces(docs, seq_len), key=len, reverse=True) for docs in units]
    dropped = truncated = 0
    for i, ps in enumerate(pieces):  # a unit fits one physical batch: at most `rows` pieces of it
        if len(ps) > rows:
            dropped += sum(map(len, ps[rows:]))
            truncated += 1
            pieces[i] = ps[:rows]
    tokens = [sum(map(len, ps)) for ps in pieces]
    alone = [_rows_alone(ps, seq_len) for ps in pieces]
    order = sorted((i for i, ps in enumerate(pieces) if ps), key=lambda i: -tokens[i])
    counts = row_counts(rows)

    def next_batch(left: list[int]):
        """(members, rows of (slot, piece), rest): the next batch of the units ``left``, of the
        largest row count their tokens fill, at least the rows the unit needing most takes alone
        (left for a later batch, it would take a larger one of its own)."""
        need = -(-sum(tokens[i] for i in left) // seq_len)  # rows the units left fill at the least
        size = max((c for c in counts if c <= need), default=counts[-1])
        size = max(size, min((c for c in counts if c >= max(alone[i] for i in left)), default=rows))
        for size in sorted(c for c in counts if c >= size):  # larger only when no unit left fits
            members, rows_of, rest = _fill(left, pieces, tokens, size, seq_len, unit_slots)
            if members:
                return members, rows_of, rest
        raise AssertionError("pack_documents: a unit fits no batch")  # rows >= any unit's (truncated) rows

    halving = []  # (the units left before it, members, rows of (slot, piece)) per batch of next_batch
    left = order
    while left:
        members, rows_of, left_after = next_batch(left)
        halving.append((left, members, rows_of))
        left = left_after
    # From the last batch back: a batch and the ones chosen after it become one larger batch
    # where that holds all their units in no more rows (no more token slots, and fewer runs of
    # the graph, each of which costs its whole fixed work). A full batch has no larger count.
    chosen, chosen_rows = [], 0  # the batches chosen after the current one, the last first
    for before, members, rows_of in reversed(halving):
        chosen.append((members, rows_of))
        chosen_rows += len(rows_of)
        if len(chosen) == 1 or len(before) > unit_slots:
            continue
        for size in (c for c in sorted(counts) if len(rows_of) < c <= chosen_rows):
            one, one_rows, rest = _fill(before, pieces, tokens, size, seq_len, unit_slots)
            if not rest:
                chosen, chosen_rows = [(one, one_rows)], size
                break
    batches = chosen[::-1]
    out = [_tensors(members, rows_of, seq_len, unit_slots, pad_id) for members, rows_of in batches]
    placed = sum(tokens[i] for i in order)
    slots = sum(len(rows_of) for _, rows_of in batches) * seq_len
    used_rows = sum(1 for _, rows_of in batches for r in rows_of if r)
    stats = PackingStats(len(batches), slots, slots - placed, len(order), used_rows,
                         sum(len(pieces[i]) for i in order), dropped, truncated)
    return out, stats


def row_counts(rows: int) -> list[int]:
    """The row counts of ``pack_documents``'s physical batches: ``rows``, then halved while at
    least 2 (16 -> [16, 8, 4, 2]): one graph capture each at most."""
    counts = [rows]
    while counts[-1] // 2 >= 2:
        counts.append(counts[-1] // 2)
    return counts


def _rows_alone(pieces: list[list[int]], seq_len: int) -> int:
    """The rows a unit's pieces (longest first) take by ``_place`` into an empty batch."""
    rows_of: list[list[tuple[int, list[int]]]] = [[] for _ in pieces]
    _place(rows_of, 0, pieces, seq_len)
    return sum(1 for row in rows_of if row)


def _fill(left: list[int], pieces: list, tokens: list[int], size: int, seq_len: int, unit_slots: int):
    """(members, rows, rest): first fit of the units ``left`` (longest first) into one batch of
    ``size`` rows, at most ``unit_slots`` of them; ``rest`` the units that did not go in."""
    rows_of: list[list[tuple[int, list[int]]]] = [[] for _ in range(size)]
    free = size * seq_len
    members, rest = [], []
    for k, i in enumerate(left):
        if len(members) == unit_slots or free < tokens[left[-1]]:  # full: no unit left fits
            rest += left[k:]
            break
        if tokens[i] <= free and _place(rows_of, len(members), pieces[i], seq_len):
            members.append(i)
            free -= tokens[i]
        else:
            rest.append(i)
    return members, rows_of, rest


def packed_rows(rows_per_unit: int, units_per_batch: int) -> int:
    """The CLI's rows per packed physical batch: ``rows_per_unit`` (R) times ``units_per_batch``
    (B), the memory of B padded units, at least 2.

    A logical batch's last rows go into batches of half as many rows, a quarter, ...
    (``row_counts``), so full-size batches cost no padding at the end of a logical batch, and
    fewer, larger batches cost less per token than many small ones (each runs the whole graph).
    Measured padding: under 5% at E = 64 with R̄ up to R/3 and at E = 256 with R̄ from R/6 to R
    (``tests/test_packing.py``). Read from public parameters only, never from the units drawn."""
    return max(2, rows_per_unit * units_per_batch)  # one row would run as two: refused


def unit_slots_per_row(seq_len: int) -> int:
    """Unit slots per row of ``seq_len`` tokens: 4096 // T, at least 4 and at most 16 (16 at
    T = 256, 4 from T = 1024 on).

    Too few slots leave padding: a physical batch that has used its slots on short units takes
    no more, rows to spare or not (4 per row left 25% of the token slots padding on documents of
    median T/8 at E = 64; 16 per row, 11%). The step's per-unit work follows the units present,
    not the slots (``benchmarks/packed_slot_cost.py``), but the dense per-unit gradients (norm
    weights, biases, an LM head under cp) hold one row per slot, so their memory grows with the
    slots: kept to a slot per 256 token slots of a row at long T, where a row holds few documents.
    Fixed, not fitted to the corpus (a slot count read off the private documents would be a
    statistic of them)."""
    return min(16, max(4, 4096 // seq_len))


def unit_slots_for(rows: int, seq_len: int, expected_units: float | None = None) -> int:
    """The CLI's unit slots for physical batches of ``rows`` rows of ``seq_len`` tokens
    (``unit_slots_per_row``), and at most 2·E + 8 where the expected units per logical batch E
    is given: a physical batch holds no more units than its logical batch, which draws more
    than 2·E + 8 of them with a probability below 1e-5 (Poisson), and then only starts another
    batch. Fewer slots hold less: the dense per-unit gradients (norm weights, a tied LM head)
    keep one row per slot. E may come as q·N, a float a rounding below the E that q was taken
    from (8 / 49 · 49 < 8): it is read to 1e-9, so that both give the same slots."""
    slots = rows * unit_slots_per_row(seq_len)
    return slots if expected_units is None else max(1, min(slots, int(2 * expected_units + 1e-9) + 8))


def empty_batch(rows: int, seq_len: int, unit_slots: int, pad_id: int = 0) -> PackedBatch:
    """A physical batch of padding alone (a logical batch that drew no unit; an example to compile on)."""
    return _tensors([], [[] for _ in range(rows)], seq_len, unit_slots, pad_id)


def capture_every_row_count(engine, lm, rows: int, seq_len: int, unit_slots: int, device) -> None:
    """Lower ``engine``'s packed graph (``lm``: the model it trains) for every row count a logical
    batch of ``rows``-row physical batches may end in (``row_counts``), so that no step pays for a
    capture; the fewest rows' on random documents (``_probe_batch``), so that the engine's
    isolation probe runs (a batch of padding gives it nothing to watch) and refuses, before any
    step, a model that lets a row's units reach each other. Every rank lowers the same batches:
    under torch.distributed the ranks refuse together. Raises ``UnsupportedModelError``."""
    *larger, fewest = row_counts(rows)  # the probe's runs on the fewest rows cost least
    engine.lower(*(t.to(device) for t in _probe_batch(lm, fewest, seq_len)))
    for count in larger:
        engine.lower(*(t.to(device) for t in empty_batch(count, seq_len, unit_slots).tensors()))


def _probe_batch(lm, rows: int, seq_len: int) -> tuple:
    """A packed batch of ``rows`` random documents of ``seq_len`` tokens (one unit; public values,
    none of the training data) whose tokens have gradients."""
    embeddings = lm.get_input_embeddings() if hasattr(lm, "get_input_embeddings") else \
        next((m for m in lm.modules() if isinstance(m, torch.nn.Embedding)), None)
    vocab = min(256, embeddings.num_embeddings) if embeddings is not None else 256
    ids = torch.randint(0, vocab, (rows, seq_len), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(seq_len).expand(rows, seq_len).contiguous()
    return ids, ids.clone(), positions, torch.zeros_like(ids)


def _place(rows_of: list, slot: int, pieces: list[list[int]], seq_len: int) -> bool:
    """First fit of each piece (longest first) into the rows; all or nothing."""
    free = [seq_len - sum(len(p) for _, p in r) for r in rows_of]
    chosen = []
    for piece in pieces:
        row = next((r for r, f in enumerate(free) if f >= len(piece)), None)
        if row is None:
            return False
        free[row] -= len(piece)
        chosen.append(row)
    for row, piece in zip(chosen, pieces):
        rows_of[row].append((slot, piece))
    return True


def _tensors(members, rows_of, seq_len: int, unit_slots: int, pad_id: int) -> PackedBatch:
    B = len(rows_of)
    ids = torch.full((B, seq_len), pad_id, dtype=torch.long)
    labels = torch.full((B, seq_len), -100, dtype=torch.long)
    positions = torch.zeros(B, seq_len, dtype=torch.long)
    units = torch.full((B, seq_len), unit_slots, dtype=torch.long)
    for r, row in enumerate(rows_of):
        t = 0
        for slot, piece in sorted(row, key=lambda sp: sp[0]):  # a row's pieces in slot order
            n = len(piece)
            ids[r, t:t + n] = labels[r, t:t + n] = torch.tensor(piece)
            positions[r, t:t + n] = torch.arange(n)
            units[r, t:t + n] = slot
            t += n
        # positions[r, t:] stay 0: each padding token a segment of its own, so padding shares no
        # attention block with anything (under cp a block without a shared document is skipped)
    return PackedBatch(ids, labels, positions, units, list(members))


class PackedPoissonBatches(PoissonBatches):
    """Poisson sampling over units, then the sampled units packed into physical batches.

    Every unit joins a logical batch independently with probability ``sample_rate`` (the
    draw, its secret stream, ``steps``, ``state_dict`` and ``insecure_seed`` are
    ``PoissonBatches``'s), so q and the expected batch size count units, whatever their
    lengths. The sampled units are then packed (``pack_documents``): how many physical batches
    a logical batch needs, and of how many rows each, depends on the units drawn and is not
    released; a logical batch that drew no unit is one physical batch of padding (of the fewest
    rows), run and noised like any other. Each
    physical batch is ``(PackedBatch.tensors(), None)``: no mask, the unit slots say who is in it.

    ``units``: a list of units, each a list of documents (lists of token ids). A unit with no
    piece of 2 tokens predicts nothing and is refused (it would count in q·N without a sample);
    a unit longer than one physical batch is cut to the pieces that fit, and counted
    (``truncated_units``, ``dropped_tokens``).
    """

    def __init__(self, units, sample_rate: float, *, seq_len: int, rows: int, unit_slots: int, pad_id: int = 0,
                 insecure_seed: int | None = None, steps: int | None = None) -> None:
        if rows < 2:
            raise ValueError(f"PackedPoissonBatches: rows must be >= 2 (the engine runs no packed batch of one row), "
                             f"got {rows}")
        pieces = [sorted(unit_pieces(docs, seq_len), key=len, reverse=True) for docs in units]
        empty = [i for i, ps in enumerate(pieces) if not ps]
        if empty:
            more = f" (and {len(empty) - 1} more)" if len(empty) > 1 else ""
            raise ValueError(f"PackedPoissonBatches: unit {empty[0]}{more} has no piece of 2 tokens: it predicts "
                             "nothing. Leave such units out")
        self.truncated_units = sum(len(ps) > rows for ps in pieces)
        self.dropped_tokens = sum(sum(map(len, ps[rows:])) for ps in pieces)
        self._pieces = [ps[:rows] for ps in pieces]
        self._sampling(len(units), sample_rate, steps, insecure_seed)
        self.physical_batch_size = rows
        self.seq_len, self.unit_slots, self.pad_id = seq_len, unit_slots, pad_id

    def _physical(self, indices: torch.Tensor) -> list:
        packed, _ = pack_documents([self._pieces[i] for i in indices.tolist()], seq_len=self.seq_len,
                                   rows=self.physical_batch_size, unit_slots=self.unit_slots, pad_id=self.pad_id)
        for pb in packed:  # members index the caller's units
            pb.members = [int(indices[m]) for m in pb.members]
        if not packed:  # as few rows as a packed batch has
            packed = [empty_batch(row_counts(self.physical_batch_size)[-1], self.seq_len, self.unit_slots, self.pad_id)]
        return [(pb.tensors(), None) for pb in packed]

    def _blank(self) -> tuple:
        return empty_batch(self.physical_batch_size, self.seq_len, self.unit_slots, self.pad_id).tensors(), None
