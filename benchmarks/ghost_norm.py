"""Ghost norm + book-keeping (the ``ghost_norm`` pass) against materialised per-sample gradients.

Two tables, every cell in a fresh process (1 warm-up step, the resident-set peak of one step
above the level before it, then the median of REPEATS steps timed with glibc's steady-state
malloc thresholds after a re-warm step; see ``_measure``):

1. Training steps of the reference Llama ``small`` (dim 256, 4 layers, vocab 256) in
   ``CausalLMLoss`` with AdamW, flat clipping C=1, σ=1 (``accumulate`` + ``finalize`` + step):
   non-private eager PyTorch, DP with the pass (its per-layer choice), DP without it
   (``disable_passes=("ghost_norm",)``). At (T, B) = (256, 16), the issue's point, and
   (64, 64), where the per-sample gradients outgrow the activations.
2. The cost model's crossover, one layer at a time: a frozen embedding (d=1024) into one
   ``Linear(1024, 1024)``, loss = the per-sample mean square of its output; the step
   (``accumulate`` + ``finalize`` without noise) with that layer forced to ghost norm and
   forced to per-sample gradients, at two (T, B) points on each side of our rule's crossover
   (2T(p+d) = p·d at T = 256); DP-ZeRO's rule (2T² = p·d) crosses at T ≈ 724.

    python benchmarks/ghost_norm.py [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from _measure import PeakRSS, fresh_process, median, steady_state_malloc, timed  # noqa: E402

STEP_POINTS = [(256, 16), (64, 64)]
STEP_CONFIGS = {"eager": "eager (non-private)", "auto": "DP, ghost_norm pass", "off": "DP, per-sample only"}
LAYER_D, LAYER_POINTS = 1024, [(128, 16), (256, 8), (512, 8), (1024, 4)]  # (T, B)


def _llama_step(config: str, T: int, B: int):
    """step_overhead's eager and DP steps (``_methods``), DP with or without the pass."""
    import torch

    import longshield_fx as lf
    from _methods import _eager, _longshield
    from longshield_fx.models import Llama

    torch.manual_seed(0)
    model = lf.CausalLMLoss(Llama.from_name("small"))
    ids = torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(0))
    if config == "eager":
        return _eager(model, ids, B), {}
    step = _longshield(model, ids, B, disable_passes=("ghost_norm",) if config == "off" else ())
    methods = step.engine.lower(ids, ids).norm_methods
    return step, {"ghost_layers": sum(m.startswith("ghost") for m in methods.values())}


def _layer_step(config: str, T: int, B: int):
    import torch
    import torch.nn as nn

    import longshield_fx as lf
    rule = sys.modules["longshield_fx.passes.ghost_norm"]  # the module (the package's name is the pass)

    class OneLayer(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(256, LAYER_D).requires_grad_(False)
            self.fc = nn.Linear(LAYER_D, LAYER_D, bias=False)

        def forward(self, ids):
            return self.fc(self.embed(ids)).pow(2).mean((1, 2))

    torch.manual_seed(0)
    model = OneLayer()
    ids = torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(0))
    rule.prefers_ghost = lambda *shape: config == "ghost"  # force this cell's method
    engine = lf.compile(model, config=lf.DPConfig(1.0, 0.0))
    batch = lf.data.LogicalBatch(size=B, indices=torch.arange(B), physical=[], sample_rate=1.0, expected_size=float(B))

    def step():
        engine.accumulate(ids)
        engine.finalize(batch)
        model.zero_grad(set_to_none=True)
    step()
    method = engine.lower(ids).norm_methods["fc.weight"].split()[0]
    assert method == config, (method, config)
    return step, {}


def worker(kind: str, config: str, T: int, B: int, repeats: int) -> dict:
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    step, info = (_llama_step if kind == "llama" else _layer_step)(config, T, B)
    step()  # warm-up (capture happened above for DP)
    with PeakRSS() as peak:
        step()
    steady_state_malloc()
    step()  # re-warm with the steady-state thresholds
    times = timed(step, repeats)
    return {"time": median(times), "peak": peak.bytes, **info}


def _cell(kind, config, T, B, repeats) -> dict:
    return fresh_process(__file__, kind, config, str(T), str(B), str(repeats))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", nargs=5, metavar=("KIND", "CONFIG", "T", "B", "REPEATS"))
    args = parser.parse_args(argv)
    if args.worker:
        kind, config, T, B, repeats = args.worker
        print(json.dumps(worker(kind, config, int(T), int(B), int(repeats))))
        return

    print("## DP training step, reference Llama `small`, CPU\n")
    print("| T | B | config | ghost layers | step s | × eager | peak MiB | × eager |")
    print("|---|---|---|---|---|---|---|---|")
    for T, B in STEP_POINTS:
        cells = {c: _cell("llama", c, T, B, args.repeats) for c in STEP_CONFIGS}
        base = cells["eager"]
        for c, label in STEP_CONFIGS.items():
            r = cells[c]
            if "error" in r:
                print(f"| {T} | {B} | {label} | failed: {r['error']} | | | | |")
                continue
            print(f"| {T} | {B} | {label} | {r.get('ghost_layers', '-')} | {r['time']:.3f} | "
                  f"{r['time'] / base['time']:.2f} | {r['peak'] / 2**20:.0f} | {r['peak'] / base['peak']:.2f} |")

    print(f"\n## One Linear({LAYER_D}, {LAYER_D}): forced ghost vs forced per-sample "
          "(accumulate + finalize)\n")
    from longshield_fx.passes.ghost_norm import prefers_ghost

    p = d = LAYER_D
    print("| T | B | DP-ZeRO's rule 2T² ≤ p·d | ours 2T(p+d) ≤ p·d | ghost s | per-sample s | ghost / per-sample time | "
          "ghost MiB | per-sample MiB | ghost / per-sample memory |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for T, B in LAYER_POINTS:
        g, q = (_cell("layer", c, T, B, args.repeats) for c in ("ghost", "per-sample"))
        if "error" in g or "error" in q:
            print(f"| {T} | {B} | failed: {g.get('error') or q.get('error')} |" + " |" * 7)
            continue
        dpzero = "ghost" if 2 * T * T <= p * d else "per-sample"
        ours = "ghost" if prefers_ghost(T, p, d) else "per-sample"
        print(f"| {T} | {B} | {dpzero} ({2 * T * T / (p * d):.2f}) | {ours} ({2 * T * (p + d) / (p * d):.2f}) | "
              f"{g['time']:.3f} | {q['time']:.3f} | {g['time'] / q['time']:.2f} | {g['peak'] / 2**20:.0f} | "
              f"{q['peak'] / 2**20:.0f} | {g['peak'] / q['peak']:.2f} |")


if __name__ == "__main__":
    main()
