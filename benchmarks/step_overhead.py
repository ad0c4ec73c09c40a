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

Each (method, T, B) runs in a fresh process: one warm-up step (capture, optimizer state), one
step under ``PeakRSS`` (peak resident memory of that step above the level before it: the step's
activations, gradients and clipping buffers, not the model, the optimizer state or the inputs;
64 KiB mmap threshold so RSS follows live memory), then the median of up to REPEATS timed steps
with glibc's steady-state malloc thresholds after a re-warm step (see ``worker`` for why and for
the flags "r"/"p" of configurations whose time budget was short). The sweep has a time budget
(``--time-budget``, with the process start-ups on top of the steps), shared among the
configurations by expected cost; a configuration with a short share gets fewer timed steps (at
least one). Configurations are interleaved: for each (T, B) every method runs back to back
(methods innermost; ``--rounds R`` repeats the whole sweep, rounds outermost, and reports the
median over rounds), so machine drift hits all methods alike. A method that fails (error, out
of memory under the per-process address-space limit, timeout) is reported with its reason and
the sweep goes on. The load average is printed: on a shared machine, re-run when it is well
above 2 (the worker's own threads; with 2 threads on 2 cores, one other busy process can slow
a step several-fold).

    python benchmarks/step_overhead.py [--repeats 3] [--seq-lens 256 1024 4096] [--batch-sizes 1 2 4]
        [--methods ...] [--rounds 1] [--time-budget 1080] [--mem-limit-gb 12] [--timeout 480]

Writes benchmarks/results/step_overhead.md (the table) and step_overhead.png (the ratios).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from _measure import PeakRSS, fresh_process, median, steady_state_malloc, timed  # noqa: E402
from _methods import C, SIGMA, make_step  # noqa: E402

METHODS = ["eager", "captured", "dp", "dp_block", "opacus_hooks", "opacus_ghost", "vmap"]
LABELS = {
    "eager": "(a) eager",
    "captured": "(b) captured, no DP",
    "dp": "(c) longshield DP",
    "dp_block": "(c') longshield DP, block ckpt",
    "opacus_hooks": "(d) Opacus hooks",
    "opacus_ghost": "(e) Opacus ghost",
    "vmap": "(f) vmap(grad)",
}
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


# --- workers (run in a fresh process) -----------------------------------------------------

def worker(method: str, T: int, B: int, repeats: int, budget: float, mem_limit_gb: float, threads: int) -> dict:
    """Warm-up step, peak-memory step, then timed steps while ``budget`` seconds allow.

    ``budget`` counts from the end of the warm-up step (capture is a one-time cost).

    Memory: the process starts with ``fresh_process``'s 64 KiB mmap threshold, so freed tensors
    go back to the OS and RSS follows live memory; the peak step is the second step.

    Time: a 64 KiB threshold costs a page fault per new tensor page (at T=256 it doubles a
    longshield step and adds half to an eager one), which a long training run does not pay:
    glibc's dynamic thresholds settle at mmap 32 MiB / trim 64 MiB and tensors come from a warm
    heap. So the timed steps run with those thresholds, after one untimed re-warm step that
    grows the heap. When the budget is short (slow steps), the re-warm is skipped (flag "r":
    the one timed step also grows the heap, a few per cent at T=4096), and when it cannot fit
    a single further step the peak step's own time is reported (flag "p").
    """
    if mem_limit_gb > 0:  # an allocation beyond this fails in this process (reported as OOM)
        import resource
        limit = int(mem_limit_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    import torch

    if threads > 0:
        torch.set_num_threads(threads)
    step = make_step(method, T, B)
    t0 = time.perf_counter()
    step()  # warm-up: capture / compilation, optimizer state (not counted in the budget)
    first = time.perf_counter() - t0
    start = time.perf_counter()
    with PeakRSS() as peak:
        t0 = time.perf_counter()
        step()
        est = time.perf_counter() - t0

    def left():
        return budget - (time.perf_counter() - start)

    steady_state_malloc()
    flag = ""
    if left() >= 2 * est or est < 1.0:
        step()  # re-warm: grow the heap to the step's working set
    elif left() >= est:
        flag = "r"
    else:
        flag = "p"
    times = [est] if flag == "p" else timed(step, 1)
    while not flag and len(times) < repeats and left() >= max(times):
        times += timed(step, 1)
    return {"time": median(times), "times": times, "flag": flag, "peak": peak.bytes, "first": first,
            "steps_s": time.perf_counter() - start, "threads": torch.get_num_threads()}


# --- driver -------------------------------------------------------------------------------

def run_one(method, T, B, budget, args) -> dict:
    try:
        r = fresh_process(__file__, method, str(T), str(B), str(args.repeats), f"{budget:.1f}",
                          str(args.mem_limit_gb), str(args.threads), timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout (> {args.timeout} s in one process)"}
    if "error" in r:
        e = r["error"]
        if "can't allocate memory" in e or "MemoryError" in e or "out of memory" in e.lower():
            r["error"] = f"OOM (> {args.mem_limit_gb:g} GiB address space): {e}"
    return r


def cost_weight(T: int, B: int) -> float:
    """Relative step cost: linear in tokens plus causal attention's T^2 (about half at T=4096)."""
    return T * B * (1 + T / 4096)


def combine(rounds: list[dict]) -> dict:
    ok = [r for r in rounds if "error" not in r]
    if not ok:
        return rounds[-1]
    return {"time": median([r["time"] for r in ok]), "peak": median([r["peak"] for r in ok]),
            "n": sum(len(r["times"]) for r in ok), "first": median([r["first"] for r in ok]),
            "flag": "".join(sorted({r.get("flag", "") for r in ok}))}


def fmt_table(results, seq_lens, batch_sizes, methods) -> str:
    head = ["T", "B"]
    for m in methods:
        k = LABELS[m].split()[0]
        head += [f"{k} s", f"{k} t×", f"{k} MiB", f"{k} m×"]
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
                row += [f"{r['time']:.3f}{r['flag']}", t_ratio, f"{r['peak'] / 2**20:.0f}", m_ratio]
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def plot(results, seq_lens, batch_sizes, methods, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    keys = [(T, B) for T in seq_lens for B in batch_sizes]
    others = [m for m in methods if m != "eager"]
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 1.2 * len(keys)), 8), sharex=True)
    width = 0.8 / max(1, len(others))
    for ax, field, title in ((axes[0], "time", "median step time / eager (a)"),
                             (axes[1], "peak", "peak step RSS / eager (a)")):
        for i, m in enumerate(others):
            bars, fails = [], []
            for j, k in enumerate(keys):
                r, base = results[k][m], results[k].get("eager", {"error": "not run"})
                x = j + (i - (len(others) - 1) / 2) * width
                if "error" in r or "error" in base or base[field] <= 0:
                    fails.append(x)
                else:
                    bars.append((x, r[field] / base[field], field == "time" and bool(r.get("flag"))))
            # Bars grow up or down from 1 (no overhead); hatched: time not from a re-warmed step.
            drawn = ax.bar([x for x, _, _ in bars], [y - 1 for _, y, _ in bars], width, bottom=1.0,
                           label=LABELS[m], color=f"C{i}")
            for patch, (_, _, flagged) in zip(drawn, bars):
                if flagged:
                    patch.set_hatch("//")
            ax.scatter(fails, [1.0] * len(fails), marker="x", color=f"C{i}", zorder=3)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.axhline(1.15 if field == "time" else 1.10, color="gray", ls="--", lw=0.8)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.set_ylabel(title)
        ax.grid(axis="y", which="both", alpha=0.3)
    axes[1].set_xticks(range(len(keys)))
    axes[1].set_xticklabels([f"T={T}\nB={B}" for T, B in keys])
    axes[0].legend(fontsize=8, ncol=3)
    axes[0].set_title("Overhead over non-private eager PyTorch (a), reference Llama small, CPU\n"
                      "x = failed; hatched = time not from a re-warmed step; dashed = DP targets 1.15 / 1.10",
                      fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per configuration (at most)")
    parser.add_argument("--time-budget", type=float, default=1080.0,
                        help="seconds for the whole sweep; shared among configurations by expected cost "
                             "(each gets at least warm-up + 1 timed + 1 peak-memory step)")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    parser.add_argument("--min-budget", type=float, default=2.0,
                        help="seconds of steps any configuration may use (cheap ones get their repeats)")
    parser.add_argument("--rounds", type=int, default=1, help="repeat the whole interleaved sweep")
    parser.add_argument("--mem-limit-gb", type=float, default=12.0, help="address-space limit per worker")
    parser.add_argument("--timeout", type=int, default=480, help="seconds per worker process")
    parser.add_argument("--out", default=RESULTS)
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads per worker (0: torch's default, one per core)")
    parser.add_argument("--worker", nargs=7, metavar=("METHOD", "T", "B", "REPEATS", "BUDGET", "MEM_GB", "THREADS"))
    return parser


def run_order(methods: list[str]) -> list[str]:
    """The headline pair eager / dp back to back, then the rest; Opacus ghost last: its steps are
    the slowest and overrun their budget share, which would otherwise come out of the shares of
    the methods after it."""
    order = ["eager"] + [m for m in ("dp", "dp_block", "captured") if m in methods]
    order += [m for m in methods if m not in order and m != "opacus_ghost"]
    return order + [m for m in methods if m == "opacus_ghost"]


def sweep(args, methods: list[str]) -> dict:
    """Run every (round, T, B, method) in a fresh process, interleaved (rounds outermost, methods
    innermost, so the methods of one (T, B) run back to back). Returns the raw results and loads."""
    out = {"load_before": os.getloadavg(), "loads": []}
    start = time.perf_counter()
    deadline = start + args.time_budget
    overhead = 6.0  # seconds per process outside its steps (imports, model, exit); updated as we go
    overheads = []
    plan = [(rnd, T, B, m) for rnd in range(args.rounds) for T in args.seq_lens
            for B in args.batch_sizes for m in run_order(methods)]
    raw = {(T, B): {m: [] for m in methods} for T in args.seq_lens for B in args.batch_sizes}
    for i, (rnd, T, B, m) in enumerate(plan):
        # This process's share of what is left of the time budget, by its expected step cost;
        # the worker always runs warm-up + 1 timed + 1 peak step, and more timed steps if it fits.
        rest = plan[i:]
        avail = deadline - time.perf_counter() - overhead * len(rest)
        budget = max(0.0, avail) * cost_weight(T, B) / sum(cost_weight(t, b) for _, t, b, _ in rest)
        budget = max(budget, args.min_budget)
        t0 = time.perf_counter()
        r = run_one(m, T, B, budget, args)
        wall = time.perf_counter() - t0
        raw[(T, B)][m].append(r)
        if "steps_s" in r:
            overheads.append(wall - r["steps_s"])
            overhead = median(overheads)
        out["loads"].append(os.getloadavg()[0])
        status = r["error"] if "error" in r else (f"{r['time']:.3f}{r['flag']} s x{len(r['times'])}, "
                                                 f"{r['peak'] / 2**20:.0f} MiB")
        print(f"[{time.perf_counter() - start:5.0f} s] round {rnd + 1} T={T} B={B} {m}: {status} "
              f"(process {wall:.0f} s, budget {budget:.0f} s, load {out['loads'][-1]:.2f})", file=sys.stderr,
              flush=True)
    out.update(raw=raw, total=time.perf_counter() - start, load_after=os.getloadavg())
    return out


def headline(results: dict) -> list[str]:
    """The targets at T=4096, B=1: DP / eager time and peak memory, and the Opacus modes."""
    lines = []
    for T, B in [(4096, 1)] if (4096, 1) in results else []:
        row, base = results[(T, B)], results[(T, B)]["eager"]
        if "error" in base:
            break
        for m in ("dp", "dp_block"):
            if m in row and "error" not in row[m]:
                lines.append(f"- T={T}, B={B}: {LABELS[m]} / (a): time ×{row[m]['time'] / base['time']:.2f} "
                             f"(target ≤ 1.15), peak memory ×{row[m]['peak'] / base['peak']:.2f} (target ≤ 1.10).")
        for m in ("opacus_hooks", "opacus_ghost"):
            if m in row:
                r = row[m]
                lines.append(f"- T={T}, B={B}: {LABELS[m]} / (a): " + (
                    f"failed ({r['error']})" if "error" in r else
                    f"time ×{r['time'] / base['time']:.2f}, peak memory ×{r['peak'] / base['peak']:.2f}"))
    return lines


def report(args, methods: list[str], run: dict, results: dict) -> str:
    import torch

    raw, loads = run["raw"], run["loads"]
    repeats_used = sorted({r["n"] for per in results.values() for r in per.values() if "n" in r}) or [0]
    threads_used = "/".join(map(str, sorted({r["threads"] for per in raw.values() for rs in per.values() for r in rs
                                             if "threads" in r}) or ["?"]))
    legend = "; ".join(f"{LABELS[m].split()[0]} = {' '.join(LABELS[m].split()[1:])}" for m in methods)
    return "\n".join([
        "# Step overhead of DP training (CPU)", "",
        f"`python benchmarks/step_overhead.py {' '.join(sys.argv[1:])}`".replace("  ", " "), "",
        f"Reference Llama `small` (vocab 256, 4 layers, dim 256, GQA 8/2) + `CausalLMLoss`, AdamW, "
        f"DP methods flat clipping C={C}, σ={SIGMA}. Methods: {legend}. Per method: median step seconds "
        "(`s`), its ratio to (a) (`t×`), peak MiB of one step above the pre-step RSS (`MiB`), its ratio "
        "to (a) (`m×`). A fresh process per cell; methods run interleaved (methods innermost, "
        f"{args.rounds} round(s)); {repeats_used[0]}–{repeats_used[-1]} "
        f"timed steps per cell (at most {args.repeats} per round, fewer where the {args.time_budget:.0f} s "
        "budget ran short) after a warm-up and a peak-memory step. Timed steps use glibc's steady-state "
        "malloc thresholds after a re-warm step; `r` = no re-warm step (budget short), `p` = the time of "
        "the peak-memory step (64 KiB mmap threshold) is reported.", "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch "
        f"{torch.__version__}, {threads_used} torch threads per worker. Load average (1/5/15 min) before: "
        f"{' / '.join(f'{x:.2f}' for x in run['load_before'])}, after: "
        f"{' / '.join(f'{x:.2f}' for x in run['load_after'])}; "
        f"1-min load after each cell: median {median(loads):.2f}, max {max(loads):.2f} "
        "(the benchmark's own worker accounts for about 1–2; well above 2, other processes share the "
        "2 cores and the timings are disturbed: re-run).",
        f"Total wall time: {run['total']:.0f} s ({run['total'] / 60:.1f} min).", "",
        *headline(results), "",
        fmt_table(results, args.seq_lens, args.batch_sizes, methods), "",
    ])


def main():
    args = build_parser().parse_args()
    if args.worker:
        method, T, B, repeats, budget, mem, threads = args.worker
        print(json.dumps(worker(method, int(T), int(B), int(repeats), float(budget), float(mem), int(threads))))
        return
    methods = [m for m in METHODS if m in args.methods or m == "eager"]  # ratios need (a)
    run = sweep(args, methods)
    results = {k: {m: combine(v) for m, v in per.items()} for k, per in run["raw"].items()}
    text = report(args, methods, run, results)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "step_overhead.md"), "w") as f:
        f.write(text)
    plot(results, args.seq_lens, args.batch_sizes, methods, os.path.join(args.out, "step_overhead.png"))


if __name__ == "__main__":
    main()
