"""2D attention (hp x cp) and double-ring attention: measured on 4 gloo ranks, and modelled.

1. Measured: the reference Llama "small" (4 layers, dim 256, 8 heads, 2 K/V heads) under
   torchrun, 4 gloo ranks on this CPU, T=8192, B=1, one DP step (accumulate + finalize) per
   layout: (hp, cp) = (1, 4), (2, 2), (4, 1) and the double ring cp=4, w=2. Each rank builds
   every engine and the layouts alternate step by step, so drift hits all alike; medians.
2. Modelled (``longshield_fx.tools.cost_model.attention_time``, LoongTrain section 4.5): the
   same layouts on this CPU ("CPU-gloo"), to compare the model's ordering with the
   measurement; then one Llama-3.1-8B attention layer (H=32, Hkv=8, head dim 128, bf16) at
   T=8k and 32k on 4 x H100 over NVLink and on 2 nodes x 4 H100 over InfiniBand: the
   fastest (hp, cp, w, placement) that ``search_attention`` finds, and the plain ring.

    python benchmarks/attention_2d.py [--seq-len 8192] [--repeats 3]
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

LAYOUTS = {  # name -> (hp, cp, inner ring)
    "ring cp=4": (1, 4, None),
    "2D hp=2 x cp=2": (2, 2, None),
    "Ulysses hp=4": (4, 1, None),
    "double ring cp=4, w=2": (1, 4, 2),
}


def _mesh(hp: int, cp: int):
    from torch.distributed.device_mesh import init_device_mesh
    dims = [(n, s) for n, s in (("cp", cp), ("hp", hp)) if s > 1]
    return init_device_mesh("cpu", tuple(s for _, s in dims), mesh_dim_names=tuple(n for n, _ in dims))


def worker(T: int, repeats: int):
    import torch.distributed as dist

    import longshield_fx as lf
    from longshield_fx.models import Llama

    dist.init_process_group("gloo")
    engines = {}
    for name, (hp, cp, inner) in LAYOUTS.items():
        torch.manual_seed(0)
        model = lf.CausalLMLoss(Llama.from_name("small"))
        engines[name] = lf.compile(model, _mesh(hp, cp), config=lf.DPConfig(1.0, 0.0), inner_ring=inner)
    ids = torch.randint(0, 256, (1, T), generator=torch.Generator().manual_seed(0))
    logical = lf.data.LogicalBatch(size=1, indices=torch.arange(1), physical=[], sample_rate=1.0, expected_size=1.0)
    times = {name: [] for name in LAYOUTS}
    grads = {}
    for step in range(repeats + 1):
        for name, engine in engines.items():
            dist.barrier()
            start = time.perf_counter()
            engine.accumulate(ids, ids)
            engine.finalize(logical)
            if step:  # the first step captures
                times[name].append(time.perf_counter() - start)
            grads[name] = torch.cat([p.grad.flatten() for p in engine.model.parameters()])
    reference = grads["ring cp=4"]
    agree = {name: float((g - reference).abs().max()) for name, g in grads.items()}
    if dist.get_rank() == 0:
        print(json.dumps({"median": {n: statistics.median(t) for n, t in times.items()},
                          "bytes": {n: e.communication_bytes() for n, e in engines.items()},
                          "max_diff_vs_ring": agree}))
    dist.destroy_process_group()


def modelled(T: int) -> list[str]:
    from longshield_fx.models import CONFIGS
    from longshield_fx.tools.cost_model import HARDWARE, SequenceLayout, attention_time, search_attention

    small = CONFIGS["small"]
    cpu = HARDWARE["CPU-gloo"]
    lines = [f"Modelled on CPU-gloo, reference Llama small, one attention layer, T={T}, B=1, fp32:", "",
             "| layout | attention + hops (ms) | all-to-all (ms) | total (ms) |", "|---|---|---|---|"]
    for name, (hp, cp, inner) in LAYOUTS.items():
        c = attention_time(cpu, SequenceLayout(hp, cp, inner or 0), batch=1, seq_len=T, heads=small.n_heads,
                           kv_heads=small.n_kv_heads, head_dim=small.dim // small.n_heads, elem_bytes=4)
        lines.append(f"| {name} | {c.ring * 1e3:.1f} | {c.all_to_all * 1e3:.1f} | {c.total * 1e3:.1f} |")
    big = CONFIGS["llama3.1-8b"]
    lines += ["", "Modelled, one Llama-3.1-8B attention layer (fwd + bwd), B=1, bf16: the five fastest layouts "
              "`search_attention` finds, and the plain ring:", "",
              "| cluster | T | layout | compute (ms) | ring incl. hops (ms) | all-to-all (ms) | total (ms) |",
              "|---|---|---|---|---|---|---|"]
    for hw_name, gpus in (("H100-NVLink", 4), ("2x4-H100-IB", 8)):
        for T_big in (8192, 32768):
            costs = search_attention(HARDWARE[hw_name], gpus, batch=1, seq_len=T_big, heads=big.n_heads,
                                     kv_heads=big.n_kv_heads, head_dim=big.dim // big.n_heads)
            ring = next(c for c in costs if c.layout.hp == 1 and c.layout.w == gpus)
            for c in costs[:5] + ([ring] if ring not in costs[:5] else []):
                lines.append(f"| {gpus} x {hw_name} | {T_big // 1024}k | {c.layout.label()} | {c.compute * 1e3:.2f} | "
                             f"{c.ring * 1e3:.2f} | {c.all_to_all * 1e3:.2f} | {c.total * 1e3:.2f} |")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", action="store_true")
    args = parser.parse_args()
    if args.worker:
        return worker(args.seq_len, args.repeats)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", __file__,
           "--worker", "--seq-len", str(args.seq_len), "--repeats", str(args.repeats)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        print("measured run failed:", proc.stderr[-3000:])
        return 1
    r = json.loads(lines[-1])
    base = r["median"]["ring cp=4"]
    print(f"Measured, 4 gloo ranks on this 2-core CPU, reference Llama small, T={args.seq_len}, B=1, one DP step, "
          f"median of {args.repeats} alternating steps (load average {os.getloadavg()[0]:.1f}):\n")
    print("| layout | step (s) | vs ring | all-to-all (MiB) | ring hops (MiB) | max |grad - ring's| |")
    print("|---|---|---|---|---|---|")
    for name in LAYOUTS:
        t, b = r["median"][name], r["bytes"][name]
        print(f"| {name} | {t:.2f} | {t / base:.2f}x | {b['all_to_all'] / 2**20:.1f} | "
              f"{b['ring_attention'] / 2**20:.1f} | {r['max_diff_vs_ring'][name]:.1e} |")
    print()
    print("\n".join(modelled(args.seq_len)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
