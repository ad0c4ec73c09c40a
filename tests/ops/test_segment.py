"""The segment ops (longshield_fx/ops/segment.py) that ``clip`` runs on packed documents, against
each unit's product formed alone: values, slots that are never read, and work and values that
depend neither on how many empty slots the counts reserve nor on where a unit's rows lie (one
run, sorted by slot, or several runs scattered among other units' and padding)."""
from __future__ import annotations

import pytest
import torch

from longshield_fx.ops import segment

N, P, D = 120, 16, 24
LENGTHS = [5, 0, 40, 3, 0, 30, 12, 0, 10, 20]  # slot 1, 4 and 7 empty; 120 rows
LAYOUTS = ["sorted", "scattered"]
ops = torch.ops.longshield


def _rows(seed: int = 0, p: int = P, d: int = D):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, p, generator=g), torch.randn(N, d, generator=g)


def _layout(layout: str = "sorted", lengths=LENGTHS, slots: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(unit, counts): each row's slot and the slots' counts, ``lengths`` then empty slots up to
    ``slots``. Sorted: slot 0's rows first, then slot 1's...; scattered: the same rows cut into
    blocks of 8 and shuffled, so most units are several runs among other units' rows."""
    counts = torch.tensor(lengths + [0] * ((slots or len(lengths)) - len(lengths)))
    unit = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    unit = torch.cat([unit, torch.full((N - unit.numel(),), len(lengths) - 1)])  # rows after: the last slot's
    if layout == "scattered":
        unit = unit.view(-1, 8)[torch.randperm(N // 8, generator=torch.Generator().manual_seed(3))].flatten()
    return unit, counts


def _products(a, b, unit, counts) -> torch.Tensor:
    """Each slot's a_sᵀ b_s over its rows wherever they lie, in float64 (zero for an empty slot)."""
    out = torch.zeros(len(counts), a.shape[1], b.shape[1], dtype=torch.float64)
    for s in range(len(counts)):
        if counts[s] > 0:
            rows = unit == s
            out[s] = a[rows].double().t() @ b[rows].double()
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("capacity", [1, 3, 7, 12, 20])
def test_per_unit_norms_and_clipped_sum_equal_each_unit_alone(capacity, layout):
    """Products held (capacity ≥ the 7 units; over twice them, written one by one on the CPU) or
    formed again (fewer): the same norms and sum, whether a unit's rows are one run or several."""
    a, b = _rows()
    unit, counts = _layout(layout)
    exact = _products(a, b, unit, counts)
    sq, held = ops.segment_outer_norms(a, b, unit, counts, capacity)
    assert held.shape == (capacity, P, D)
    torch.testing.assert_close(sq, exact.pow(2).sum((1, 2)), rtol=2e-5, atol=0)  # raised by its bound, 1.55e-5
    assert bool((sq[counts == 0] == 0).all())
    factor = torch.rand(len(counts), generator=torch.Generator().manual_seed(1))
    keep = counts > 0
    keep[5] = False
    total = ops.segment_outer_clipped_sum(a, b, unit, counts, held, sq, factor, keep)
    expected = (exact * torch.where(keep, factor, 0).double()[:, None, None]).sum(0)
    torch.testing.assert_close(total.double(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ops.segment_outer(a, b, unit, counts).double(), exact, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_products_gathered_for_one_grouped_matmul_equal_the_loop(layout, monkeypatch):
    """Where a grouped matmul is one kernel (a GPU), scattered rows are gathered into slot order
    for it; the CPU's grouped matmul, made to run that way, gives the loop's products."""
    a, b = _rows()
    unit, counts = _layout(layout)
    looped = ops.segment_outer_norms(a, b, unit, counts, 20)
    monkeypatch.setattr(segment, "_LOOPING", ())
    grouped = ops.segment_outer_norms(a, b, unit, counts, 20)
    torch.testing.assert_close(grouped[0], looped[0], rtol=1e-6, atol=0)
    torch.testing.assert_close(grouped[1][:7], looped[1][:7], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("capacity", [2, 6])
def test_units_of_one_length_evenly_spaced_are_one_bmm_of_the_loops_products(dtype, capacity, monkeypatch):
    """Long documents cut to whole rows make batches of units of one length, evenly spaced
    (slots 0-2 here: 20 rows each, then 4 rows of padding; slot 4, as long, comes after a unit
    of another length), read from operands that start inside their storage: those units'
    products are one ``bmm`` over a strided view of the rows, the loop's values to rounding,
    whether held (capacity 6) or formed again for the clipped sum (2); their norms and the
    clipped sum are each unit alone's; an inf in one of them stays in its product."""
    unit = torch.cat([torch.tensor([s] * 20 + [6] * 4) for s in range(3)] +
                     [torch.full((10,), 3), torch.full((20,), 4), torch.full((18,), 5)])
    counts = torch.bincount(unit, minlength=7)
    counts[6] = 0  # the padding slot
    assert segment._evenly_spaced(segment._units(unit, counts)[1]) == [(0, 3, 0, 20, 24)]
    g = torch.Generator().manual_seed(4)
    a, b = (torch.randn(7 + N, w, generator=g).to(dtype)[7:] for w in (P, D))
    a[30, 2] = float("inf")  # a row of slot 1
    exact = _products(a, b, unit, counts)
    sq, held = ops.segment_outer_norms(a, b, unit, counts, capacity)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=0.1)
    finite = torch.tensor([0, 2, 3, 4, 5])
    torch.testing.assert_close(held[finite[finite < capacity]].double(), exact[finite[finite < capacity]], **tol)
    torch.testing.assert_close(sq[finite], exact[finite].pow(2).sum((1, 2)), rtol=2e-5 if dtype == torch.float32
                               else 2e-2, atol=0)
    assert not sq[1].isfinite()
    factor = torch.rand(7, generator=g)
    keep = sq.isfinite() & (counts > 0)
    total = ops.segment_outer_clipped_sum(a, b, unit, counts, held, sq, factor, keep)
    expected = (exact[finite] * factor[finite].double()[:, None, None]).sum(0)
    torch.testing.assert_close(total.double(), expected, **tol)
    if capacity > 1:
        assert not held[1].isfinite().all()
    monkeypatch.setattr(segment, "_evenly_spaced", lambda units: [])  # every product by the loop
    looped = ops.segment_outer_norms(a, b, unit, counts, capacity)[1]
    kept = finite[finite < capacity]
    torch.testing.assert_close(held[kept], looped[kept], **tol)


def test_a_product_formed_again_with_another_norm_never_exceeds_the_norm_its_factor_used(monkeypatch):
    """A product beyond the held ones is formed again; were its rounding not the same (another
    kernel), its contribution is scaled to the norm clip used, and dropped if no longer finite."""
    a, b = _rows()
    unit, counts = _layout()
    sq, held = ops.segment_outer_norms(a, b, unit, counts, 1)
    real = segment._products

    def another_rounding(a, b, units, groups=0):
        out = real(a, b, units, groups)
        out[0] *= 1.5  # the first unit formed again: 1.5x the norm its factor was computed from
        if len(units) > 1:
            out[1, 0, 0] = float("nan")  # the second: no longer finite
        return out
    monkeypatch.setattr(segment, "_products", another_rounding)
    for slot in (2, 3, 5):  # the first three units after the held one (slot 0)
        keep = torch.zeros(len(counts), dtype=torch.bool)
        keep[slot] = True
        total = segment.segment_outer_clipped_sum(a, b, unit, counts, held, sq, torch.ones(len(counts)), keep)
        if slot == 2:  # scaled back to the norm clip used (sq bounds it from above, within 1.6e-5)
            got = float(total.double().pow(2).sum())
            assert got <= float(sq[slot]) and got == pytest.approx(float(sq[slot]), rel=2e-5)
        elif slot == 3:
            assert bool((total == 0).all())
        else:
            torch.testing.assert_close(total.double(), _products(a, b, unit, counts)[slot], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rows_of_slots_not_kept_are_never_read(layout):
    """A unit whose rows hold inf and nan and is not kept leaves every sum finite and unchanged."""
    a, b = _rows()
    unit, counts = _layout(layout)
    keep = counts > 0
    keep[2] = False
    factor = torch.rand(len(counts), dtype=torch.float64)
    clean = [ops.segment_outer_clipped_sum(a, b, unit, counts, *reversed(ops.segment_outer_norms(a, b, unit, counts, 3)),
                                           factor.float(), keep),
             ops.segment_book_keeping(a, b, unit, counts, factor, keep)]
    rows = (unit == 2).nonzero().flatten()
    a[rows] = float("nan")
    b[rows[1], 0] = float("inf")
    sq, held = ops.segment_outer_norms(a, b, unit, counts, 3)
    assert not torch.isfinite(sq[2]) and bool(torch.isfinite(sq[counts > 0][[0, 2, 3, 4, 5, 6]]).all())
    dirty = [ops.segment_outer_clipped_sum(a, b, unit, counts, held, sq, factor.float(), keep),
             ops.segment_book_keeping(a, b, unit, counts, factor, keep)]
    for c, d in zip(clean, dirty):
        assert torch.equal(c, d)
    x = torch.randn(len(counts), 3, 5)
    x[counts == 0] = float("nan")  # an empty slot's rows: never read
    x[2] = float("inf")
    sq = ops.unit_sq_norms(x, counts)
    assert bool((sq[counts == 0] == 0).all()) and not torch.isfinite(sq[2])
    total = ops.unit_weighted_sum(x, factor, keep)
    torch.testing.assert_close(total, (x[keep] * factor[keep, None, None].float()).sum(0))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_ghost_norm_and_book_keeping_equal_each_unit_alone(layout):
    """Short units by Grams, long ones by their product (W = P·D/(P+D) = 9 rows), both within
    the float64 rounding bound clip adds; book-keeping over the kept units' rows."""
    a, b = _rows()
    unit, counts = _layout(layout)
    exact = _products(a, b, unit, counts)
    sq = ops.segment_sq_norm(a, b, unit, counts)
    size = torch.zeros(len(counts), dtype=torch.float64).index_add_(
        0, unit, a.double().norm(dim=1) * b.double().norm(dim=1))
    n = counts.double()
    bound = 2 * (n * n + P * D + P + D + 1) * 2.0 ** -53 * size ** 2 * 1.01
    assert bool(((sq - exact.pow(2).sum((1, 2))).abs() <= bound).all())
    factor, keep = torch.rand(len(counts), dtype=torch.float64), counts > 0
    keep[6] = False
    expected = (exact * torch.where(keep, factor, 0)[:, None, None]).sum(0)
    torch.testing.assert_close(ops.segment_book_keeping(a, b, unit, counts, factor, keep).double(), expected,
                               rtol=1e-6, atol=1e-6)


def test_the_same_units_in_either_layout_give_the_same_values():
    """A unit's rows moved (one run, or several among other units') change no norm beyond
    rounding and no clipped sum beyond it: each op reads a unit's rows wherever they lie."""
    a, b = _rows()
    (u0, counts), (u1, _) = _layout("sorted"), _layout("scattered")
    where = torch.cat([(u1 == s).nonzero().flatten() for s in range(len(counts))])  # scattered row of each sorted one
    a1, b1 = torch.empty_like(a), torch.empty_like(b)
    a1[where], b1[where] = a, b
    factor = torch.rand(len(counts), dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    keep = counts > 0
    for x, y, unit in ((a, b, u0), (a1, b1, u1)):
        sq, held = ops.segment_outer_norms(x, y, unit, counts, 3)
        values = [sq, ops.segment_outer_clipped_sum(x, y, unit, counts, held, sq, factor.float(), keep),
                  ops.segment_sq_norm(x, y, unit, counts), ops.segment_book_keeping(x, y, unit, counts, factor, keep)]
        if unit is u0:
            first = values
    for got, want in zip(values, first):  # summed in another order: fp32 rounding apart
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_empty_slots_change_no_value():
    """The same rows with 10 or 1000 slots (the extra ones empty, as a larger U leaves them): every
    op gives the same bits, and reads no row of an empty slot."""
    a, b = _rows()
    factor = torch.rand(1000, dtype=torch.float64)
    rows = torch.randn(1000, 3, 5, generator=torch.Generator().manual_seed(2))
    results = []
    for slots in (None, 1000):
        unit, counts = _layout("scattered", slots=slots)
        S = len(counts)
        keep = counts > 0
        x = rows[:S].clone()
        x[10:] = float("nan")
        sq, held = ops.segment_outer_norms(a, b, unit, counts, 4)
        results.append([sq[:10], ops.segment_outer_clipped_sum(a, b, unit, counts, held, sq, factor[:S].float(), keep),
                        ops.segment_sq_norm(a, b, unit, counts)[:10],
                        ops.segment_book_keeping(a, b, unit, counts, factor[:S], keep),
                        ops.unit_sq_norms(x, counts)[:10], ops.unit_weighted_sum(x, factor[:S], keep)])
    for s, l in zip(*results):
        assert torch.equal(s, l)


def test_units_found_on_another_device_are_not_compared_with_these(monkeypatch):
    """The units found once per step are cached by value; a process that ran a graph on another
    device (a GPU check comparing with the CPU) holds them there, and they are skipped, not
    compared (``torch.equal`` refuses two devices): the CPU's own units are found."""
    a, b = _rows()
    unit, counts = _layout("scattered")
    expected = ops.segment_outer_norms(a, b, unit, counts, 4)[0]
    other = (unit.to("meta"), counts.to("meta"), "units found on the meta device")
    monkeypatch.setattr(segment, "_found_units", [other, other])
    assert torch.equal(ops.segment_outer_norms(a, b, unit, counts, 4)[0], expected)
    assert segment._found_units[1] is other


def test_the_clipped_sum_of_products_all_held_needs_no_token_rows():
    """With a product held for every unit, the clipped sum reads no token row (a graph may let
    them go after the norms); with fewer held and no rows to form the others it refuses by name."""
    a, b = _rows()
    unit, counts = _layout("scattered")
    factor = torch.rand(len(counts), dtype=torch.float32, generator=torch.Generator().manual_seed(7))
    keep = counts > 0
    sq, held = ops.segment_outer_norms(a, b, unit, counts, len(counts))
    want = ops.segment_outer_clipped_sum(a, b, unit, counts, held, sq, factor, keep)
    assert torch.equal(ops.segment_outer_clipped_sum(None, None, unit, counts, held, sq, factor, keep), want)
    sq, held = ops.segment_outer_norms(a, b, unit, counts, 3)
    with pytest.raises(ValueError, match="3 products held and no token rows"):
        ops.segment_outer_clipped_sum(None, None, unit, counts, held, sq, factor, keep)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("present", [[0, 1, 2, 3], [0, 2, 5]])
def test_dense_per_unit_rows_are_read_only_for_the_slots_present(present, dtype):
    """``unit_sq_norms`` and ``unit_weighted_sum`` on (S, ...) rows: slots 0..k-1 (as a batch's units fill
    them, read in place) or scattered ones (gathered); every other row nan, never read."""
    x = torch.full((7, 4, 6), float("nan"), dtype=dtype)
    x[present] = torch.randn(len(present), 4, 6, generator=torch.Generator().manual_seed(5)).to(dtype)
    counts = torch.zeros(7, dtype=torch.int64)
    counts[present] = 3
    factor = torch.rand(7, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    sq = ops.unit_sq_norms(x, counts)
    exact = x[present].double().pow(2).sum((1, 2))
    assert bool((sq[counts == 0] == 0).all())
    assert bool((sq[present] >= exact).all()) and bool((sq[present] <= exact * (1 + 1.6e-5)).all())
    total = ops.unit_weighted_sum(x, factor, counts > 0)
    want = (x[present].double() * factor[present, None, None]).sum(0)
    torch.testing.assert_close(total.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("operand", ["a column slice", "rows starting off 16 bytes", "column-major"])
def test_operands_the_grouped_matmul_cannot_take_as_they_lie_are_gathered_for_it(operand):
    """The CPU's grouped matmul takes adjacent units' rows where they lie only from a row-major
    operand whose rows start at multiples of 16 bytes; other operands (a column slice of a wider
    tensor, one starting 4 bytes into its storage, a column-major one) are gathered first, and
    the products are each unit's own."""
    g = torch.Generator().manual_seed(9)
    a, b = _rows()
    if operand == "a column slice":
        a = torch.randn(N, P + 2, generator=g)[:, :P]  # rows 72 bytes apart
    elif operand == "rows starting off 16 bytes":
        a = torch.randn(N, P + 4, generator=g)[:, 1:P + 1]  # 80 bytes apart, the first 4 bytes in
    else:
        a = torch.randn(P, N, generator=g).t()
    unit, counts = _layout("sorted")
    assert segment._adjacent(segment._units(unit, counts)[1]) and not segment._as_they_lie(a)
    exact = _products(a, b, unit, counts)
    sq, held = ops.segment_outer_norms(a, b, unit, counts, 7)  # 7 units in 7 groups: the grouped matmul
    torch.testing.assert_close(held.double(), exact[counts > 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ops.segment_outer(a, b, unit, counts).double(), exact, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("capacity", [7, 2])
def test_a_float64_unit_beyond_fp32s_range_is_scaled_before_its_cast(capacity):
    """float64 per-unit gradients may lie beyond fp32's range with a finite norm: such a kept unit,
    scaled by its factor (here 0: below fp32's smallest normal number, and 1e-40), comes to fp32
    finite, and every other unit's contribution is its own; held or formed again alike, and for
    dense per-unit rows."""
    a, b = (x.double() for x in _rows())
    unit, counts = _layout("sorted")
    a[unit == 2] *= 1e22  # slot 2's product: entries near 1e44
    b[unit == 2] *= 1e22
    exact = _products(a, b, unit, counts)
    assert bool((exact[2].abs().max() > 1e40) & torch.isfinite(exact.pow(2).sum()))
    sq, held = ops.segment_outer_norms(a, b, unit, counts, capacity)
    keep = counts > 0
    for big in (0.0, 1e-40):
        factor = torch.where(keep, 0.5, 0.0)
        factor[2] = big
        total = ops.segment_outer_clipped_sum(a, b, unit, counts, held, sq, factor.float(), keep)
        want = (exact * factor.float().double()[:, None, None]).sum(0)
        assert bool(torch.isfinite(total).all())
        torch.testing.assert_close(total.double(), want, rtol=1e-5, atol=1e-5)
        total = ops.unit_weighted_sum(exact[:7], factor.float()[:7], keep[:7])
        want = (exact[:7] * factor.float().double()[:7, None, None]).sum(0)
        assert bool(torch.isfinite(total).all())
        torch.testing.assert_close(total.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_padding_rows_are_never_read_wherever_they_lie(layout):
    """``clip`` gives the padding slot (the last) no count: its rows, wherever they lie, are skipped."""
    a, b = _rows()
    unit, counts = _layout(layout, LENGTHS[:-1] + [20])
    counts[-1] = 0  # the last slot's 20 rows: padding
    a[unit == len(counts) - 1] = float("nan")
    keep = counts > 0
    sq, held = ops.segment_outer_norms(a, b, unit, counts, 3)
    assert bool(torch.isfinite(sq).all()) and bool(torch.isfinite(ops.segment_sq_norm(a, b, unit, counts)).all())
    factor = torch.ones(len(counts), dtype=torch.float64)
    assert bool(torch.isfinite(ops.segment_book_keeping(a, b, unit, counts, factor, keep)).all())
    assert bool(torch.isfinite(ops.segment_outer_clipped_sum(a, b, unit, counts, held, sq, factor.float(), keep)).all())


def test_fake_shapes_match():
    a, b = _rows()
    unit, counts = _layout("scattered")
    keep, factor = counts > 0, torch.rand(len(counts), dtype=torch.float64)
    sq, held = ops.segment_outer_norms(a, b, unit, counts, 3)
    for op, args in ((segment.segment_outer, (a, b, unit, counts)),
                     (segment.segment_outer_norms, (a, b, unit, counts, 3)),
                     (segment.segment_outer_clipped_sum, (a, b, unit, counts, held, sq, factor.float(), keep)),
                     (segment.segment_sq_norm, (a, b, unit, counts)),
                     (segment.segment_book_keeping, (a, b, unit, counts, factor, keep))):
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_squared_norms_bound_the_exact_ones_from_above_within_1_6e_5(dtype):
    """``_sq_norms`` sums fp32 squares in blocks and raises the result by its rounding bound:
    never below the exact (float64 of the values) squared norm, above it by at most 1.6e-5 of it;
    with a width that is no multiple of the block, values near fp32's overflow and underflow, an
    inf and a nan."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(6, 1000, generator=g) * torch.logspace(-30, 30, 6)[:, None]).to(dtype)
    x[1, 3] = 3e19  # its square overflows fp32: summed in float64
    x[4, 7] = float("inf")
    x[5, 9] = float("nan")
    got = segment._sq_norms(x)
    exact = x.double().square().sum(1)
    finite = torch.isfinite(exact)
    assert bool((got[finite] >= exact[finite]).all())
    assert bool(((got[finite] - exact[finite]) <= 1.6e-5 * exact[finite] + 1000 * 2.0 ** -148).all())
    assert torch.isinf(got[4]) and torch.isnan(got[5])
    index = torch.tensor([3, 0])
    assert torch.equal(segment._sq_norms(x, index), got[index])
