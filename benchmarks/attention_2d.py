"""2D attention (hp x cp) and double-ring attention: measured on 4 gloo ranks, and modelled.

1. Measured: the reference Llama "small" (4 layers, dim 256, 8 heads, 2 K/V heads) under
   torchrun, 4 gloo ranks on this CPU, T=8192, B=1, one DP step (accumulate + finalize) per
   layout: (hp, cp) = (1, 4), (2, 2), (4, 1) and the double ring cp=4, w=2. Each rank builds
   every engine and the layouts alternate step by step, so drift hits all alike; medians.
2. Modelled (``longshield_fx.tools.cost_model.attention_time``, LoongTrain section 4.5), one
   attention layer, forward + backward, per rank:
   - the benchmark's four layouts on this CPU ("CPU-gloo", fp32), to compare the model's
     ordering with the measurement;
   - the same four layouts on 4 x H100 over NVLink, and their 8-GPU counterparts (ring cp=8,
     hp=2 x cp=4, hp=4 x cp=2, Ulysses hp=8, double ring cp=8 w=4) on 2 nodes x 4 H100 over
     InfiniBand, head-first as the benchmark's mesh ("cp", "hp") places them, bf16, for the
     benchmark's model at its T and for Llama-3.1-8B (H=32, Hkv=8, head dim 128) at 8k and 32k;
   - for Llama-3.1-8B, the fastest layouts ``search_attention`` finds among every (hp, cp, w,
     placement) on 4, 8 (2 nodes) and 32 (8 nodes) H100s, and the plain ring.

    python benchmarks/attention_2d.py [--seq-len 8192] [--repeats 3] [--predict-only]

``--predict-only`` prints the modelled part alone (no torchrun, seconds).
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

    from longshield_fx._torch import serial_gloo

    dist.init_process_group(serial_gloo())  # gloo, one worker thread: _torch.serial_gloo
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


# The benchmark's layouts as run on 4 ranks, and the same splits of 8 GPUs on 2 nodes x 4
# (name -> (hp, cp, inner ring)); Ulysses hp=4 has two counterparts: hp=4 x cp=2 and hp=8.
EIGHT_GPU_LAYOUTS = {
    "ring cp=4": [("ring cp=8", (1, 8, None))],
    "2D hp=2 x cp=2": [("2D hp=2 x cp=4", (2, 4, None))],
    "Ulysses hp=4": [("2D hp=4 x cp=2", (4, 2, None)), ("Ulysses hp=8", (8, 1, None))],
    "double ring cp=4, w=2": [("double ring cp=8, w=4", (1, 8, 4))],
}
CLUSTERS = (("4 x H100, NVLink", "H100-NVLink", 4), ("2 nodes x 4 H100, IB", "2x4-H100-IB", 8),
            ("8 nodes x 4 H100, IB", "8x4-H100-IB", 32))


def _shape(model: str) -> dict:
    from longshield_fx.models import CONFIGS

    cfg = CONFIGS[model]
    return dict(heads=cfg.n_heads, kv_heads=cfg.n_kv_heads, head_dim=cfg.dim // cfg.n_heads)


def _cost(hw_name: str, hp: int, cp: int, inner, model: str, T: int, elem_bytes: int = 2):
    from longshield_fx.tools.cost_model import HARDWARE, SequenceLayout, attention_time

    # head-first: the benchmark's mesh ("cp", "hp") puts an hp group on adjacent ranks
    return attention_time(HARDWARE[hw_name], SequenceLayout(hp, cp, inner or 0), batch=1, seq_len=T,
                          elem_bytes=elem_bytes, **_shape(model))


def _ms(cost) -> str:
    return f"{cost.total * 1e3:.3f} ({cost.all_to_all * 1e3:.3f})"


def modelled(T: int) -> list[str]:
    from longshield_fx.tools.cost_model import HARDWARE, search_attention
    from longshield_fx.tools.plan import tokens

    lines = [f"Modelled on CPU-gloo, reference Llama small, one attention layer, T={T}, B=1, fp32:", "",
             "| layout | attention + hops (ms) | all-to-all (ms) | total (ms) |", "|---|---|---|---|"]
    for name, (hp, cp, inner) in LAYOUTS.items():
        c = _cost("CPU-gloo", hp, cp, inner, "small", T, elem_bytes=4)
        lines.append(f"| {name} | {c.ring * 1e3:.1f} | {c.all_to_all * 1e3:.1f} | {c.total * 1e3:.1f} |")

    lines += ["", "Modelled on GPUs, the benchmark's layouts: one attention layer (fwd + bwd) per rank, B=1, bf16, "
              "head-first; ms per layer, all-to-all ms in brackets. 4 x H100 over NVLink runs the four layouts "
              "measured above; 2 nodes x 4 H100 over InfiniBand runs the same splits of 8 GPUs:", "",
              "| model | T | layout, 4 x H100 NVLink | ms (all-to-all) | layout, 2 nodes x 4 H100 IB | ms (all-to-all) |",
              "|---|---|---|---|---|---|"]
    for model, T_model in (("small", T), ("llama3.1-8b", 8192), ("llama3.1-8b", 32768)):
        for name, (hp, cp, inner) in LAYOUTS.items():
            four = _cost("H100-NVLink", hp, cp, inner, model, T_model)
            eight = [(name8, _cost("2x4-H100-IB", *layout, model, T_model)) for name8, layout in EIGHT_GPU_LAYOUTS[name]]
            lines.append(f"| {model} | {tokens(T_model)} | {name} | {_ms(four)} | "
                         f"{' / '.join(n for n, _ in eight)} | {' / '.join(_ms(c) for _, c in eight)} |")

    lines += ["", "Modelled, Llama-3.1-8B, one attention layer (fwd + bwd), B=1, bf16: the fastest of every "
              "(hp, cp, w, placement) `search_attention` ranks (ties: the simplest, and how many others tie), the "
              "fastest slower one, and the plain ring:", "",
              "| cluster | T | fastest layout (ms) | runner-up (ms) | plain ring (ms) |", "|---|---|---|---|---|"]
    for label, hw_name, gpus in CLUSTERS:
        for T_big in (8192, 32768):
            costs = search_attention(HARDWARE[hw_name], gpus, batch=1, seq_len=T_big, **_shape("llama3.1-8b"))
            ring = next(c for c in costs if c.layout.hp == 1 and c.layout.w == gpus)
            best = costs[0]
            ties = [c for c in costs[1:] if round(c.total, 12) == round(best.total, 12)]
            second = costs[1 + len(ties)]
            tied = f", {len(ties)} more tie" if ties else ""
            lines.append(f"| {label} | {tokens(T_big)} | {best.layout.label()} ({best.total * 1e3:.2f}{tied}) | "
                         f"{second.layout.label()} ({second.total * 1e3:.2f}) | {ring.total * 1e3:.2f} |")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--predict-only", action="store_true",
                        help="print the cost model's predictions only (no torchrun run)")
    parser.add_argument("--worker", action="store_true")
    args = parser.parse_args()
    if args.worker:
        return worker(args.seq_len, args.repeats)
    if args.predict_only:
        print("\n".join(modelled(args.seq_len)))
        return 0
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
