"""Packed documents against the padded (N, R, T) layout: padding and document tokens per second
of the DP step, side by side in one process, same model, T, units sampled and per-document ε.

Corpus: units of one or two documents with log-normal lengths (median T/8, σ = 1.2 in log
space, so a tail beyond 4T), or ``--data DIR``: every UTF-8 text file under DIR as one unit
(byte tokens), e.g. the text a Debian machine ships under /usr/share/doc.

The padded layout is today's ``load_documents`` one: each unit as R = min(max_rows, most rows
of any unit) rows of T tokens, ``CausalLMLoss``, physical batches of B units (B·R rows). The
packed layout: ``pack_documents`` into physical batches of the rows and U unit slots the CLI
picks (``packing.packed_rows``: B·R rows, a logical batch's last batches of half as many, a
quarter, ...; ``packing.unit_slots_for``), or
``--packed-rows`` / ``--slots``, ``PackedCausalLMLoss``, ``compile(..., packed_units=U)``. Both engines run the same logical
batches (the same Poisson draws over units, q = E[units] / N), flat clipping C = 1, σ = 1, so
the per-document ε is the same. A step is every physical batch of the logical batch
(``accumulate``) and ``finalize``; document tokens are the predicted tokens of the sampled
units each layout trains on (a unit longer than R rows loses its tail in the padded layout,
longer than B·R rows in the packed one). Medians over ``--repeats`` steps, the layouts
alternating step by step so machine drift hits both alike. Under context parallelism the packed
batches' ring attention skips the chunk pairs that share no document: the share is reported for
each ``--ring-cp`` degree, counted from the batches' document ids (``pairs_skipped``).
``--inductor`` runs both layouts' DP steps through inductor (``compile(..., inductor=True)``),
every graph compiled before the timed steps.

    python benchmarks/packed_documents.py [--seq-len 256] [--units-per-batch 4] [--max-rows 4]
        [--expected-units 32] [--units 2000] [--repeats 5] [--model tiny] [--data DIR] [--ring-cp 2,4,8]
        [--packed-rows ROWS] [--slots U] [--inductor]

Prints a table (markdown) and writes it to benchmarks/results/packed_documents.md, in the section
headed by its command line (other commands' sections are kept).
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import time

import torch

import longshield_fx as lf
from longshield_fx.data import LogicalBatch
from longshield_fx.losses import document_segments
from longshield_fx.ops.ring_schedule import pairs_skipped
from longshield_fx.models.llama import Llama
from longshield_fx.packing import empty_batch, pack_documents, packed_rows, row_counts, unit_pieces, unit_slots_for
from longshield_fx.runtime.accounting import PrivacyAccountant

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def synthetic_corpus(n: int, seq_len: int, vocab: int, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.exp(torch.randn(n, 2, generator=g) * 1.2 + math.log(seq_len / 8)).long().clamp(min=2)
    two = torch.rand(n, generator=g) < 0.2
    return [[torch.randint(0, vocab, (int(lengths[i, j]),), generator=g).tolist() for j in range(1 + int(two[i]))]
            for i in range(n)]


def text_corpus(root: str) -> list:
    units = []
    for dirpath, dirnames, files in os.walk(root):
        dirnames.sort()
        for name in sorted(files):
            try:
                with open(os.path.join(dirpath, name), "rb") as f:
                    data = f.read()
                data.decode("utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            if len(data) >= 2:
                units.append([list(data)])
    return units


def padded_batches(units: list, indices: list, seq_len: int, R: int, B: int) -> tuple[list, int]:
    """Today's layout: (B, R, T) ids/labels per physical batch with its mask, and the tokens trained."""
    physical, tokens = [], 0
    for start in range(0, max(1, len(indices)), B):
        chunk = indices[start:start + B]
        ids = torch.zeros(B, R, seq_len, dtype=torch.long)
        labels = torch.full((B, R, seq_len), -100, dtype=torch.long)
        for b, i in enumerate(chunk):
            for r, piece in enumerate(unit_pieces(units[i], seq_len)[:R]):
                ids[b, r, :len(piece)] = labels[b, r, :len(piece)] = torch.tensor(piece)
                tokens += len(piece) - 1
        mask = (torch.arange(B) < len(chunk)).float()
        physical.append(((ids, labels), mask))
    return physical, tokens


def packed_batches(units: list, indices: list, seq_len: int, rows: int, slots: int) -> tuple[list, int, int]:
    """The packed physical batches of the units ``indices`` (a draw of none: one blank batch of the
    fewest rows, as ``PackedPoissonBatches``), the tokens they predict (each piece kept but its
    first: packing keeps a unit's longest ``rows`` pieces) and their padding slots."""
    packed, stats = pack_documents([units[i] for i in indices], seq_len=seq_len, rows=rows, unit_slots=slots)
    if not packed:
        blank = empty_batch(row_counts(rows)[-1], seq_len, slots)
        return [blank.tensors()], 0, blank.input_ids.numel()
    tokens = stats.token_slots - stats.padding_slots - stats.pieces
    return [pb.tensors() for pb in packed], tokens, stats.padding_slots


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--units-per-batch", type=int, default=4, help="B: units per padded physical batch")
    ap.add_argument("--max-rows", type=int, default=4, help="rows per unit in the padded layout (at most)")
    ap.add_argument("--expected-units", type=float, default=32, help="E[units] per logical batch (q·N)")
    ap.add_argument("--units", type=int, default=2000, help="units in the synthetic corpus")
    ap.add_argument("--packed-rows", type=int, default=0, help="rows per packed batch (default: the CLI's rule)")
    ap.add_argument("--slots", type=int, default=0, help="U: unit slots per packed batch (default: packing.unit_slots_for(rows, T))")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--inductor", action="store_true", help="both layouts' DP steps through inductor "
                    "(compile(..., inductor=True)); each row count's graph compiled before the timed steps")
    ap.add_argument("--data", default=None, help="a directory of text files (one unit each) instead")
    ap.add_argument("--ring-cp", default="2,4,8", help="cp degrees whose share of ring chunk pairs skipped is "
                    "reported for the packed batches (comma-separated; empty: none)")
    args = ap.parse_args()
    torch.manual_seed(0)
    T = args.seq_len
    lm = Llama.from_name(args.model)
    units = text_corpus(args.data) if args.data else synthetic_corpus(args.units, T, lm.cfg.vocab_size)
    units = [u for u in units if unit_pieces(u, T)]
    N = len(units)
    R = min(args.max_rows, max(len(unit_pieces(u, T)) for u in units))
    q = min(1.0, args.expected_units / N)
    B = args.units_per_batch
    rows = args.packed_rows or packed_rows(R, B)
    slots = args.slots or unit_slots_for(rows, T, q * N)
    config = lf.DPConfig(max_grad_norm=1.0, noise_multiplier=1.0)
    padded = lf.compile(lf.CausalLMLoss(lm), config=config, inductor=args.inductor)
    packed = lf.compile(lf.PackedCausalLMLoss(lm), config=config, packed_units=slots, inductor=args.inductor)
    for r in row_counts(rows):  # every row count's graph captured (and compiled) before the timed steps
        if args.inductor:
            packed.accumulate(*empty_batch(r, T, slots).tensors())
            packed.finalize(LogicalBatch(0, torch.arange(0), [], q, q * N))
        else:
            packed.lower(*empty_batch(r, T, slots).tensors())
    g = torch.Generator().manual_seed(1)
    draws = [(torch.rand(N, generator=g) < q).nonzero().squeeze(1).tolist() for _ in range(args.repeats + 1)]

    def step(engine, physical, size, masked):
        start = time.perf_counter()
        for item in physical:
            if masked:
                (tensors, mask) = item
                engine.accumulate(*tensors, mask=mask)
            else:
                engine.accumulate(*item)
        engine.finalize(LogicalBatch(size, torch.arange(size), [], q, q * N))
        return time.perf_counter() - start

    ring_cps = [int(c) for c in args.ring_cp.split(",") if c]
    ring = {cp: [0, 0] for cp in ring_cps}  # (row, chunk pair)s skipped, and in all
    rows_out = {"padded": [], "packed": []}
    slots_out = {"padded": [0, 0], "packed": [0, 0]}  # padding slots, all slots
    for k, indices in enumerate(draws):
        phys_a, tok_a = padded_batches(units, indices, T, R, B)
        phys_b, tok_b, pad_b = packed_batches(units, indices, T, rows, slots)
        t_a = step(padded, phys_a, len(indices), True)
        t_b = step(packed, phys_b, len(indices), False)
        if k == 0:
            continue  # the first step captures
        rows_out["padded"].append((tok_a / t_a, len(phys_a), t_a))
        rows_out["packed"].append((tok_b / t_b, len(phys_b), t_b))
        all_a = len(phys_a) * B * R * T
        slots_out["padded"][0] += all_a - sum(int((l != -100).sum()) for (_, l), _ in phys_a)
        slots_out["padded"][1] += all_a
        slots_out["packed"][0] += pad_b
        slots_out["packed"][1] += sum(t[0].numel() for t in phys_b)
        for ids, labels, positions, units_of in phys_b:
            segments = document_segments(positions, units_of)[1]
            for cp in ring_cps:
                skipped, total = pairs_skipped(segments, cp)
                ring[cp][0] += skipped
                ring[cp][1] += total
    acct = PrivacyAccountant("pld")
    acct.step(1.0, q, n=1000)
    eps = acct.epsilon(1e-5)
    med = {k: statistics.median(r[0] for r in v) for k, v in rows_out.items()}
    if not med["padded"]:
        raise SystemExit(f"packed_documents: the median logical batch drew no unit (E[units] = {q * N:g}): "
                         "tokens per second compare nothing; raise --expected-units or --repeats")
    lines = [
        f"Model {args.model}, T = {T}, {N} units ({'text files under ' + args.data if args.data else 'synthetic, log-normal lengths'}), "
        f"E[units] = {q * N:g} per logical batch (q = {q:.4g}), C = 1, σ = 1: after 1000 steps ε = {eps:.2f} per "
        f"document (δ = 1e-5, PLD), the same for both layouts. {platform.processor() or platform.machine()}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; medians over {args.repeats} logical batches.",
        "",
        "| layout | physical batch | padding (token slots) | physical batches / step | step s | document tokens / s | × padded |",
        "|---|---|---|---|---|---|---|",
    ]
    for k, shape in (("padded", f"{B} units × {R} rows × {T}"),
                     ("packed", f"{' / '.join(map(str, row_counts(rows)))} rows × {T}, {slots} slots")):
        pad = slots_out[k][0] / slots_out[k][1]
        per = statistics.median(r[1] for r in rows_out[k])
        secs = statistics.median(r[2] for r in rows_out[k])
        lines.append(f"| {k} | {shape} | {pad:.1%} | {per:g} | {secs:.2f} | {med[k]:.0f} | {med[k] / med['padded']:.2f} |")
    pads = {k: slots_out[k][0] / slots_out[k][1] for k in slots_out}
    ideal = (1 - pads["packed"]) / (1 - pads["padded"])
    lines += ["", f"Packed ÷ padded: {med['packed'] / med['padded']:.2f}× for an ideal (1 − packed padding) / (1 − "
              f"padded padding) = {ideal:.2f}×: {med['packed'] / med['padded'] / ideal:.2f} of ideal (machine load "
              f"{os.getloadavg()[0]:.2f})."]
    if ring_cps:
        lines += ["", "Under context parallelism, the ring attention of these packed batches skips "
                  + ", ".join(f"{ring[cp][0] / ring[cp][1]:.1%} of the (row, chunk pair)s at cp = {cp}" for cp in ring_cps)
                  + " (a row left out of a kernel call for sharing no document there; counted by "
                  "`ring_attention.pairs_skipped` from each batch's document ids, as the ranks' `last_block_counts` do)."]
    table = "\n".join(lines)
    print(table)
    write_section(os.path.join(RESULTS, "packed_documents.md"), f"<!-- python {' '.join(sys.argv)} -->", table)


def write_section(path: str, header: str, table: str) -> None:
    """Put ``table`` under ``header`` in the results file: a run replaces the section of the same
    command and leaves the other commands' sections as they are."""
    sections, current = [], None
    if os.path.exists(path):
        with open(path) as f:
            for line in f.read().splitlines():
                if line.startswith("<!-- python "):
                    current = [line]
                    sections.append(current)
                elif current is not None:
                    current.append(line)
    kept = ["\n".join(lines).strip() for lines in sections if lines[0] != header]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write("\n\n".join([*kept, f"{header}\n{table}"]) + "\n")


if __name__ == "__main__":
    main()
