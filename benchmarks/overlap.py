"""Overlap of per-sample reduce-scatters with compute: cost model and a measured CPU run.

1. Cost model (``longshield_fx.tools.cost_model``): the reference Llama ("small", 4 layers,
   T=4096, B=1) at cp=2, graphs built on a fake process group (``engine.lower``) with and
   without the ``overlap`` pass (``disable_passes=("overlap",)``); exposed communication at each hardware preset, and timeline PNGs.
2. Measured: the same model under torchrun, 2 gloo ranks on this CPU, cp=2; each rank
   builds both engines (with and without the pass) and alternates their steps, so drift
   hits both alike; medians and their ratio.

    python benchmarks/overlap.py [--seq-len 4096] [--repeats 5] [--out benchmarks/results]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def _disabled(with_pass: bool) -> tuple[str, ...]:
    return () if with_pass else ("overlap",)


def build_graphs(T: int, cp: int = 2, layers: int = 4):
    """{with the overlap pass: its rewritten training graph} on a fake process group."""
    import longshield_fx as lf
    from longshield_fx._torch import fake_world
    from longshield_fx.models import Llama

    graphs = {}
    with fake_world(cp) as mesh:
        for with_pass in (False, True):
            torch.manual_seed(0)
            engine = lf.compile(lf.CausalLMLoss(Llama.from_name("small", n_layers=layers)), mesh,
                                config=lf.DPConfig(1.0, 1.0), disable_passes=_disabled(with_pass))
            ids = torch.zeros(1, T, dtype=torch.long)
            graphs[with_pass] = engine.lower(ids, ids).gm
    return graphs


def cost_model_report(T: int, out: str) -> list[str]:
    from longshield_fx.tools.cost_model import HARDWARE, draw_timeline, simulate

    graphs = build_graphs(T)
    lines = ["| hardware | exposed comm before (ms) | after (ms) | after / before | step before (ms) | after (ms) |",
             "|---|---|---|---|---|---|"]
    for name, hw in HARDWARE.items():
        before, after = simulate(graphs[False], hw), simulate(graphs[True], hw)
        lines.append(f"| {name} | {before.exposed_comm * 1e3:.3f} | {after.exposed_comm * 1e3:.3f} | "
                     f"{after.exposed_comm / before.exposed_comm:.1%} | {before.total * 1e3:.2f} | {after.total * 1e3:.2f} |")
        if name == "H100-NVLink":
            os.makedirs(out, exist_ok=True)
            draw_timeline(before, os.path.join(out, "timeline_before.png"), f"{name}, without overlap pass")
            draw_timeline(after, os.path.join(out, "timeline_after.png"), f"{name}, with overlap pass")
    return lines


def bytes_table(seq_lens=(512, 2048, 8192), cp: int = 2) -> list[str]:
    """Per-sample-gradient bytes per step, input- vs output-stationary, from fake-tensor graphs."""
    import longshield_fx as lf
    from longshield_fx._torch import fake_world
    from longshield_fx.models import Llama

    lines = ["| T | input-stationary (MiB) | output-stationary (MiB) |", "|---|---|---|"]
    with fake_world(cp) as mesh:
        for T in seq_lens:
            row = []
            for comm in ("input_stationary", "output_stationary"):
                engine = lf.compile(lf.CausalLMLoss(Llama.from_name("small")), mesh,
                                    config=lf.DPConfig(1.0, 1.0, per_sample_comm=comm))
                ids = torch.zeros(1, T, dtype=torch.long)
                engine.lower(ids, ids)
                b = engine.communication_bytes()
                row.append((b["reduce_scatter"] + b["all_reduce"] + b["all_gather"]) / 2**20)
            lines.append(f"| {T} | {row[0]:.2f} | {row[1]:.2f} |")
    return lines


def worker(T: int, repeats: int):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import longshield_fx as lf
    from longshield_fx.models import Llama

    from longshield_fx._torch import serial_gloo

    dist.init_process_group(serial_gloo())  # gloo, one worker thread: _torch.serial_gloo
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    engines = {}
    for with_pass in (False, True):
        torch.manual_seed(0)
        model = lf.CausalLMLoss(Llama.from_name("small"))
        engines[with_pass] = lf.compile(model, mesh, config=lf.DPConfig(1.0, 1.0),
                                        disable_passes=_disabled(with_pass))
    ids = torch.randint(0, 256, (1, T), generator=torch.Generator().manual_seed(0))
    # One sample in every logical batch (N = 1, q = 1): what finalize divides by and accounts.
    logical = lf.data.LogicalBatch(size=1, indices=torch.arange(1), physical=[], sample_rate=1.0, expected_size=1.0)
    times = {False: [], True: []}
    for step in range(repeats + 1):
        for with_pass in (False, True):
            dist.barrier()
            start = time.perf_counter()
            engines[with_pass].accumulate(ids, ids)
            engines[with_pass].finalize(logical)
            if step:  # the first step captures
                times[with_pass].append(time.perf_counter() - start)
    if dist.get_rank() == 0:
        print(json.dumps({k: statistics.median(v) for k, v in (("without", times[False]), ("with", times[True]))}))
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--worker", action="store_true")
    args = parser.parse_args()
    if args.worker:
        return worker(args.seq_len, args.repeats)
    print(f"Cost model, reference Llama small (4 layers), T={args.seq_len}, B=1, cp=2:")
    print("\n".join(cost_model_report(args.seq_len, args.out)))
    print("\nPer-sample gradient communication per step, reference Llama small, B=1, cp=2 (graph metadata):")
    print("\n".join(bytes_table()))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__,
           "--worker", "--seq-len", str(args.seq_len), "--repeats", str(args.repeats)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    if not lines:
        print("measured run failed:", proc.stderr[-2000:])
        return 1
    r = json.loads(lines[-1])
    print(f"\nMeasured, 2 gloo ranks on this CPU, cp=2, T={args.seq_len}, median of {args.repeats} alternating steps "
          f"(load average {os.getloadavg()[0]:.1f}):")
    print("| schedule | median step (s) |\n|---|---|")
    print(f"| without overlap pass | {r['without']:.3f} |\n| with overlap pass | {r['with']:.3f} |")
    print(f"with / without = {r['with'] / r['without']:.3f}")


if __name__ == "__main__":
    sys.exit(main())
