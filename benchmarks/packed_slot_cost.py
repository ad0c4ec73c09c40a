"""What a packed token slot costs in the DP step, against a padded one, and whether the packed
step is flat in the number of unit slots U; with a breakdown of where the time goes.

One physical batch of ``--rows`` x ``--seq-len`` token slots, filled by ``pack_documents`` with
documents of log-normal lengths (median ``--median`` tokens, a unit each) until it is full. The
same tokens run as:

- ``packed U=…``: ``compile(PackedCausalLMLoss, packed_units=U)`` for each ``--slots`` value: the
  same batch, only the padding slot's id differs, so every U computes the same thing;
- ``padded``: ``compile(CausalLMLoss)`` on ``--rows`` rows of one unit each (R = 1), every slot a
  real token: the cost of a slot of the unpacked DP step;
- ``eager, not private``: the packed batch through the model's own forward and ``backward()``
  (no per-unit work at all): the floor the DP step is compared with;
- ``--compiled`` adds the packed (at the first ``--slots`` value) and the padded DP step through
  inductor (``compile(..., inductor=True)``) and the non-private step through ``torch.compile``,
  their compile times left out.

The "÷ eager" column of a DP layout is the inverse of its document tokens per second as a share
of the non-private step's (the same tokens either way): 1.11 is 0.9 of it.

Times are medians of ``engine.accumulate`` calls (the step's graph; ``finalize`` is once per
logical batch and the same for every layout), one thread. The layouts take turns, ``--repeats``
rounds, so machine drift hits all alike; in a round a layout runs one untimed call, then
``--run`` timed ones: in training an accumulate follows the same engine's last one, never
another layout's, whose tensors would have left the caches (timed right after one, a packed
call on 16 rows took 215 ms, after its own 147). ``--profile`` adds, per layout, the self CPU time of
one call by category (matmuls, attention, norms, copies and gathers, elementwise, other).

    python benchmarks/packed_slot_cost.py [--model tiny] [--rows 8] [--seq-len 256] [--median 56]
        [--slots 32,128,512,1024] [--repeats 15] [--run 2] [--profile] [--compiled]
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import torch

import longshield_fx as lf
from longshield_fx.models.llama import Llama
from longshield_fx.packing import pack_documents

CATEGORIES = (
    ("matmuls", ("mm", "bmm", "addmm", "einsum", "grouped_mm", "matmul", "linear")),
    ("attention", ("attention", "flash", "sdpa", "softmax")),
    ("norms", ("norm", "segment_sq", "sum")),
    ("copies and gathers", ("copy", "index", "gather", "scatter", "clone", "cat", "sort", "contiguous", "to_copy",
                            "fill", "zero", "empty", "pad")),
    ("elementwise", ("where", "mul", "add", "sub", "div", "exp", "log", "silu", "neg", "pow", "rsqrt", "sqrt",
                     "clamp", "abs", "maximum", "eq", "lt", "gt", "ne", "cos", "sin")),
)


def packed_batch(rows: int, T: int, median: float, slots: int, vocab: int, seed: int = 0):
    """One physical batch of ``rows`` x T filled with documents of log-normal lengths (a unit
    each), drawn until the next would not fit in one batch of ``rows`` rows; and how many units it
    holds. (Fewer documents would go into a batch of fewer rows: ``packing.row_counts``.)"""
    g = torch.Generator().manual_seed(seed)
    units, packed = [], None
    while True:
        n = int(torch.exp(torch.randn(1, generator=g) * 0.6 + math.log(median)).long().clamp(4, T - 6))
        candidate = units + [[torch.randint(0, vocab, (n,), generator=g).tolist()]]
        if len(candidate) > slots:
            break
        attempt, _ = pack_documents(candidate, seq_len=T, rows=rows, unit_slots=slots)
        if attempt[0].tensors()[0].shape[0] == rows and len(attempt) > 1:
            break  # a full batch and more
        units = candidate
        if len(attempt) == 1 and attempt[0].tensors()[0].shape[0] == rows:
            packed = attempt
    if packed is None:
        raise SystemExit(f"packed_slot_cost: {slots} documents of median {median} tokens do not fill {rows} rows; "
                         f"raise --slots or --median")
    ids, labels, positions, unit = packed[0].tensors()
    return (ids, labels, positions, unit), int(unit[unit < slots].unique().numel())


def category(op: str) -> str:
    name = op.lower()
    for label, keys in CATEGORIES:
        if any(k in name for k in keys):
            return label
    return "other"


def breakdown(call) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        call()
    out: dict[str, float] = {}
    for event in prof.key_averages():
        if event.key.startswith(("aten::", "longshield::")) or "::" not in event.key:
            out[category(event.key)] = out.get(category(event.key), 0.0) + event.self_cpu_time_total / 1e3
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--median", type=float, default=56.0)
    p.add_argument("--slots", default="32,128,512,1024")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--run", type=int, default=2, help="timed calls in a row per layout and round, after an untimed one")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--compiled", action="store_true",
                   help="add the DP steps through inductor and the non-private one through torch.compile")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    slots = [int(s) for s in args.slots.split(",")]
    T, rows = args.seq_len, args.rows
    torch.manual_seed(0)
    lm = Llama.from_name(args.model)
    vocab = lm.tok_embeddings.num_embeddings
    (ids, labels, positions, unit), members = packed_batch(rows, T, args.median, max(slots), vocab)
    real = int((unit < max(slots)).sum())
    config = lf.DPConfig(max_grad_norm=1.0, noise_multiplier=1.0)

    calls = {}
    for U in slots:
        engine = lf.compile(lf.PackedCausalLMLoss(lm), config=config, packed_units=U)
        batch = (ids, labels, positions, torch.where(unit == max(slots), U, unit))
        calls[f"packed U={U}"] = (lambda e=engine, b=batch: e.accumulate(*b))
    padded = lf.compile(lf.CausalLMLoss(lm), config=config)
    pids = torch.randint(0, vocab, (rows, T), generator=torch.Generator().manual_seed(1))
    calls["padded (R = 1)"] = lambda: padded.accumulate(pids, pids, mask=torch.ones(rows))
    plain = lf.PackedCausalLMLoss(lm)

    def eager():
        plain(ids, labels, positions, unit).sum().backward()
        lm.zero_grad(set_to_none=True)

    calls["eager, not private"] = eager
    if args.compiled:
        U = slots[0]
        fused = lf.compile(lf.PackedCausalLMLoss(lm), config=config, packed_units=U, inductor=True)
        batch = (ids, labels, positions, torch.where(unit == max(slots), U, unit))
        calls[f"packed U={U}, inductor"] = lambda: fused.accumulate(*batch)
        fused_padded = lf.compile(lf.CausalLMLoss(lm), config=config, inductor=True)
        calls["padded (R = 1), inductor"] = lambda: fused_padded.accumulate(pids, pids, mask=torch.ones(rows))
        compiled = torch.compile(plain, fullgraph=True)

        def compiled_step():
            compiled(ids, labels, positions, unit).sum().backward()
            lm.zero_grad(set_to_none=True)

        calls["torch.compile'd, not private"] = compiled_step
    for call in calls.values():  # capture, compile, warm caches
        call()
        call()
    times = {name: [] for name in calls}
    for _ in range(args.repeats):
        for name, call in calls.items():
            call()  # after another layout's call, which no training step follows: not timed
            for _ in range(args.run):
                t0 = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - t0)
    median = {name: statistics.median(ts) for name, ts in times.items()}
    slots_total = rows * T
    print(f"# {args.model}, {rows} x {T} token slots, {members} documents ({real} real tokens, "
          f"{1 - real / slots_total:.1%} padding), one thread, medians of {args.repeats}, load "
          f"{os.getloadavg()[0]:.2f}\n")
    print("| layout | ms per call | µs per token slot | ÷ padded | ÷ eager |")
    print("|---|---|---|---|---|")
    base, floor = median["padded (R = 1)"], median["eager, not private"]
    for name, t in median.items():
        print(f"| {name} | {t * 1e3:.1f} | {t / slots_total * 1e6:.2f} | {t / base:.2f} | {t / floor:.2f} |")
    packed = [median[f"packed U={U}"] for U in slots]
    print(f"\npacked, slowest U ÷ fastest U: {max(packed) / min(packed):.2f}")
    if args.profile:
        print("\n| layout | " + " | ".join(label for label, _ in CATEGORIES) + " | other |")
        print("|---|" + "---|" * (len(CATEGORIES) + 1))
        for name, call in calls.items():
            b = breakdown(call)
            print(f"| {name} | " + " | ".join(f"{b.get(label, 0.0):.1f}" for label, _ in CATEGORIES)
                  + f" | {b.get('other', 0.0):.1f} |")
        print("\n(self CPU ms of one call by category)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
