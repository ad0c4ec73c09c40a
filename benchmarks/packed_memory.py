"""The packed DP step's memory against the unpacked one's, estimated from the graphs on fake
tensors (no real memory, CPU only): llama3.2-1b in bf16 with block checkpointing, in the layouts
of ``gpu_check.py step`` (unpacked: one row of T; packed: two rows of T, U = 4 unit slots).

For each T: the peak of intermediates by ``longshield_fx.tools.memory`` (the parameters and the
batch are inputs, counted apart; the optimizer's state and the fp32 master weights of a real run
come on top), the node where it occurs, the per-unit products the packed graph holds until its
clip factors are known, and the packed graph's largest tensors live at its peak. A GPU run's
peak (``torch.cuda.max_memory_allocated``) is about the estimate plus what the optimizer, the
weights and their gradients hold (docs/gpus.md has both for the same layouts).

    python benchmarks/packed_memory.py [--seq-lens 4096 16384 32768] [--model llama3.2-1b]

Prints a table (markdown) and writes it to benchmarks/results/packed_memory.md.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

import longshield_fx as lf
from longshield_fx._torch import FakeTensorMode
from longshield_fx.models.llama import Llama
from longshield_fx.tools.memory import estimate_memory

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "packed_memory.md")
GiB = 2 ** 30


def lowered(model_name: str, T: int, packed: bool):
    """The rewritten train graph of one layout, built on fake tensors in bf16."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)  # fake parameters refuse the engine's .to(dtype)
        try:
            lm = Llama.from_name(model_name)
        finally:
            torch.set_default_dtype(default)
        rows = 2 if packed else 1
        ids = torch.zeros(rows, T, dtype=torch.long)
        batch = (ids, ids, torch.arange(T).repeat(rows, 1), torch.zeros(rows, T, dtype=torch.long)) if packed \
            else (ids, ids)
    config = lf.DPConfig(1.0, 1.0, compute_dtype=torch.bfloat16)
    model = lf.PackedCausalLMLoss(lm) if packed else lf.CausalLMLoss(lm)
    engine = lf.compile(model, config=config, checkpoint="block", packed_units=4 if packed else 0)
    return engine.lower(*batch)


def held_bytes(gm) -> int:
    """Bytes of the per-unit products ``segment_outer_norms`` holds for the clipped sums."""
    norms = torch.ops.longshield.segment_outer_norms.default
    return sum(n.meta["val"][1].numel() * n.meta["val"][1].element_size() for n in gm.graph.nodes
               if n.target is norms)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 16384, 32768])
    p.add_argument("--model", default="llama3.2-1b")
    args = p.parse_args(argv)
    lines = [f"# {args.model}, bf16, block checkpointing: estimated peak of intermediates (GiB)", "",
             "| T | unpacked, 1 row: peak, at | packed, 2 rows, U = 4: peak, at | packed − unpacked | "
             "packed: per-unit products held |",
             "|---|---|---|---|---|"]
    tops = []
    for T in args.seq_lens:
        est = {}
        for packed in (False, True):
            low = lowered(args.model, T, packed)
            est[packed] = (estimate_memory(low.gm), held_bytes(low.gm))
        (u, _), (k, held) = est[False], est[True]
        lines.append(f"| {T} | {u.peak_bytes / GiB:.1f}, {u.peak_node} | {k.peak_bytes / GiB:.1f}, {k.peak_node} | "
                     f"{(k.peak_bytes - u.peak_bytes) / GiB:.1f} | {held / GiB:.2f} |")
        tops.append(f"packed at T = {T}: " + ", ".join(f"{name} {b / GiB:.2f}" for name, b in k.live_at_peak[:4]))
        print(lines[-1], flush=True)
    text = "\n".join(lines + ["", "Largest tensors live at the packed peak (GiB):", ""] + [f"- {t}" for t in tops])
    print(text)
    with open(RESULTS, "w") as f:
        f.write(f"<!-- python benchmarks/packed_memory.py {' '.join(sys.argv[1:] if argv is None else argv)} -->\n"
                + text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
