"""Step time and peak memory of DP training with activation checkpointing none / selective / block.

8-layer reference Llama ("small" shapes: dim 256, 8 heads, 2 KV heads), B=1, flat clipping,
on this machine's CPU. Each configuration runs in a fresh process: 1 warm-up step, then the
median of REPEATS steps (timed with glibc's steady-state malloc thresholds after a re-warm step,
see ``_measure.steady_state_malloc``); peak memory is the resident-set peak of one step above the
level before it (model, optimizer and inputs excluded), next to the graph's liveness estimate.

    python benchmarks/checkpointing.py [--repeats 3] [--seq-lens 1024 4096]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from _measure import PeakRSS, fresh_process, median, steady_state_malloc, timed  # noqa: E402

POLICIES = ["none", "selective", "block"]


def worker(T: int, policy: str, repeats: int) -> dict:
    import torch

    import longshield_fx as lf
    from longshield_fx.tools.memory import estimate_memory
    from longshield_fx.models import Llama

    torch.manual_seed(0)
    model = lf.CausalLMLoss(Llama.from_name("small", n_layers=8))
    engine = lf.compile(model, config=lf.DPConfig(1.0, 0.0), checkpoint=None if policy == "none" else policy)
    ids = torch.randint(0, 256, (1, T), generator=torch.Generator().manual_seed(0))
    estimate = estimate_memory(engine.lower(ids, ids).gm).peak_bytes  # capture
    engine.accumulate(ids, ids)  # warm-up
    with PeakRSS() as peak:
        engine.accumulate(ids, ids)
    steady_state_malloc()
    engine.accumulate(ids, ids)  # re-warm the heap under the steady-state thresholds
    times = timed(lambda: engine.accumulate(ids, ids), repeats)
    return {"time": median(times), "peak": peak.bytes, "estimate": estimate}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--worker", nargs=3, metavar=("T", "POLICY", "REPEATS"))
    args = parser.parse_args()
    if args.worker:
        T, policy, repeats = args.worker
        print(json.dumps(worker(int(T), policy, int(repeats))))
        return
    rows = []
    for T in args.seq_lens:
        results = {p: fresh_process(__file__, str(T), p, str(args.repeats)) for p in POLICIES}
        base = results["none"]
        for p in POLICIES:
            r = results[p]
            if "error" in r:
                rows.append(f"| {T} | {p} | failed: {r['error']} | | | | |")
                continue
            rows.append(f"| {T} | {p} | {r['time']:.2f} | {r['time'] / base['time']:.2f} | "
                        f"{r['peak'] / 2**20:.0f} | {r['peak'] / base['peak']:.2f} | {r['estimate'] / 2**20:.0f} |")
    print("| T | checkpoint | step s (median) | time / none | peak MiB (measured) | peak / none | peak MiB (estimate) |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
