"""Ops over the token rows of packed documents (``compile(..., packed_units=U)``), in the batch's
own order: ``unit`` (N,) int64 names the unit slot of each of the N rows (the rows of one unit
need not be adjacent: a unit is every run of rows that names it), and ``counts`` (S,) the S = U + 1
slots' token counts; a slot with no count is never read (``clip`` gives the padding slot, the
last, none). Nothing sorts the rows or keeps a copy of them: on the CPU a unit's product is
formed from its runs where they lie; a GPU gathers the units of one grouped matmul into slot
order for that call (at most the layer's rows, freed after it), and the ghost norm gathers each
batch of units it pads.

Every op here works on the units present, found from ``unit`` and ``counts`` when it runs, and
never on the S slots a fixed shape reserves: a physical batch's work follows its tokens and units,
not U (``segment_outer``, which returns all S slots, is the one exception, for
``engine.per_sample_grads``). The ops that ``clip`` runs:

- a linear weight's per-unit gradients (``a_sᵀ b_s``): ``segment_outer_norms`` forms each unit's
  product and takes its squared norm as it is formed, keeping up to ``capacity`` of them;
  ``segment_outer_clipped_sum`` sums the kept units' products scaled by their clip factors;
- any other per-unit gradient held as (S, ...) rows (``unit_sq_norms``, ``unit_weighted_sum``);
- ghost norm and book-keeping (``segment_sq_norm``, ``segment_book_keeping``), each in float64
  with the rounding bound ``clip`` counts.

A unit's inf or nan reaches no other unit's result: no op mixes two units' rows in one product,
and a unit ``clip`` does not keep is never read by the sums.
"""
from __future__ import annotations

import torch

from .._torch import grouped_mm
from ._dtypes import accumulation_dtype

_CHUNK = 2 ** 22  # elements in one temporary (a float64 copy, a group of products): 32 MiB in float64
_PIECE = 2 ** 16  # elements in one float64 copy for a norm on the CPU: 512 KiB, in cache

Runs = list[tuple[int, int]]  # a unit's rows: (start, length) of each run, in row order


def _grouped_mm_fits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes the rows of ``a`` and ``b`` once gathered into fresh
    tensors: a dtype it has, and rows of a multiple of 16 bytes."""
    return (a.dtype in (torch.float32, torch.bfloat16, torch.float16) and a.dtype == b.dtype
            and (a.shape[1] * a.element_size()) % 16 == 0 and (b.shape[1] * b.element_size()) % 16 == 0)


def _as_they_lie(x: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes ``x``'s rows where they are: row-major, each row and
    the first one starting at a multiple of 16 bytes (a column slice or a transposed operand does
    not; ``_products`` gathers those)."""
    return (x.stride(1) == 1 and (x.stride(0) * x.element_size()) % 16 == 0
            and (x.data_ptr() % 16 == 0 or x.numel() == 0))


_found_units: list = []  # the last two (unit, counts, their units): copies, compared by value


def _units(unit: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, list[Runs]]:
    """(slots, runs): the slots that hold rows here and have a count, in slot order, and each
    one's runs of rows.

    Every layer of a step reads the same ``unit`` and ``counts``: their units are found once per
    step. The cache compares values, not tensor identities (a compiled graph may write a new
    step's counts into the buffer of the last one without a version bump), on one device (a
    process may run graphs on a GPU and on the CPU), and keeps two entries: a step may read two
    counts (the clip's, which gives padding none, and the batch's own)."""
    for cached_unit, cached_counts, found in _found_units:
        if (cached_unit.device == unit.device and cached_counts.device == counts.device  # equal() refuses two devices
                and cached_unit.shape == unit.shape and cached_counts.shape == counts.shape
                and torch.equal(cached_unit, unit) and torch.equal(cached_counts, counts)):
            return found
    runs_of: dict[int, Runs] = {}
    if unit.numel():
        starts = torch.cat([unit.new_zeros(1), (unit[1:] != unit[:-1]).nonzero().flatten() + 1])
        ends = torch.cat([starts[1:], starts.new_full((1,), unit.numel())])
        live = (counts > 0).tolist()
        for slot, start, end in zip(unit[starts].tolist(), starts.tolist(), ends.tolist()):
            if 0 <= slot < len(live) and live[slot]:
                runs_of.setdefault(slot, []).append((start, end - start))
    order = sorted(runs_of)
    found = torch.tensor(order, dtype=torch.int64, device=unit.device), [runs_of[s] for s in order]
    _found_units[:] = [(unit.clone(), counts.clone(), found)] + _found_units[:1]
    return found


def _size(runs: Runs) -> int:
    return sum(n for _, n in runs)


def _adjacent(units: list[Runs]) -> bool:
    """Whether each unit is one run and each run starts where the one before ends (rows sorted
    by unit): then the products are one grouped matmul over the rows as they lie."""
    return all(len(r) == 1 for r in units) and all(
        units[i][0][0] + units[i][0][1] == units[i + 1][0][0] for i in range(len(units) - 1))


def _rows_in_order(units: list[Runs], device: torch.device) -> torch.Tensor:
    """The row indices of the units' runs, one unit after another (a few kernels, whatever the runs)."""
    starts = torch.tensor([s for runs in units for s, _ in runs], device=device)
    lengths = torch.tensor([n for runs in units for _, n in runs], device=device)
    total = sum(_size(runs) for runs in units)
    first = torch.repeat_interleave(starts - (lengths.cumsum(0) - lengths), lengths, output_size=total)
    return first + torch.arange(total, device=device)


_LOOPING = ("cpu",)  # devices whose grouped matmul is a loop of matmuls (see ``_products``)


def _products(a: torch.Tensor, b: torch.Tensor, units: list[Runs], groups: int = 0) -> torch.Tensor:
    """(max(groups, k), p, d): ``a_sᵀ b_s`` of k units, each the sum of its runs' products, in the
    dtype of ``a``; the rows after the k products are unspecified (never read).

    One grouped matmul where the units' rows are adjacent and the layout allows it (each unit's
    product as the matmul of its rows alone). On a GPU other rows are first gathered into that
    order. On the CPU a grouped matmul is a loop of matmuls anyway, in which an empty group costs
    about what a Python loop adds per product (a zeroed output and a call: 5-6 µs at 192 x 64),
    so there the products are written in place, one matmul each, for scattered rows, other
    dtypes, a batch of fewer units than half of ``groups``, and one holding consecutive units of
    one run each, of one length and evenly spaced (``_evenly_spaced``), which are one ``bmm``."""
    k, p, d = len(units), a.shape[1], b.shape[1]
    if k == 0:
        return a.new_zeros(groups, p, d)
    adjacent = _adjacent(units)
    looping = a.device.type in _LOOPING
    evenly = _evenly_spaced(units) if looping and a.stride() == (p, 1) and b.stride() == (d, 1) else []
    loop = looping and (not adjacent or 2 * k < groups or bool(evenly))
    if _grouped_mm_fits(a, b) and not loop:
        if not (adjacent and _as_they_lie(a) and _as_they_lie(b)):
            index = _rows_in_order(units, a.device)
            a, b = a.index_select(0, index), b.index_select(0, index)
            lo, hi = 0, index.numel()
        else:
            lo, hi = units[0][0][0], units[-1][0][0] + units[-1][0][1]
        ends = torch.tensor([_size(r) for r in units], device=a.device).cumsum(0)
        if groups > k:
            ends = torch.cat([ends, ends[-1:].expand(groups - k)])
        return grouped_mm(a[lo:hi].t(), b[lo:hi], ends.to(torch.int32))
    out = a.new_empty(max(groups, k), p, d)
    for i, j, start, n, step in evenly:
        x = a.as_strided((j - i, n, p), (step * p, p, 1), a.storage_offset() + start * p)
        y = b.as_strided((j - i, n, d), (step * d, d, 1), b.storage_offset() + start * d)
        torch.bmm(x.transpose(1, 2), y, out=out[i:j])
    in_bmm = {u for i, j, *_ in evenly for u in range(i, j)}
    rest = [u for u in range(k) if u not in in_bmm]
    left, right = _runs_of(a.t(), b, [units[u] for u in rest])
    for u, xs, ys in zip(rest, left, right):
        product = out[u]
        if len(xs) == 1:
            torch.mm(xs[0], ys[0], out=product)
        elif a.dtype in (torch.float32, torch.float64):
            torch.mm(xs[0], ys[0], out=product)
            for x, y in zip(xs[1:], ys[1:]):
                product.addmm_(x, y)
        else:  # bf16, fp16: the runs summed in fp32 and rounded once, as one matmul over them would be
            total = torch.zeros(p, d, dtype=torch.float32, device=a.device)
            for x, y in zip(xs, ys):
                total.addmm_(x.float(), y.float())
            product.copy_(total)
    return out


def _evenly_spaced(units: list[Runs]) -> list[tuple[int, int, int, int, int]]:
    """(i, j, start, length, step) of each stretch of at least two consecutive units i..j-1 that
    are one run of ``length`` rows each, the first at row ``start`` and each next ``step`` rows after
    the one before: their rows are one strided view of the operand, and their products one
    ``bmm``, as the padded layout's per-sample products are. A document longer than a unit's rows
    is cut to whole rows (``--max-rows``), so batches of long documents are mostly such units:
    on the CPU the matmuls of 4 units of 8192 rows run 20-35% faster as one ``bmm`` than one by
    one (long, thin matmuls, which the CPU's matmul spreads poorly over its cores). The LM head
    op batches such units' head gradients alike (``lm_head_loss._add_per_unit``)."""
    out, i = [], 0
    while i < len(units):
        j = i + 1
        if len(units[i]) == 1:
            (start, n), step = units[i][0], None
            while j < len(units) and len(units[j]) == 1 and units[j][0][1] == n:
                gap = units[j][0][0] - units[j - 1][0][0]
                if gap < n or (step is not None and gap != step):
                    break
                step, j = gap, j + 1
            if j - i >= 2:
                out.append((i, j, start, n, step))
        i = j
    return out


def _runs_of(at: torch.Tensor, b: torch.Tensor, units: list[Runs]) -> tuple[list, list]:
    """Each unit's runs as views, ``at[:, run]`` and ``b[run]``, cut by one ``tensor_split`` of
    each operand (two slices per run took a fifth of the loop: 26 units of a 64 x 192 weight, 421
    against 349 µs)."""
    cuts = sorted({c for runs in units for s, n in runs for c in (s, s + n)})
    piece = {c: i + 1 for i, c in enumerate(cuts)}  # the piece that starts at c
    xs, ys = at.tensor_split(cuts, 1), b.tensor_split(cuts, 0)
    return ([[xs[piece[s]] for s, _ in runs] for runs in units],
            [[ys[piece[s]] for s, _ in runs] for runs in units])


def _pieces(k: int, width: int, device: torch.device) -> tuple[int, int]:
    """(rows, columns) of one piece of a (k, width) tensor: at most ``_PIECE`` elements on the CPU
    (small enough to stay in cache and be reused: fresh float64 copies of a layer's products took
    5x the arithmetic, most of it in page faults), ``_CHUNK`` elsewhere."""
    limit = _PIECE if device.type == "cpu" else _CHUNK
    return max(1, limit // max(1, width)), min(width, limit)


# Squares summed in fp32 per block: a relative error within (_BLOCK + 4)·2**-24 = 1.55e-5. A block
# of 256 reads at the memory's speed (24 products of 512 x 1376: 4.0 ms against 3.9 for one fp32
# norm per row and 9.5 for blocks of 32, whose per-block reductions dominate).
_BLOCK = 256


def _sq_norms(x: torch.Tensor, index: torch.Tensor | None = None) -> torch.Tensor:
    """(k,) float64 upper bounds on the squared Frobenius norms of the k leading rows of ``x``
    (of its rows ``index``, gathered piece by piece).

    A float64 sum reads at a tenth of fp32's speed on the CPU, and here every element of every
    unit's product is read once. So an fp32 row (bf16 and fp16 rows are made fp32, where their
    squares are exact) is summed in blocks of ``_BLOCK`` squares in fp32 (``vector_norm``, any
    order: within γ of the exact sum, plus its square root and squaring again) and the blocks
    in float64; the result is raised by that bound and by the underflow of every square, so it
    is never below the exact norm and above it by less than 1.6e-5 of it (``clip`` compares the
    norm with C: an upper bound keeps every clipped contribution within C). A row whose fp32 sum
    overflows (an element above 1.8e19) is summed in float64 instead; an inf or nan stays one.
    float64 rows are summed in float64 (within 2.3e-16 per term there)."""
    k = x.shape[0] if index is None else index.numel()
    if k == 0 or x.shape[0] == 0:  # a batch that drew no unit: nothing to read (and no row length to infer)
        return torch.zeros(k, dtype=torch.float64, device=x.device)
    rows = x.reshape(x.shape[0], -1)
    width = rows.shape[1]
    if x.dtype == torch.float64:
        out = torch.zeros(k, dtype=torch.float64, device=x.device)
        per, cols = _pieces(k, width, x.device)
        for i in range(0, k, per):
            for j in range(0, width, cols):
                part = rows[:, j:j + cols]
                part = part[i:i + per] if index is None else part.index_select(0, index[i:i + per])
                out[i:i + per] += torch.linalg.vector_norm(part, dim=1, dtype=torch.float64).square()
        return out
    # fp32 blocks need no float64 copy: pieces only bound an index_select's copy or an upcast
    per = k if index is None and x.dtype == torch.float32 else max(1, _CHUNK // width)
    sums = [_block_sq_sums(rows[i:i + per] if index is None else rows.index_select(0, index[i:i + per]))
            for i in range(0, k, per)]
    out = sums[0] if len(sums) == 1 else torch.cat(sums)
    blocks = -(-width // _BLOCK)
    ku = (_BLOCK + 4) * 2.0 ** -24 + blocks * 2.0 ** -53
    out = out.mul_(1 + ku / (1 - ku)).add_(width * 2.0 ** -148)
    overflow = torch.isinf(out)
    if bool(overflow.any()):
        where = overflow.nonzero().flatten()
        where = where if index is None else index.index_select(0, where)
        out[overflow] = torch.linalg.vector_norm(rows.index_select(0, where), dim=1, dtype=torch.float64).square()
    return out


def _block_sq_sums(part: torch.Tensor) -> torch.Tensor:
    """(k,) float64: Σ over blocks of ``_BLOCK`` columns of the block's fp32 sum of squares."""
    part = part.float()
    k, width = part.shape
    main = width - width % _BLOCK
    if main == 0:
        return torch.linalg.vector_norm(part, dim=1).double().square_()
    total = torch.linalg.vector_norm(part[:, :main].reshape(k, main // _BLOCK, _BLOCK), dim=2).square_().sum(
        1, dtype=torch.float64)
    if main < width:
        total += torch.linalg.vector_norm(part[:, main:], dim=1).double().square_()
    return total


def _chunks(k: int, width: int) -> list[tuple[int, int]]:
    """Consecutive ranges of k units whose products (``width`` elements each) fit ``_CHUNK``."""
    per = max(1, _CHUNK // max(1, width))
    return [(i, min(k, i + per)) for i in range(0, k, per)]


@torch.library.custom_op("longshield::segment_outer", mutates_args=())
def segment_outer(a: torch.Tensor, b: torch.Tensor, unit: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """(S, p, d): ``out[s] = a[rows of s]ᵀ @ b[rows of s]``, zero for an empty slot (the per-unit
    gradients of ``engine.per_sample_grads``: the FLOPs of the layer's weight gradient, never U
    times them; the zeros of the S slots are written, so ``clip`` uses ``segment_outer_norms``)."""
    slots, units = _units(unit, counts)
    out = a.new_zeros(counts.shape[0], a.shape[1], b.shape[1])
    if units:
        out[slots] = _products(a, b, units)
    return out


@segment_outer.register_fake
def _(a, b, unit, counts):
    return a.new_empty(counts.shape[0], a.shape[1], b.shape[1])


@torch.library.custom_op("longshield::segment_outer_norms", mutates_args=())
def segment_outer_norms(a: torch.Tensor, b: torch.Tensor, unit: torch.Tensor, counts: torch.Tensor,
                        capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sq, held): sq (S,) float64, ``‖a_sᵀ b_s‖²`` of each unit's product in ``a``'s dtype
    (0 for an empty slot), an upper bound within 1.6e-5 of it (``_sq_norms``); held (capacity, p, d): the products of the first
    ``capacity`` units present, in slot order (after them: unspecified, never read), for
    ``segment_outer_clipped_sum``. The products of further units are formed for their norm and
    let go (that sum forms them again). Each norm is taken as its product is formed."""
    slots, units = _units(unit, counts)
    p, d = a.shape[1], b.shape[1]
    sq = torch.zeros(counts.shape[0], dtype=torch.float64, device=a.device)
    kept = min(capacity, len(units))
    held = _products(a, b, units[:kept], groups=capacity)
    norms = [_sq_norms(held[:kept])]
    for i, j in _chunks(len(units) - kept, p * d):
        norms.append(_sq_norms(_products(a, b, units[kept + i:kept + j])))
    if units:
        sq[slots] = torch.cat(norms)
    return sq, held


@segment_outer_norms.register_fake
def _(a, b, unit, counts, capacity):
    return a.new_empty(counts.shape[0], dtype=torch.float64), a.new_empty(capacity, a.shape[1], b.shape[1])


@torch.library.custom_op("longshield::segment_outer_clipped_sum", mutates_args=())
def segment_outer_clipped_sum(a: torch.Tensor | None, b: torch.Tensor | None, unit: torch.Tensor,
                              counts: torch.Tensor, held: torch.Tensor, sq: torch.Tensor, factor: torch.Tensor,
                              keep: torch.Tensor) -> torch.Tensor:
    """(p, d) fp32: Σ over the slots s with ``keep[s]`` of ``factor[s] · a_sᵀ b_s``, from ``held``
    and ``sq`` as ``segment_outer_norms`` made them; a slot not kept is never read. A kept slot is
    one that holds rows and whose norm is finite (``clip``), so every product summed is finite.

    A product beyond ``held`` is formed again, by the same matmuls on the same rows. Its norm must
    be the one its clip factor was computed from (a unit with cancelling tokens has a product of
    rounding noise, and another rounding of it could have a larger norm): it is taken again, and
    where it is not ``sq``'s, the product is scaled by √(sq / its squared norm) (by 0 if it is no
    longer finite), so its contribution never exceeds the clip factor times the norm ``clip`` used.
    ``a`` and ``b`` may be None where ``held`` holds a product for every unit present (``clip``:
    a capacity of U, every slot but the padding one): then none is formed again, and a graph need
    not keep a layer's token rows until its clipped sum."""
    slots, units = _units(unit, counts)
    capacity, p, d = held.shape
    out = torch.zeros(p * d, dtype=torch.float32, device=held.device)
    kept = min(capacity, len(units))
    if kept < len(units) and a is None:
        raise ValueError(f"segment_outer_clipped_sum: {len(units)} units present, {capacity} products held and no "
                         "token rows to form the others from")
    chosen = keep[slots]
    f = factor[slots].float()

    def add(products: torch.Tensor, take: torch.Tensor, scale: torch.Tensor) -> None:
        if products.shape[0] == 0:
            return
        rows = products.reshape(products.shape[0], -1)
        if not bool(take.all()):
            index = take.nonzero().flatten()
            rows, scale = rows.index_select(0, index), scale.index_select(0, index)
        if rows.shape[0]:
            acc = accumulation_dtype(rows)
            out.add_(torch.mv(rows.to(acc).t(), scale.to(acc)))

    add(held[:kept], chosen[:kept], f[:kept])
    for i, j in _chunks(len(units) - kept, p * d):
        i, j = kept + i, kept + j
        products = _products(a, b, units[i:j])
        again, used = _sq_norms(products), sq[slots[i:j]]
        ratio = torch.where(again == used, 1.0, torch.sqrt(used / again).clamp(max=1.0))
        finite = torch.isfinite(again) & torch.isfinite(ratio)
        add(products, chosen[i:j] & finite, (f[i:j].double() * torch.where(finite, ratio, 0.0)).float())
    return out.view(p, d)


@segment_outer_clipped_sum.register_fake
def _(a, b, unit, counts, held, sq, factor, keep):
    return held.new_empty(held.shape[1], held.shape[2], dtype=torch.float32)


@torch.library.custom_op("longshield::unit_sq_norms", mutates_args=())
def unit_sq_norms(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """(S,) float64: ``‖x[s]‖²`` of each slot that holds rows, an upper bound within 1.6e-5 of it
    (``_sq_norms``), 0 for an empty slot, whose rows are never read: the norms of a per-unit
    gradient held as (S, ...) rows."""
    slots = counts.nonzero().flatten()
    sq = torch.zeros(counts.shape[0], dtype=torch.float64, device=x.device)
    if slots.numel():
        sq[slots] = _sq_norms(x[:slots.numel()]) if _is_prefix(slots) else _sq_norms(x, slots)
    return sq


def _is_prefix(slots: torch.Tensor) -> bool:
    """Whether the ascending, distinct ``slots`` are 0, 1, ..., k - 1 (as a batch's units fill
    their slots): then their rows are read where they lie, with no gathered copy."""
    return int(slots[-1]) == slots.numel() - 1


@unit_sq_norms.register_fake
def _(x, counts):
    return x.new_empty(counts.shape[0], dtype=torch.float64)


@torch.library.custom_op("longshield::unit_weighted_sum", mutates_args=())
def unit_weighted_sum(x: torch.Tensor, factor: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """(*x.shape[1:]) fp32: Σ over the slots s with ``keep[s]`` of ``factor[s] · x[s]``; the rows of
    a slot not kept are never read (so their inf or nan cannot reach the sum)."""
    rows = x.reshape(x.shape[0], -1)
    out = torch.zeros(rows.shape[1], dtype=torch.float32, device=x.device)
    slots = keep.nonzero().flatten()
    if not slots.numel():
        return out.view(x.shape[1:])
    f = factor.index_select(0, slots).float()
    if x.dtype == torch.float32 and _is_prefix(slots):  # the kept rows read where they lie
        return torch.mv(rows[:slots.numel()].t(), f).view(x.shape[1:])
    if x.dtype == torch.float32:  # gathered by chunks of _CHUNK elements, nothing to upcast
        per = max(1, _CHUNK // max(1, rows.shape[1]))
        for i in range(0, slots.numel(), per):
            out.add_(torch.mv(rows.index_select(0, slots[i:i + per]).t(), f[i:i + per]))
        return out.view(x.shape[1:])
    per, cols = _pieces(slots.numel(), rows.shape[1], x.device)  # upcast copies small enough to stay in cache
    cols = cols if per >= slots.numel() else max(1, cols // slots.numel())  # k x cols in a piece
    acc = accumulation_dtype(x)
    for j in range(0, rows.shape[1], cols):
        out[j:j + cols] = torch.mv(rows[:, j:j + cols].index_select(0, slots).to(acc).t(), f.to(acc))
    return out.view(x.shape[1:])


@unit_weighted_sum.register_fake
def _(x, factor, keep):
    return x.new_empty(x.shape[1:], dtype=torch.float32)


def _batches(lengths: list[int], cost, size, slack: float = 1.5) -> list[list[int]]:
    """Units (indices into ``lengths``) in batches of similar length: sorted by length, each
    batch grown while padding every member to the longest costs at most ``slack`` times the
    members' own ``cost(n)`` and the batch's ``size(k, n_max)`` elements fit ``_CHUNK``."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    out, batch, own = [], [], 0.0
    for i in order:
        n = lengths[i]
        if batch and ((len(batch) + 1) * cost(n) > slack * (own + cost(n)) or size(len(batch) + 1, n) > _CHUNK):
            out.append(batch)
            batch, own = [], 0.0
        batch.append(i)
        own += cost(n)
    return out + ([batch] if batch else [])


def _padded_index(units: list[Runs], n_max: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(index, pad), both (k, n_max): each unit's rows (its runs in row order) then padding."""
    runs = []  # (member, start, length, where the run goes within its unit: after its earlier runs)
    for i, unit_runs in enumerate(units):
        at = 0
        for s, n in unit_runs:
            runs.append((i, s, n, at))
            at += n
    member, start, length, first = (torch.tensor(column, device=device) for column in zip(*runs))
    total = sum(n for _, _, n, _ in runs)
    offset = length.cumsum(0) - length
    run = torch.repeat_interleave(torch.arange(len(runs), device=device), length, output_size=total)
    step = torch.arange(total, device=device) - offset.index_select(0, run)
    index = torch.zeros(len(units), n_max, dtype=torch.int64, device=device)
    pad = torch.ones(len(units), n_max, dtype=torch.bool, device=device)
    row, column = member.index_select(0, run), first.index_select(0, run) + step
    index[row, column] = start.index_select(0, run) + step
    pad[row, column] = False
    return index, pad


def _padded_rows(x: torch.Tensor, index: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
    """(k, n_max, ·) float64: the rows ``index`` of ``x``, zero rows where ``pad`` (filled, not
    multiplied: a zero times another row's inf would be nan). Padding adds exact zeros to every
    sum the Grams and products make, so it moves neither their value nor their rounding."""
    rows = x.index_select(0, index.flatten()).view(*index.shape, x.shape[1])
    return rows.masked_fill_(pad[:, :, None], 0).double()


@torch.library.custom_op("longshield::segment_sq_norm", mutates_args=())
def segment_sq_norm(a: torch.Tensor, b: torch.Tensor, unit: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """(S,) float64: ``‖a[rows of s]ᵀ @ b[rows of s]‖²`` (Frobenius) of each unit, in float64,
    without forming the products of short units. A unit of n ≤ W = p·d/(p+d) rows (its two Grams
    cost no more than its product) by ghost norm, ⟨a_s a_sᵀ, b_s b_sᵀ⟩; a longer one from its
    product. Only the units present, in batches of similar length (one float64 ``bmm`` per batch,
    each unit's rows gathered and padded with zero rows to the longest). Either way the float64
    rounding is within 2·γ_{n²+p·d+p+d+1}·A_s² of the exact value (A_s = Σ_t ‖a_t‖·‖b_t‖;
    ``clip`` adds that bound: the Grams' inner product sums n² terms, the product's squares p·d;
    the padding's exact zeros add no rounding). A non-finite unit is non-finite alone: each batch
    member's Grams and product read its own rows and zeros only."""
    slots, units = _units(unit, counts)
    p, d = a.shape[1], b.shape[1]
    W = max(1, p * d // (p + d))
    out = torch.zeros(counts.shape[0], dtype=torch.float64, device=a.device)
    lengths = [_size(r) for r in units]
    short = [i for i, n in enumerate(lengths) if n <= W]
    long = [i for i, n in enumerate(lengths) if n > W]
    work = ((short, True, lambda n: n * n, lambda k, n: k * n * (n + p + d)),
            (long, False, lambda n: n, lambda k, n: k * (n * (p + d) + p * d)))
    for members, gram, cost, size in work:
        for batch in _batches([lengths[i] for i in members], cost, size):
            chosen = [members[i] for i in batch]
            n_max = max(lengths[i] for i in chosen)
            index, pad = _padded_index([units[i] for i in chosen], n_max, a.device)
            x, y = _padded_rows(a, index, pad), _padded_rows(b, index, pad)
            if gram:
                value = (torch.bmm(x, x.transpose(1, 2)) * torch.bmm(y, y.transpose(1, 2))).sum((1, 2))
            else:
                value = torch.bmm(x.transpose(1, 2), y).square().sum((1, 2))
            out[slots[torch.tensor(chosen, device=a.device)]] = value
    return out


@segment_sq_norm.register_fake
def _(a, b, unit, counts):
    return a.new_empty(counts.shape[0], dtype=torch.float64)


@torch.library.custom_op("longshield::segment_book_keeping", mutates_args=())
def segment_book_keeping(a: torch.Tensor, b: torch.Tensor, unit: torch.Tensor, counts: torch.Tensor,
                         factor: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """(p, d) fp32: Σ_t f_{u(t)} a_t b_tᵀ over the rows of the slots kept (``keep``, with a count),
    accumulated in float64 (``clip``'s book-keeping; its rounding bound is counted there),
    returned in fp32. The rows of a slot not kept are never read; the kept rows go in chunks of
    at most ``_CHUNK`` float64 elements, in row order, whatever U is."""
    p, d = a.shape[1], b.shape[1]
    rows = (keep & (counts > 0)).index_select(0, unit).nonzero().flatten()
    row_factor = factor.double().index_select(0, unit.index_select(0, rows))
    prefix = rows.numel() == 0 or _is_prefix(rows)  # every row up to the last kept one: no gather
    total = torch.zeros(p, d, dtype=torch.float64, device=a.device)
    step, _ = _pieces(a.shape[0], p + d, a.device)
    for i in range(0, rows.numel(), step):
        j = min(rows.numel(), i + step)
        left, right = (a[i:j], b[i:j]) if prefix else (a.index_select(0, rows[i:j]), b.index_select(0, rows[i:j]))
        left, right, f = left.double(), right.double(), row_factor[i:j, None]
        if p <= d:  # the factor on the narrower operand: fewer products, a smaller copy
            total.addmm_((left * f).t(), right)
        else:
            total.addmm_(left.t(), right * f)
    return total.float()


@segment_book_keeping.register_fake
def _(a, b, unit, counts, factor, keep):
    return a.new_empty(a.shape[1], b.shape[1], dtype=torch.float32)
