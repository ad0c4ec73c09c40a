"""Packing units into fixed-shape physical batches (``longshield_fx.packing``), and Poisson
sampling over units before packing."""
import math

import pytest
import torch

from longshield_fx.data import LogicalBatch
from longshield_fx.packing import PackedPoissonBatches, pack_documents, row_counts, unit_pieces


def _corpus(n: int, seq_len: int, seed: int = 0) -> list[list[list[int]]]:
    """Units of one or two documents with log-normal lengths: median seq_len/8, a tail past 4·seq_len."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.exp(torch.randn(n, 2, generator=g) * 1.2 + math.log(seq_len / 8)).long().clamp(min=2)
    two = torch.rand(n, generator=g) < 0.2
    return [[list(range(int(lengths[i, j]))) for j in range(1 + int(two[i]))] for i in range(n)]


def test_every_piece_placed_once_in_its_units_batch():
    seq_len, rows, slots = 64, 4, 12
    units = _corpus(60, seq_len)
    batches, stats = pack_documents(units, seq_len=seq_len, rows=rows, unit_slots=slots, pad_id=7)
    seen = set()
    for pb in batches:
        size = pb.input_ids.shape[0]
        assert pb.input_ids.shape == pb.labels.shape == pb.position_ids.shape == pb.units.shape == (size, seq_len)
        assert size in row_counts(rows) and len(pb.members) <= slots
        for slot, unit in enumerate(pb.members):
            assert unit not in seen  # a unit lives in one physical batch
            seen.add(unit)
            expected = unit_pieces(units[unit], seq_len)[:rows]
            got = []
            for r in range(size):  # pieces in a row: runs of the slot whose positions count from 0
                where = (pb.units[r] == slot).nonzero().squeeze(1).tolist()
                piece = []
                for t in where:
                    if pb.position_ids[r, t] == 0 and piece:
                        got.append(piece)
                        piece = []
                    piece.append(int(pb.input_ids[r, t]))
                    assert pb.labels[r, t] == pb.input_ids[r, t]
                if piece:
                    got.append(piece)
            assert sorted(got) == sorted(expected)
        padding = pb.units == slots
        assert bool((pb.labels[padding] == -100).all()) and bool((pb.input_ids[padding] == 7).all())
    assert seen == {i for i, u in enumerate(units) if unit_pieces(u, seq_len)}
    placed = sum(len(p) for i in seen for p in unit_pieces(units[i], seq_len)[:rows])
    assert stats.token_slots - stats.padding_slots == placed
    assert stats.truncated_units == sum(len(unit_pieces(u, seq_len)) > rows for u in units)


def test_padding_is_small_on_a_skewed_corpus():
    """Log-normal lengths, median T/8 and a tail beyond 4T: the padded (N, R, T) layout of the same
    units spends most of its slots on padding; packed, about 1% (what first-fit leaves at row
    ends, and the last batches' empty rows: a logical batch ends in batches of fewer rows)."""
    seq_len, rows = 256, 16
    units = _corpus(1000, seq_len, seed=1)
    _, stats = pack_documents(units, seq_len=seq_len, rows=rows, unit_slots=16 * rows)
    pieces = [unit_pieces(u, seq_len)[:rows] for u in units]
    R = max(map(len, pieces))
    unpacked_padding = 1 - sum(len(p) for ps in pieces for p in ps) / (len(units) * R * seq_len)
    empty_rows = stats.token_slots // seq_len - stats.rows_used
    within_rows = (stats.padding_slots - empty_rows * seq_len) / (stats.rows_used * seq_len)
    assert stats.padding_fraction <= 0.015 and within_rows <= 0.01 and empty_rows <= 2, stats
    assert unpacked_padding >= 0.4
    assert stats.pieces_per_row > 2


def test_a_unit_longer_than_a_batch_keeps_what_fits_and_is_counted():
    batches, stats = pack_documents([[list(range(50))], [[1, 2, 3]]], seq_len=8, rows=3, unit_slots=4)
    assert stats.truncated_units == 1 and stats.dropped_tokens == 50 - 24
    assert [pb.members for pb in batches] == [[0], [1]]  # the long unit fills its batch


def test_no_unit_is_split_over_slots_and_slots_are_bounded():
    units = [[[1, 2, 3]] for _ in range(10)]
    batches, _ = pack_documents(units, seq_len=16, rows=2, unit_slots=3)
    assert [len(pb.members) for pb in batches] == [3, 3, 3, 1]
    assert all(int(pb.units.max()) == 3 for pb in batches)


def test_the_rows_left_go_into_batches_of_a_half_a_quarter_of_the_rows():
    """Units of whole rows: 21 rows' worth in batches of 8 rows make 8 + 8 + 4 + 2, not three of
    8; 23 rows' worth make three of 8, not 8 + 8 + 4 + 2 + 2 (the same rows in fewer batches);
    a unit of 3 rows, too long for the 2 rows its tokens ask for, goes into 4; a unit of 3
    short pieces, which share a row, into 2."""
    assert row_counts(16) == [16, 8, 4, 2] and row_counts(6) == [6, 3] and row_counts(3) == [3] and row_counts(2) == [2]
    batches, stats = pack_documents([[[1] * 4] for _ in range(21)], seq_len=4, rows=8, unit_slots=64)
    assert [pb.units.shape[0] for pb in batches] == [8, 8, 4, 2]
    assert stats.padding_slots == 4 and stats.token_slots == 22 * 4
    batches, stats = pack_documents([[[1] * 4] for _ in range(23)], seq_len=4, rows=8, unit_slots=64)
    assert [pb.units.shape[0] for pb in batches] == [8, 8, 8]
    assert stats.padding_slots == 4 and stats.token_slots == 24 * 4
    batches, _ = pack_documents([[[1] * 12]], seq_len=4, rows=8, unit_slots=64)
    assert [pb.units.shape[0] for pb in batches] == [4]
    batches, _ = pack_documents([[[1] * 4] * 3], seq_len=16, rows=8, unit_slots=64)  # 3 pieces, 1 row
    assert [pb.units.shape[0] for pb in batches] == [2]


def test_a_logical_batchs_last_rows_take_the_fewest_batches_of_those_rows():
    """The tail of a logical batch goes into one batch of a larger row count wherever that holds
    it in no more rows than the halving batches would: on a skewed corpus, draws of E units
    give the same token slots as the halving batches alone, in fewer batches (each runs the
    whole graph). The halving batches' counts were measured on the same draws before the rule."""
    units = _corpus(2000, 256, seed=3)
    g = torch.Generator().manual_seed(0)
    batches = slots = padding = 0
    for _ in range(40):
        drawn = (torch.rand(2000, generator=g) < 64 / 2000).nonzero().flatten().tolist()
        packed, stats = pack_documents([units[i] for i in drawn], seq_len=256, rows=16, unit_slots=136)
        batches, slots, padding = batches + len(packed), slots + stats.token_slots, padding + stats.padding_slots
    assert batches == 89 and padding / slots == pytest.approx(0.0482, abs=5e-5)  # halving alone: 107 batches
    packed, _ = pack_documents([[[1, 2]]] * 1200, seq_len=256, rows=128, unit_slots=1)  # a tail of 1200 batches
    assert len(packed) == 1200 and sorted(m for pb in packed for m in pb.members) == list(range(1200))


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="seq_len >= 2"):
        pack_documents([[[1, 2]]], seq_len=1, rows=2, unit_slots=1)
    with pytest.raises(ValueError, match="rows >= 2"):
        pack_documents([[[1, 2]]], seq_len=4, rows=1, unit_slots=1)


def test_poisson_over_units_then_packed():
    units = _corpus(40, 32, seed=2)
    units = [u for u in units if unit_pieces(u, 32)]
    sampler = PackedPoissonBatches(units, 0.3, seq_len=32, rows=4, unit_slots=8, insecure_seed=5, steps=6)
    assert sampler.num_examples == len(units) and sampler.expected_batch_size == pytest.approx(0.3 * len(units))
    for batch in sampler:
        slots = 0
        for tensors, mask in batch.physical:
            assert mask is None and len(tensors) == 4 and tensors[3].shape in ((4, 32), (2, 32))
            slots += len(set(tensors[3].flatten().tolist()) - {8})
        assert slots == batch.size  # every sampled unit holds one slot in one physical batch


def test_an_empty_draw_is_one_batch_of_padding():
    sampler = PackedPoissonBatches([[[1, 2, 3]]], 1e-9, seq_len=8, rows=8, unit_slots=2, insecure_seed=0, steps=1)
    (batch,) = list(sampler)
    assert batch.size == 0 and len(batch.physical) == 1
    (ids, labels, _, units), mask = batch.physical[0]
    assert mask is None and bool((units == 2).all()) and bool((labels == -100).all())
    assert ids.shape == (2, 8)  # of the fewest rows a packed batch has


def test_data_parallel_groups_run_batches_of_the_same_rows_side_by_side():
    """``LogicalBatch.share`` over 2 groups: packed batches of 8, 8, 8, 4, 2 rows become rounds
    (8, 8), (8, blank 8), (4, blank 4), (2, blank 2): each group runs as many batches, the i-th
    of every group has the same rows, and each real batch runs once."""
    units = [[[1] * 4] for _ in range(29)] + [[[1, 2]]]
    sampler = PackedPoissonBatches(units, 1.0, seq_len=4, rows=8, unit_slots=64, insecure_seed=0, steps=1)
    (batch,) = list(sampler)
    assert [t[0].shape[0] for t, _ in batch.physical] == [8, 8, 8, 4, 2]
    mine = [batch.share(rank, 2) for rank in range(2)]
    assert [[t[0].shape[0] for t, _ in m] for m in mine] == [[8, 8, 4, 2], [8, 8, 4, 2]]
    assert [[bool((t[3] < 64).any()) for t, _ in m] for m in mine] == [[True] * 4, [True, False, False, False]]
    real = [t for m in mine for t, _ in m if bool((t[3] < 64).any())]
    assert len(real) == 5 and sum(len(set(t[3].flatten().tolist()) - {64}) for t in real) == batch.size == 30


def test_packed_batches_shared_without_a_blank_are_refused_by_name():
    """A packed logical batch made by hand, with no ``blank``: sharing it would have to pad a group
    with a copy of a real batch (its units clipped twice); it is refused, naming the way out."""
    packed, _ = pack_documents([[[1] * 4]] * 10, seq_len=4, rows=4, unit_slots=8)
    batch = LogicalBatch(10, torch.arange(10), [(p.tensors(), None) for p in packed], 1.0, 10.0)
    assert batch.share(0, 1) == batch.physical
    with pytest.raises(ValueError, match=r"need blank=.*empty_batch.*clip its units twice"):
        batch.share(0, 2)


def test_a_unit_with_nothing_to_predict_is_refused():
    with pytest.raises(ValueError, match=r"unit 1 has no piece of 2 tokens"):
        PackedPoissonBatches([[[1, 2]], [[3]]], 0.5, seq_len=8, rows=2, unit_slots=2, insecure_seed=0)


def test_a_restored_sampler_draws_what_the_uninterrupted_one_draws():
    units = [u for u in _corpus(30, 16, seed=3) if unit_pieces(u, 16)]
    make = lambda: PackedPoissonBatches(units, 0.3, seq_len=16, rows=4, unit_slots=8, insecure_seed=9, steps=6)
    whole = [[t for t, _ in b.physical] for b in make()]
    first = make()
    it = iter(first)
    for _ in range(2):
        next(it)
    resumed = make()
    resumed.load_state_dict(first.state_dict())
    rest = [[t for t, _ in b.physical] for b in resumed]
    assert len(rest) == 4
    for got, want in zip(rest, whole[2:]):
        assert len(got) == len(want) and all(torch.equal(a, b) for g, w in zip(got, want) for a, b in zip(g, w))



@pytest.mark.parametrize("E, mean_rows_of_R", [(64, 1 / 6), (64, 1 / 3), (256, 1 / 6), (256, 1 / 2), (256, 1.0)])
def test_the_clis_packed_rows_leave_under_5_percent_padding_from_64_units(E, mean_rows_of_R):
    """``packed_rows``: B·R rows, a logical batch's last in batches of B·R/2, B·R/4, ... Units of
    whole rows (no padding within rows), a mean of R/6 to R rows each, Poisson draws: the padding
    left (each unit whole in one physical batch, the last batches partly filled) stays under 5%."""
    from longshield_fx.packing import packed_rows

    assert packed_rows(8, 4) == 32 and packed_rows(1, 1) == 2 and packed_rows(32, 1) == 32
    seq_len, R, B, n = 8, 12, 4, 4 * E
    g = torch.Generator().manual_seed(3)
    mean = max(1.0, mean_rows_of_R * R)
    rows_of = (torch.rand(n, generator=g) * 2 * mean).round().clamp(1, R).long().tolist()
    units = [[[1] * seq_len for _ in range(r)] for r in rows_of]
    rows = packed_rows(R, B)
    sampler = PackedPoissonBatches(units, E / n, seq_len=seq_len, rows=rows, unit_slots=4 * rows,
                                   insecure_seed=1, steps=20)
    slots = real = 0
    for batch in sampler:
        for (ids, labels, positions, unit), _ in batch.physical:
            slots += ids.numel()
            real += int((unit < 4 * rows).sum())
    assert 1 - real / slots < 0.05, 1 - real / slots


def test_the_clis_unit_slots_leave_room_for_short_documents():
    """``unit_slots_per_row``: 4096 // T within [4, 16], at most 2·E + 8 in all. Documents of median
    T/8 (log-normal, σ = 1.2) at E = 128 in the CLI's 16-row batches: with its slots the padding
    stays under 5% (2.8%); with one slot per row the slots run out before the rows do and over
    20% of the token slots are padding (39%)."""
    import math

    from longshield_fx.packing import packed_rows, unit_slots_for, unit_slots_per_row

    assert [unit_slots_per_row(T) for T in (64, 256, 512, 1024, 32768)] == [16, 16, 8, 4, 4]
    assert unit_slots_for(16, 256) == unit_slots_for(16, 256, 128) == 256 and unit_slots_for(16, 256, 24) == 56
    # E as the sampler's q·N (train) or as given (inspect): the same slots, though 8 / 49 · 49 < 8
    assert all(unit_slots_for(16, 256, 8 / N * N) == unit_slots_for(16, 256, 8) == 24 for N in (49, 98, 103, 107))
    seq_len, R, B, E, n = 256, 4, 4, 128, 2000
    g = torch.Generator().manual_seed(0)
    lengths = torch.exp(torch.randn(n, generator=g) * 1.2 + math.log(seq_len / 8)).long().clamp(2, R * seq_len)
    units = [[[1] * int(length)] for length in lengths]
    rows = packed_rows(R, B)
    padding = {}
    for slots in (unit_slots_for(rows, seq_len, E), rows):
        sampler = PackedPoissonBatches(units, E / n, seq_len=seq_len, rows=rows, unit_slots=slots,
                                       insecure_seed=1, steps=10)
        total = real = 0
        for batch in sampler:
            for (ids, labels, positions, unit), _ in batch.physical:
                total += ids.numel()
                real += int((unit < slots).sum())
        padding[slots] = 1 - real / total
    assert padding[unit_slots_for(rows, seq_len, E)] < 0.05 and padding[rows] > 0.2, padding


def test_every_row_count_is_captured_with_the_probe_on_a_model_of_fewer_than_256_tokens(caplog):
    """``capture_every_row_count`` on the reference Llama (no ``get_input_embeddings``) with a
    64-token vocabulary: its random documents stay in the vocabulary, and the probe runs."""
    import longshield_fx as lf
    from longshield_fx.models.llama import Llama
    from longshield_fx.packing import capture_every_row_count
    from oracles import PACKED_CFG

    engine = lf.compile(lf.PackedCausalLMLoss(Llama(PACKED_CFG)), config=lf.DPConfig(1.0, 1.0, insecure_seed=0),
                        packed_units=8)
    with caplog.at_level("INFO", logger="longshield_fx"):
        capture_every_row_count(engine, engine.model.lm, 4, 16, 8, "cpu")
    assert engine.captures == 2 and "the packed isolation probe passed" in caplog.text
