"""What the per-unit products of packed documents cost on this CPU, by every way torch offers to
form them, against one matmul over the same tokens (the weight gradient's floor).

A linear weight's per-unit gradients are ``a_sᵀ b_s``, one product per unit over its own token
rows (``ops.segment._products``). The units are those of the synthetic corpus's packed batches
(``packed_documents.py``'s corpus at T = 256, E = 64, its CLI-sized physical batches), the
operands random rows of each weight shape. Ways:

- ``loop``: the library's CPU path (``segment._products``: one ``mm`` per unit, the units of
  one length evenly spaced as one ``bmm``);
- ``grouped_mm``: ``torch._grouped_mm`` over the units' rows gathered into slot order;
- ``padded bmm``: the units in buckets of similar length (``segment._batches``), each gathered
  into a zero-padded (k, n_max, ·) batch by an index made beforehand (not timed), one ``bmm``
  per bucket;
- ``native, parallel over units``: a 15-line C++ loop (``torch.utils.cpp_extension.load_inline``,
  compiled here; not part of the library) that runs each unit's ``mm`` inside
  ``at::parallel_for`` over the units, so both cores work on different units (torch has no op
  that does this; measured only where a C++ compiler is found);
- ``one mm over all tokens``: ``aᵀ b``, not per unit: what the padded step's products cost per
  token (its per-sample einsum is one ``bmm`` of samples of equal length).

Medians of ``--repeats`` calls, at the process's thread count (2 on this project's machines).

    python benchmarks/segment_products.py [--shapes 64x192,64x64,192x64,64x32] [--repeats 50] [--batches 4]

Prints a table (markdown) and writes it to benchmarks/results/segment_products.md.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys

import torch

from longshield_fx._torch import grouped_mm
from longshield_fx.ops import segment
from longshield_fx.packing import packed_rows, unit_pieces, unit_slots_for

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _measure import timed  # noqa: E402
from packed_documents import RESULTS, packed_batches, synthetic_corpus, write_section  # noqa: E402

_NATIVE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
// Unit u's runs are runs first[u] .. first[u + 1] - 1, each (starts[r], lengths[r]) rows.
void products(torch::Tensor a, torch::Tensor b, std::vector<int64_t> starts, std::vector<int64_t> lengths,
              std::vector<int64_t> first, torch::Tensor out) {
  at::parallel_for(0, (int64_t) first.size() - 1, 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      auto product = out.select(0, u);
      for (int64_t r = first[u]; r < first[u + 1]; ++r) {
        auto x = a.narrow(0, starts[r], lengths[r]).t(), y = b.narrow(0, starts[r], lengths[r]);
        if (r == first[u]) at::mm_out(product, x, y); else product.addmm_(x, y);
      }
    }
  });
}
"""


def native_products():
    """The C++ loop over units, or None where it cannot be compiled here."""
    try:
        from torch.utils.cpp_extension import load_inline
        return load_inline("longshield_segment_products_bench", cpp_sources=_NATIVE, functions=["products"],
                           extra_cflags=["-O2"]).products
    except Exception as e:  # no compiler or ninja: the row says so
        print(f"segment_products: native loop not measured ({type(e).__name__}: {e})", file=sys.stderr)
        return None


def layouts(batches: int) -> list[list]:
    """The unit runs (``segment._units``) of the synthetic corpus's first ``batches`` packed batches."""
    T, E = 256, 64
    units = [u for u in synthetic_corpus(2000, T, 256) if unit_pieces(u, T)]
    q = E / len(units)
    rows = packed_rows(4, 4)
    slots = unit_slots_for(rows, T, E)
    g = torch.Generator().manual_seed(1)
    out = []
    while len(out) < batches:
        draw = (torch.rand(len(units), generator=g) < q).nonzero().squeeze(1).tolist()
        for ids, labels, positions, unit_of in packed_batches(units, draw, T, rows, slots)[0]:
            unit = unit_of.flatten()
            counts = torch.bincount(unit, minlength=slots + 1)
            counts[-1] = 0  # the padding slot
            out.append((ids.shape[0], unit.numel(), segment._units(unit, counts)[1]))
    return out[:batches]


def median_ms(fn, repeats: int) -> float:
    fn()  # warm: the first call allocates
    return 1e3 * statistics.median(timed(fn, repeats))


def ways(a: torch.Tensor, b: torch.Tensor, units: list, native) -> dict:
    """name -> a function forming the k products (each checked against the loop's by the caller)."""
    k, p, d = len(units), a.shape[1], b.shape[1]
    lengths = [segment._size(r) for r in units]
    order = segment._rows_in_order(units, a.device)
    ends = torch.tensor(lengths).cumsum(0).to(torch.int32)
    buckets = []
    for batch in segment._batches(lengths, lambda n: n, lambda m, n: m * n * (p + d)):
        n_max = max(lengths[i] for i in batch)
        index, pad = segment._padded_index([units[i] for i in batch], n_max, a.device)
        buckets.append((torch.tensor(batch), index.flatten(), pad.flatten().nonzero().flatten(), index.shape))
    out = a.new_empty(k, p, d)

    def padded_bmm():
        for members, index, pad, shape in buckets:
            x = a.index_select(0, index).index_fill_(0, pad, 0).view(*shape, p)
            y = b.index_select(0, index).index_fill_(0, pad, 0).view(*shape, d)
            out[members] = torch.bmm(x.transpose(1, 2), y)
        return out

    found = {
        "loop": lambda: segment._products(a, b, units)[:k],
        "grouped_mm": lambda: grouped_mm(a.index_select(0, order).t(), b.index_select(0, order), ends),
        "padded bmm": padded_bmm,
    }
    if native is not None and a.dtype == torch.float32:
        runs = [run for r in units for run in r]
        first = [0]
        for r in units:
            first.append(first[-1] + len(r))
        found["native, parallel over units"] = lambda: (
            native(a, b, [s for s, _ in runs], [n for _, n in runs], first, out), out)[1]
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="64x192,64x64,192x64,64x32", help="p x d of the products (a: N x p, b: N x d)")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--batches", type=int, default=4, help="packed batches of the synthetic corpus measured")
    args = ap.parse_args()
    native = native_products()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    names = ["loop", "grouped_mm", "padded bmm", "native, parallel over units"]
    lines = [
        f"Per-unit products of the synthetic corpus's packed batches (T = 256, E = 64), ms per layer, "
        f"medians of {args.repeats} calls; {platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, machine load {os.getloadavg()[0]:.2f}.",
        "",
        "| rows, tokens, units (median tokens) | p x d | " + " | ".join(names) + " | one mm over all tokens |",
        "|---|---|" + "---|" * (len(names) + 1),
    ]
    g = torch.Generator().manual_seed(0)
    for rows, tokens, units in layouts(args.batches):
        lengths = sorted(segment._size(r) for r in units)
        for p, d in shapes:
            a, b = torch.randn(tokens, p, generator=g), torch.randn(tokens, d, generator=g)
            found = ways(a, b, units, native)
            reference = found["loop"]().clone()
            cells = []
            for name in names:
                if name not in found:
                    cells.append("-")
                    continue
                torch.testing.assert_close(found[name](), reference, rtol=1e-4, atol=1e-3)
                cells.append(f"{median_ms(found[name], args.repeats):.3f}")
            whole = median_ms(lambda: a.t() @ b, args.repeats)
            lines.append(f"| {rows}, {tokens}, {len(units)} ({lengths[len(lengths) // 2]}) | {p} x {d} | "
                         + " | ".join(cells) + f" | {whole:.3f} |")
    table = "\n".join(lines)
    print(table)
    write_section(os.path.join(RESULTS, "segment_products.md"), f"<!-- python {' '.join(sys.argv)} -->", table)


if __name__ == "__main__":
    main()
