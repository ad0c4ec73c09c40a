"""Step time and peak memory of the ``chunked_loss`` pass against eager PyTorch and the plain loss.

2-layer reference Llama ("small" shapes: dim 256, 8 heads, 2 KV heads) with a 32000-token
vocabulary, so the LM head's (T, V) logits dominate the step's memory, in ``CausalLMLoss``,
B=1, flat clipping, on this machine's CPU. Configurations:

  eager (non-private)  plain PyTorch: ``model(ids, ids).sum().backward()`` (materialises the logits)
  DP, chunked loss     ``lf.compile(model, config=DPConfig(1.0, 0.0))``: the LM head and its
                       cross-entropy run chunk by chunk (``longshield::lm_head_loss``)
  DP, plain loss       the same with ``disable_passes=("chunked_loss",)``

Each configuration runs in a fresh process: 1 warm-up step, then the median of REPEATS steps
(timed with glibc's steady-state malloc thresholds after a re-warm step, see
``_measure.steady_state_malloc``); peak memory is the resident-set peak of one step above the
level before it (model and inputs excluded; eager's step includes allocating its ``.grad``s,
which ``zero_grad(set_to_none=True)`` frees after each step), next to the graph's liveness
estimate for the DP configurations. Prints one table and the two acceptance ratios of the
chunked DP step against eager (peak <= 0.5, time <= 1.15).

    python benchmarks/chunked_loss.py [--repeats 3] [--seq-lens 8192]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from _measure import PeakRSS, fresh_process, median, steady_state_malloc, timed  # noqa: E402

CONFIGS = ["eager", "chunked", "plain"]
LABELS = {"eager": "eager (non-private)", "chunked": "DP, chunked loss", "plain": "DP, plain loss"}
VOCAB = 32000
PEAK_TARGET, TIME_TARGET = 0.5, 1.15


def worker(T: int, config: str, repeats: int) -> dict:
    import torch

    import longshield_fx as lf
    from longshield_fx.tools.memory import estimate_memory
    from longshield_fx.models import Llama

    torch.manual_seed(0)
    model = lf.CausalLMLoss(Llama.from_name("small", n_layers=2, vocab_size=VOCAB))
    ids = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(0))
    estimate = None
    if config == "eager":
        def step():
            model(ids, ids).sum().backward()
            model.zero_grad(set_to_none=True)
    else:
        disable = ("chunked_loss",) if config == "plain" else ()
        engine = lf.compile(model, config=lf.DPConfig(1.0, 0.0), disable_passes=disable)
        estimate = estimate_memory(engine.lower(ids, ids).gm).peak_bytes  # capture

        def step():
            engine.accumulate(ids, ids)
    step()  # warm-up
    with PeakRSS() as peak:
        step()
    steady_state_malloc()
    step()  # re-warm the heap under the steady-state thresholds
    times = timed(step, repeats)
    return {"time": median(times), "peak": peak.bytes, "estimate": estimate}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[8192])
    parser.add_argument("--worker", nargs=3, metavar=("T", "CONFIG", "REPEATS"))
    args = parser.parse_args()
    if args.worker:
        T, config, repeats = args.worker
        print(json.dumps(worker(int(T), config, int(repeats))))
        return
    rows, checks = [], []
    for T in args.seq_lens:
        results = {c: fresh_process(__file__, str(T), c, str(args.repeats)) for c in CONFIGS}
        base = results["eager"]
        for c in CONFIGS:
            r = results[c]
            if "error" in r:
                rows.append(f"| {T} | {LABELS[c]} | failed: {r['error']} | | | | |")
                continue
            ratio_t = f"{r['time'] / base['time']:.2f}" if "error" not in base else ""
            ratio_p = f"{r['peak'] / base['peak']:.2f}" if "error" not in base else ""
            est = f"{r['estimate'] / 2**20:.0f}" if r["estimate"] is not None else ""
            rows.append(f"| {T} | {LABELS[c]} | {r['time']:.2f} | {ratio_t} | "
                        f"{r['peak'] / 2**20:.0f} | {ratio_p} | {est} |")
        chunked = results["chunked"]
        if "error" in base or "error" in chunked:
            checks.append(f"T={T}: acceptance ratios unavailable (a configuration failed)")
            continue
        peak_ratio, time_ratio = chunked["peak"] / base["peak"], chunked["time"] / base["time"]
        checks.append(f"T={T}: DP chunked peak / eager peak = {peak_ratio:.2f} (target <= {PEAK_TARGET}: "
                      f"{'met' if peak_ratio <= PEAK_TARGET else 'NOT met'})")
        checks.append(f"T={T}: DP chunked time / eager time = {time_ratio:.2f} (target <= {TIME_TARGET}: "
                      f"{'met' if time_ratio <= TIME_TARGET else 'NOT met'})")
    print("| T | config | step s (median) | time / eager | peak MiB (measured) | peak / eager | peak MiB (estimate) |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print()
    print("\n".join(checks))


if __name__ == "__main__":
    main()
