"""Cost of the secret noise stream against torch.randn, per DP step.

    python benchmarks/noise.py [--device cuda] [--repeats 5]

Draws one noise value per coordinate for every parameter of the reference Llama ``small``
(3.1M) and of ``llama3.2-1b`` (1.24B; on CPU extrapolated from the measured rate, since a
draw takes minutes there), as ``engine.finalize`` does: per parameter, float32 out.
Median of ``--repeats`` after one warm-up (which includes any compile time on a GPU).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from longshield_fx.models.llama import CONFIGS, Llama
from longshield_fx.runtime.noise import NoiseGenerator


def param_sizes(name: str) -> list[int]:
    with torch.device("meta"):
        model = Llama(CONFIGS[name])
    return [p.numel() for p in model.parameters()]


def timed(draw, sizes, device, repeats):
    def once():
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for n in sizes:
            draw(n)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    warm = once()
    return warm, statistics.median(once() for _ in range(repeats))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    device = torch.device(args.device)
    secure, fast = NoiseGenerator(device, secure=True), NoiseGenerator(device, secure=False)
    methods = {
        "torch.randn (seedable, NOT secret)": lambda n: torch.randn(n, device=device),
        "ChaCha20, secure_rng=False": lambda n: fast.normal(n, 1.0),
        "ChaCha20, secure_rng=True (default)": lambda n: secure.normal(n, 1.0),
    }
    print(f"device {device}, torch {torch.__version__}, threads {torch.get_num_threads()}")
    print("| model | parameters | method | first call s | median s | ns / value | × randn |")
    print("|---|---|---|---|---|---|---|")
    for model in ("small", "llama3.2-1b"):
        sizes = param_sizes(model)
        total = sum(sizes)
        measured = sizes
        if device.type == "cpu" and total > 1e8:
            measured = param_sizes("small")  # extrapolate the per-value rate
        base = None
        for name, draw in methods.items():
            warm, median = timed(draw, measured, device, args.repeats)
            per_value = median / sum(measured)
            seconds = per_value * total
            base = base or seconds
            note = "" if measured is sizes else " (extrapolated)"
            print(f"| {model} | {total / 1e6:.1f}M | {name} | {warm:.3f} | {seconds:.3f}{note} | "
                  f"{per_value * 1e9:.2f} | {seconds / base:.1f} |")


if __name__ == "__main__":
    main()
