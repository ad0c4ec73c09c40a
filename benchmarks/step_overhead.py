"""Step-time and peak-memory overhead of DP training: longshield_fx against eager PyTorch and peers.

Reference Llama (``Llama.from_name("small")``: byte vocabulary 256, 4 layers, dim 256, GQA 8/2)
wrapped in ``CausalLMLoss``, AdamW, on this machine's CPU, for T in {256, 1024, 4096} and
B in {1, 2, 4}. Methods (one training step each: forward, backward, [clip, noise,] AdamW step):

  eager        (a) non-private eager PyTorch: ``model(ids, ids).sum().backward()``
  captured     (b) the same captured aten graph (``longshield_fx.capture``) without DP passes
  dp           (c) longshield_fx DP, flat clipping C=1, sigma=1 (``accumulate`` + ``finalize``)
  dp_block     (c) the same with ``checkpoint="block"``
  opacus_hooks (d) Opacus ``make_private(grad_sample_mode="hooks")``, flat, C=1, sigma=1
  opacus_ghost (e) Opacus ghost clipping ``make_private(grad_sample_mode="ghost")``, flat, C=1
  vmap         (f) torch.func ``vmap(grad(...))`` per-sample gradients, manual flat clip + noise

Each (method, T, B) runs in a fresh process: warm-up step(s) (capture, optimizer state), one
step under ``PeakRSS`` (peak resident memory of that step above the level before it; it
includes the step's own gradient and clipping allocations but not the model, the optimizer
state or the inputs), then the median of up to REPEATS timed steps (fewer when one step takes
longer than STEP_BUDGET / REPEATS seconds). Configurations are interleaved: for each (T, B)
every method runs back to back (methods innermost; with ``--rounds R`` the whole sweep repeats
R times, rounds outermost, and the median over rounds is reported), so machine drift hits all
methods alike. A method that fails (error, out of memory under the per-process address-space
limit, timeout) is reported with its reason and the sweep goes on.

    python benchmarks/step_overhead.py [--repeats 3] [--seq-lens 256 1024 4096] [--batch-sizes 1 2 4]
        [--methods ...] [--rounds 1] [--step-budget 20] [--mem-limit-gb 12] [--timeout 300]

Writes benchmarks/results/step_overhead.md (the table) and step_overhead.png (the ratios).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from _measure import PeakRSS, fresh_process, median, timed  # noqa: E402

METHODS = ["eager", "captured", "dp", "dp_block", "opacus_hooks", "opacus_ghost", "vmap"]
LABELS = {
    "eager": "(a) eager",
    "captured": "(b) captured, no DP",
    "dp": "(c) longshield DP",
    "dp_block": "(c) longshield DP, block ckpt",
    "opacus_hooks": "(d) Opacus hooks",
    "opacus_ghost": "(e) Opacus ghost",
    "vmap": "(f) vmap(grad)",
}
C, SIGMA, LR = 1.0, 1.0, 1e-4
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


# --- workers (run in a fresh process) ------------------------------------------------------

def _register_rmsnorm_grad_sampler():
    """Opacus has no per-sample rule for the reference Llama's RMSNorm: give it one."""
    import torch
    from opacus.grad_sample import register_grad_sampler

    from longshield_fx.models.llama import RMSNorm

    @register_grad_sampler(RMSNorm)
    def rmsnorm_grad_sample(layer, activations, backprops):
        x = activations[0].float()
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + layer.eps)
        return {layer.weight: torch.einsum("b...d,b...d->bd", backprops, normed.to(x.dtype))}


class _PerSampleLossCriterion:
    """Opacus ghost clipping's criterion: the model already returns per-sample losses (B,).

    ``DPLossFastGradientClipping`` sets ``reduction="none"`` around the call and wraps the
    (B,) result; "sum" is what the non-private objective uses.
    """

    def __init__(self):
        self.reduction = "sum"

    def __call__(self, per_sample_loss):
        return per_sample_loss if self.reduction == "none" else per_sample_loss.sum()


def make_step(method: str, T: int, B: int):
    """Build the model and optimizer for ``method``; return a closure running one training step."""
    import torch

    import longshield_fx as lf
    from longshield_fx.models import Llama

    torch.manual_seed(0)
    model = lf.CausalLMLoss(Llama.from_name("small"))
    ids = torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(0))

    if method == "eager":
        opt = torch.optim.AdamW(model.parameters(), lr=LR)

        def step():
            model(ids, ids).sum().backward()
            opt.step()
            opt.zero_grad()
        return step

    if method == "captured":
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        params = dict(model.named_parameters())
        state = {}

        def step():
            if "cg" not in state:
                state["cg"] = lf.capture(model, (ids, ids))
            cg = state["cg"]
            with torch.no_grad():
                _, *grads = cg.gm(*cg.gather_args(model, (ids, ids), torch.ones(B)))
            for name, g in zip(cg.param_names, grads):
                params[name].grad = g
            del grads
            opt.step()
            opt.zero_grad()
        return step

    if method in ("dp", "dp_block"):
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        engine = lf.compile(model, config=lf.DPConfig(C, SIGMA, seed=0),
                            checkpoint="block" if method == "dp_block" else None)

        def step():
            engine.accumulate(ids, ids)
            engine.finalize(B)
            opt.step()
            opt.zero_grad()
        return step

    if method in ("opacus_hooks", "opacus_ghost"):
        from opacus import PrivacyEngine
        from torch.utils.data import DataLoader, TensorDataset

        _register_rmsnorm_grad_sampler()
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        loader = DataLoader(TensorDataset(ids, ids), batch_size=B)
        common = dict(optimizer=opt, data_loader=loader, noise_multiplier=SIGMA, max_grad_norm=C,
                      loss_reduction="sum", poisson_sampling=False, clipping="flat",
                      noise_generator=torch.Generator().manual_seed(0))
        if method == "opacus_hooks":
            gsm, dp_opt, _ = PrivacyEngine().make_private(module=model, grad_sample_mode="hooks", **common)

            def step():
                gsm(ids, ids).sum().backward()
                dp_opt.step()
                dp_opt.zero_grad()
            return step
        criterion = _PerSampleLossCriterion()
        gsm, dp_opt, dp_loss, _ = PrivacyEngine().make_private(
            module=model, grad_sample_mode="ghost", criterion=criterion, **common)

        def step():
            dp_loss(gsm(ids, ids)).backward()  # two backward passes: norms, then clipped sum
            dp_opt.step()
            dp_opt.zero_grad()
        return step

    if method == "vmap":
        from torch.func import functional_call, grad, vmap

        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        named = dict(model.named_parameters())
        noise = torch.Generator().manual_seed(0)

        def sample_loss(p, x, y):
            return functional_call(model, p, (x[None], y[None])).sum()

        per_sample_grads = vmap(grad(sample_loss), in_dims=(None, 0, 0))

        def step():
            params = {k: v.detach() for k, v in named.items()}
            g = per_sample_grads(params, ids, ids)
            with torch.no_grad():
                norms = torch.sqrt(sum(v.flatten(1).pow(2).sum(1) for v in g.values()))
                factor = (C / (norms + 1e-6)).clamp(max=1.0)
                for k, v in g.items():
                    total = torch.einsum("b,b...->...", factor, v)
                    total += SIGMA * C * torch.randn(total.shape, generator=noise)
                    named[k].grad = total / B
            del g
            opt.step()
            opt.zero_grad()
        return step

    raise ValueError(f"unknown method {method!r}")


def worker(method: str, T: int, B: int, repeats: int, step_budget: float, mem_limit_gb: float) -> dict:
    if mem_limit_gb > 0:  # an allocation beyond this fails in this process (reported as OOM)
        import resource
        limit = int(mem_limit_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    import torch

    step = make_step(method, T, B)
    start = time.perf_counter()
    step()  # warm-up: capture / compilation, optimizer state
    first = time.perf_counter() - start
    with PeakRSS() as peak:
        start = time.perf_counter()
        step()
        second = time.perf_counter() - start
    n = max(1, min(repeats, math.floor(step_budget / max(second, 1e-9))))
    times = timed(step, n)
    return {"time": median(times), "times": times, "peak": peak.bytes, "first": first,
            "threads": torch.get_num_threads()}


# --- driver -------------------------------------------------------------------------------

def run_one(method, T, B, args) -> dict:
    try:
        r = fresh_process(__file__, method, str(T), str(B), str(args.repeats), str(args.step_budget),
                          str(args.mem_limit_gb), timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout (> {args.timeout} s for warm-up + steps)"}
    if "error" in r:
        e = r["error"]
        if "can't allocate memory" in e or "MemoryError" in e or "out of memory" in e.lower():
            r["error"] = f"OOM (> {args.mem_limit_gb:g} GiB address space): {e}"
    return r


def combine(rounds: list[dict]) -> dict:
    ok = [r for r in rounds if "error" not in r]
    if not ok:
        return rounds[-1]
    return {"time": median([r["time"] for r in ok]), "peak": median([r["peak"] for r in ok]),
            "n": sum(len(r["times"]) for r in ok), "first": median([r["first"] for r in ok])}


def fmt_table(results, seq_lens, batch_sizes, methods) -> str:
    head = ["T", "B"]
    for m in methods:
        head += [f"{LABELS[m]} s", "×(a)", "MiB", "×(a)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for T in seq_lens:
        for B in batch_sizes:
            base = results[(T, B)].get("eager", {"error": "not run"})
            row = [str(T), str(B)]
            for m in methods:
                r = results[(T, B)][m]
                if "error" in r:
                    row += [f"failed: {r['error']}".replace("|", "/"), "", "", ""]
                    continue
                t_ratio = f"{r['time'] / base['time']:.2f}" if "error" not in base else ""
                m_ratio = f"{r['peak'] / base['peak']:.2f}" if "error" not in base and base["peak"] > 0 else ""
                row += [f"{r['time']:.3f}", t_ratio, f"{r['peak'] / 2**20:.0f}", m_ratio]
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def plot(results, seq_lens, batch_sizes, methods, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [(T, B) for T in seq_lens for B in batch_sizes]
    others = [m for m in methods if m != "eager"]
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 1.2 * len(keys)), 8), sharex=True)
    width = 0.8 / max(1, len(others))
    for ax, field, title in ((axes[0], "time", "median step time / eager (a)"),
                             (axes[1], "peak", "peak step RSS / eager (a)")):
        for i, m in enumerate(others):
            xs, ys, fails = [], [], []
            for j, k in enumerate(keys):
                r, base = results[k][m], results[k].get("eager", {"error": "not run"})
                x = j + (i - (len(others) - 1) / 2) * width
                if "error" in r or "error" in base or base[field] <= 0:
                    fails.append(x)
                    continue
                xs.append(x)
                ys.append(r[field] / base[field])
            ax.bar(xs, ys, width, label=LABELS[m], color=f"C{i}")
            ax.scatter(fails, [1.0] * len(fails), marker="x", color=f"C{i}", zorder=3)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.axhline(1.15 if field == "time" else 1.10, color="gray", ls="--", lw=0.8)
        ax.set_yscale("log")
        ax.set_ylabel(title)
        ax.grid(axis="y", which="both", alpha=0.3)
    axes[1].set_xticks(range(len(keys)))
    axes[1].set_xticklabels([f"T={T}\nB={B}" for T, B in keys])
    axes[0].legend(fontsize=8, ncol=3)
    axes[0].set_title("Overhead over non-private eager PyTorch (x = failed; dashed = DP targets 1.15 / 1.10)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per configuration (at most)")
    parser.add_argument("--step-budget", type=float, default=20.0,
                        help="seconds of timed steps per configuration; slower methods get fewer repeats")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    parser.add_argument("--rounds", type=int, default=1, help="repeat the whole interleaved sweep")
    parser.add_argument("--mem-limit-gb", type=float, default=12.0, help="address-space limit per worker")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per worker process")
    parser.add_argument("--out", default=RESULTS)
    parser.add_argument("--worker", nargs=6, metavar=("METHOD", "T", "B", "REPEATS", "BUDGET", "MEM_GB"))
    args = parser.parse_args()
    if args.worker:
        method, T, B, repeats, budget, mem = args.worker
        print(json.dumps(worker(method, int(T), int(B), int(repeats), float(budget), float(mem))))
        return

    methods = ["eager"] + [m for m in args.methods if m != "eager"]  # ratios need (a)
    load_before = os.getloadavg()
    start = time.perf_counter()
    raw = {(T, B): {m: [] for m in methods} for T in args.seq_lens for B in args.batch_sizes}
    for rnd in range(args.rounds):
        for T in args.seq_lens:
            for B in args.batch_sizes:
                for m in methods:  # methods innermost: adjacent in time
                    t0 = time.perf_counter()
                    r = run_one(m, T, B, args)
                    raw[(T, B)][m].append(r)
                    status = r["error"] if "error" in r else f"{r['time']:.3f} s, {r['peak'] / 2**20:.0f} MiB"
                    print(f"[round {rnd + 1} {time.perf_counter() - start:6.0f}s] T={T} B={B} {m}: {status} "
                          f"(process {time.perf_counter() - t0:.0f} s, load {os.getloadavg()[0]:.2f})",
                          file=sys.stderr, flush=True)
    total = time.perf_counter() - start
    load_after = os.getloadavg()
    results = {k: {m: combine(v) for m, v in per.items()} for k, per in raw.items()}

    import torch
    table = fmt_table(results, args.seq_lens, args.batch_sizes, methods)
    repeats_used = sorted({r["n"] for per in results.values() for r in per.values() if "n" in r})
    summary = [
        "# Step overhead of DP training (CPU)",
        "",
        f"`python benchmarks/step_overhead.py {' '.join(sys.argv[1:])}`".replace("  ", " "),
        "",
        f"Reference Llama `small` (vocab 256, 4 layers, dim 256, GQA 8/2) + `CausalLMLoss`, AdamW, "
        f"flat clipping C={C}, σ={SIGMA}. Each cell: median step seconds, ratio to (a), peak MiB of one "
        "step above the pre-step RSS (fresh process per configuration), ratio to (a). Methods run "
        f"interleaved (methods innermost, {args.rounds} round(s)); timed steps per cell: "
        f"{repeats_used} (at most {args.repeats} × rounds, fewer when a step is slower than "
        f"{args.step_budget:g} s / {args.repeats}).",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads. Load average (1/5/15 min) before: "
        f"{' / '.join(f'{x:.2f}' for x in load_before)}, after: {' / '.join(f'{x:.2f}' for x in load_after)}.",
        f"Total wall time: {total:.0f} s ({total / 60:.1f} min).",
        "",
        table,
        "",
    ]
    text = "\n".join(summary)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "step_overhead.md"), "w") as f:
        f.write(text)
    plot(results, args.seq_lens, args.batch_sizes, methods, os.path.join(args.out, "step_overhead.png"))


if __name__ == "__main__":
    main()
