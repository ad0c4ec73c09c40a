"""What the engine refuses that no pass can see: packed units that reach each other's tokens (a
probe of the train graph at capture), a forward that a compute-dtype copy of the model would not
carry, batches whose shapes differ from the first's (packed batches: but for their rows), and unit slots that do not fit
``packed_units``."""
from __future__ import annotations

import logging
import math
from typing import Callable

import torch
from torch import nn

from ..errors import UnsupportedModelError

log = logging.getLogger(__package__ + ".engine")  # the engine's messages, under its logger
# The packed isolation probe (Engine._check_units_apart): a unit's norm may move, when only another
# unit's tokens change, by this many times the most it moves between runs of the same batch (four
# samples), and never by more than the ceiling. For Gaussian jitter that refuses a correct model in
# fewer than 1 in 1000 captures. A leak that moves a norm by less is not told apart from the jitter.
_JITTER_MARGIN = 10.0
_JITTER_CEILING = 1e-3


def check_units_apart(batch: tuple, probe_norms: Callable[[tuple], torch.Tensor], dtype,
                      agree: Callable[[float], float] | None = None) -> None:
    """Packed documents: a unit's gradient may read its own tokens only, which the model's
    attention mask must ensure and no pass can see (``PackedCausalLMLoss`` does; a custom
    model may not). A probe on the example batch's values, laid out as two units (the first
    and the second half of every row): replacing the first half's tokens must leave the
    second unit's norm unchanged (causal attention without the document mask fails here),
    and replacing the second half's the first unit's (a last token trained to predict the
    next unit's first fails here). Three runs of the train graph at capture (``probe_norms``: a
    batch's per-unit norms); skipped for fake tensors and on a fake process group (its
    collectives leave their outputs unfilled), for a batch whose values cannot be varied, and
    where a unit has no gradient to watch (a batch of padding, as the CLI compiles its larger
    row counts on: its fewest rows', on random documents, are probed).

    A change above the rounding tolerance is measured against the kernels' own run-to-run
    jitter: two more runs of the unchanged batch. GPU kernels that accumulate with atomics
    (flash attention's backward) move a correct model's bf16 norms by ~1e-4 from run to run;
    a change within ``_JITTER_MARGIN`` times the jitter seen, and under ``_JITTER_CEILING``,
    is that jitter and passes with a warning. Deterministic kernels (every CPU run) show none,
    so there the tolerance alone decides.

    ``agree``: a measure's largest value over the ranks that run the graph together (sharded
    model states; None: this rank alone); every decision (skip, repeat, refuse) is taken on it,
    so that all of them run the graph as often and refuse together."""
    from .._torch import FakeTensor, in_fake_world

    if any(isinstance(t, FakeTensor) for t in batch) or in_fake_world():
        return
    probes = _two_unit_probes(batch)
    if probes is None:
        log.info("engine: the packed isolation probe is skipped: the example batch's values cannot be varied")
        return
    unchanged = probes[0]
    base, after_first, after_second = (probe_norms(b) for b in probes)
    agree = agree or (lambda x: x)
    if agree(float(not bool((torch.isfinite(base[:2]) & (base[:2] > 0)).all()))):
        log.info("engine: the packed isolation probe is skipped: the example batch gives a unit no finite, "
                 "non-zero gradient to watch")
        return

    def moved(norms: torch.Tensor, unit: int) -> float:
        return float((norms[unit] - base[unit]).abs() / base[unit].abs())
    tolerance = 1e-4 if dtype in (torch.float16, torch.bfloat16) else 1e-6
    change, unit, after, other = max((moved(after_first, 1), 1, after_first, "the first"),
                                     (moved(after_second, 0), 0, after_second, "the second"), key=lambda w: w[0])
    change = agree(change if change == change else math.inf)  # a nan moved it as far as anything can
    if change <= tolerance:
        log.info("engine: the packed isolation probe passed: a unit's norm moved by %.2g (relative) at most when "
                 "only another unit's tokens changed", change)
        return
    repeats = [probe_norms(unchanged) for _ in range(2)]
    jitter = max(moved(norms, u) for norms in repeats for u in (0, 1))
    jitter = agree(jitter if jitter == jitter else math.inf)
    if change <= min(_JITTER_MARGIN * jitter, _JITTER_CEILING):
        log.warning("engine: the packed isolation probe accepted a unit's norm moved by %.2g (relative) when only "
                    "another unit's tokens changed: the unchanged batch's norms themselves moved by up to %.2g "
                    "from run to run (nondeterministic kernels)", change, jitter)
        return
    raise UnsupportedModelError(
        f"packed documents: the gradient of one unit changed when only {other} unit's tokens of its rows changed "
        f"(norm {float(base[unit]):.6g} -> {float(after[unit]):.6g}, relative {change:.2g}; the unchanged batch "
        f"moved it by at most {jitter:.2g} from run to run): this model lets the units of a row reach each "
        "other (e.g. attention without a document mask, or a last token trained on the next unit's first), so "
        "a unit would not be one sample. Way out: longshield_fx.PackedCausalLMLoss (block-diagonal causal "
        "attention), or unpacked batches (compile without packed_units, CLI --no-pack)")


def _two_unit_probes(batch: tuple) -> tuple[tuple, tuple, tuple] | None:
    """``batch`` laid out as two units (the first and the second half of every row), then the same
    with the first unit's tokens replaced, and with the second's; None if its values cannot be
    varied. The last tensor of each is the units' slots."""
    B, T = batch[-1].shape
    half = T // 2
    units = torch.zeros_like(batch[-1])
    units[:, half:] = 1
    generator = torch.Generator().manual_seed(0)

    def replaced(tokens: slice) -> tuple | None:
        out, changed = [], False
        for t in batch[:-1]:
            if t.dim() >= 2 and tuple(t.shape[:2]) == (B, T):
                new = t.clone()
                if t.is_floating_point():
                    noise = torch.randn(new[:, tokens].shape, generator=generator).to(t)
                    new[:, tokens] += noise * (t.abs().max() + 1)
                else:  # other values of the same tensor (token ids stay in range)
                    new[:, tokens] = t.roll(1, 0).flip(1)[:, tokens]
                changed |= not torch.equal(new, t)
                t = new
            out.append(t)
        return (*out, units) if changed else None

    probes = [replaced(slice(0, half)), replaced(slice(half, T))]
    if None in probes:
        return None
    return ((*batch[:-1], units), *probes)


def fixed_batch_shapes(batch: tuple, parallel, fixed: list | None, rows_may_vary: bool = False) -> list:
    """The (shape, dtype) of each batch tensor, checked: tensors with the batch as dimension 0 that
    ``parallel`` can shard, shaped as ``fixed`` (the batches run before; None: no batch yet), but for
    dimension 0 where ``rows_may_vary`` (packed batches: each row count is a graph of its own)."""
    if not batch or not all(isinstance(t, torch.Tensor) for t in batch):
        raise TypeError("engine: pass the batch as tensors, e.g. engine.accumulate(input_ids, labels)")
    shapes = [(tuple(t.shape), t.dtype) for t in batch]
    B = batch[0].shape[0] if batch[0].dim() else None
    if B is None or any(t.dim() == 0 or t.shape[0] != B for t in batch):
        raise ValueError(f"engine: every batch tensor needs the batch as dimension 0, got shapes {[s for s, _ in shapes]}")
    parallel.check_batch(batch)
    if fixed is None:
        return shapes
    if rows_may_vary:
        if [(s[1:], d) for s, d in shapes] != [(s[1:], d) for s, d in fixed]:
            raise ValueError(
                f"engine: packed batch shapes changed from {fixed} to {shapes}; only the number of rows may "
                "differ between packed batches (longshield_fx.packing.pack_documents makes them so)")
    elif shapes != fixed:
        raise ValueError(
            f"engine: physical batch shapes changed from {fixed} to {shapes}; the compiled "
            "graph has fixed shapes. Pad to a fixed physical batch and pass mask= "
            "(longshield_fx.data.PoissonBatches does this)")
    return fixed


def held_unit_slots(units: torch.Tensor, packed_units: int) -> int:
    """Check a packed batch's last tensor, the unit slot of each token (padding: ``packed_units``),
    and return how many of the slots hold tokens (the samples of this physical batch)."""
    U = packed_units
    if units.dim() != 2 or units.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"engine: with packed_units the last batch tensor is the (B, T) integer unit slot of "
                         f"each token, got {tuple(units.shape)} {units.dtype}")
    if units.shape[0] < 2:
        raise ValueError("engine: a packed physical batch needs at least 2 rows (a batch of one row may run as "
                         "two copies of it, which would count each of its units twice); pack into rows >= 2")
    if bool(((units < 0) | (units > U)).any()):
        raise ValueError(f"engine: unit slots must lie in [0, {U}] ({U}: padding), got values in "
                         f"[{int(units.min())}, {int(units.max())}]")
    return int((torch.bincount(units.flatten().long(), minlength=U + 1)[:U] > 0).sum())


def check_no_forward_holds_a_module(model: nn.Module) -> None:
    """The compute-dtype capture runs a deep copy of ``model``; a forward replaced on an instance by
    a function that holds a module (TRL's fused LM-head patch keeps the original bound forward) is
    not copied with it, so the copy would run the original's weights, and the trainable copies
    would get no gradient."""
    for name, module in model.named_modules():
        forward = module.__dict__.get("forward")
        func = getattr(forward, "__func__", forward)
        for cell in getattr(func, "__closure__", None) or ():
            try:
                held = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if isinstance(getattr(held, "__self__", held), nn.Module):
                raise UnsupportedModelError(
                    f"compile: the forward of {name or 'the model'} was replaced by {func.__qualname__} "
                    f"({func.__module__}), which holds a module; capturing in compute_dtype copies the model, and the "
                    "copy would run the original's weights. Way out: a compute_dtype equal to the parameters' dtype "
                    "(bf16=False in Trainer arguments), or remove the replaced forward")
