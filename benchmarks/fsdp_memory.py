"""Sharded model states: per-rank memory of a DP step, unsharded vs ZeRO-3 vs hybrid, beside
FSDP2's ``fully_shard`` without DP.

A model where states dominate: the reference Llama with 8 layers, dim 512, 8 heads (4 K/V),
ffn 1536, vocab 32000 (58M parameters), fp32, B=1, T=256. Each configuration runs in its
own torchrun launch of 4 gloo ranks (fresh processes), three training steps (DP:
accumulate, finalize, AdamW step; FSDP2: forward, backward, AdamW step), and each rank reports:

- model-state bytes it holds: parameters, the clipped-sum accumulator (DP; measured between
  accumulate and finalize) and AdamW's exp_avg / exp_avg_sq, counted from the local tensors;
- its step peak: the highest resident set size during the steps minus the resident set
  after imports, before the model was built (so the interpreter and torch's own ~0.3 GB
  are left out), sampled every 0.2 ms with small malloc thresholds so RSS follows live memory.

Layouts (4 ranks): DP engine on dp=2 x cp=2, with ``fsdp=None`` (every rank holds every
state), ``("dp", "cp")`` (ZeRO-3 over all 4) and ``("cp",)`` (hybrid: 2 shards, replicated
over dp); FSDP2 over 4 data-parallel ranks, each with its own T=256 sequence.

    python benchmarks/fsdp_memory.py
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import torch

LAYOUTS = {
    "DP engine, unsharded": None,
    "DP engine, ZeRO-3 fsdp=(dp, cp)": ("dp", "cp"),
    "DP engine, hybrid fsdp=(cp,)": ("cp",),
    "FSDP2 fully_shard, no DP": "fsdp2",
}
MODEL = dict(vocab_size=32000, dim=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=1536, max_seq_len=256)
T, STEPS = 256, 3


def _local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def worker(layout_name: str, out: str):
    from _measure import PeakRSS, rss_bytes  # noqa: F401
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import longshield_fx as lf
    from longshield_fx.models import Llama
    from longshield_fx.models.llama import LlamaConfig

    layout = LAYOUTS[layout_name]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    baseline = rss_bytes()
    torch.manual_seed(0)
    model = lf.CausalLMLoss(Llama(LlamaConfig(**MODEL)))
    ids = torch.randint(0, MODEL["vocab_size"], (1, T), generator=torch.Generator().manual_seed(rank))
    states = {}
    if layout == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        for block in model.lm.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step():
            optimizer.zero_grad()
            model(ids, ids).sum().backward()
            optimizer.step()
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
        engine = lf.compile(model, mesh, config=lf.DPConfig(1.0, 1.0), fsdp=layout)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        logical = lf.data.LogicalBatch(size=2, indices=torch.arange(2), physical=[], sample_rate=1.0,
                                       expected_size=2.0)

        def step():
            optimizer.zero_grad()
            engine.accumulate(ids, ids)
            states["accumulator"] = _local_bytes(engine._accum.values())
            engine.finalize(logical)
            optimizer.step()

    step()  # capture (DP) and AdamW's states; the peak below is of the steady steps
    dist.barrier()
    with PeakRSS() as peak:
        for _ in range(STEPS - 1):
            step()
    states["params"] = _local_bytes(model.parameters())
    states["adamw"] = _local_bytes(t for s in optimizer.state.values() for t in s.values()
                                   if isinstance(t, torch.Tensor) and t.dim() > 0)
    result = {"states": states, "step_peak": peak.peak - baseline,
              "params_total": sum(p.numel() for p in model.parameters())}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def launch(layout_name: str) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536", PYTHONWARNINGS="ignore",
                   PYTHONPATH=os.path.dirname(os.path.abspath(__file__)))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
               os.path.abspath(__file__), "--worker", layout_name, out]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"{layout_name}: launch failed:\n{proc.stderr[-3000:]}")
        return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(4)]


def main():
    MiB = 2 ** 20
    rows = {}
    for name in LAYOUTS:
        start = time.time()
        rows[name] = launch(name)
        print(f"{name}: {time.time() - start:.0f} s", file=sys.stderr)
    params = rows["DP engine, unsharded"][0]["params_total"]
    ref_states = max(sum(r["states"].values()) for r in rows["DP engine, unsharded"])
    ref_peak = max(r["step_peak"] for r in rows["DP engine, unsharded"])
    one_process = 4 * params * 4  # fp32 parameters, accumulator, AdamW m and v: everything on one rank
    print(f"Per-rank memory, 4 gloo ranks, reference Llama {params / 1e6:.0f}M parameters (8 layers, dim 512, "
          f"vocab 32000), fp32, B=1, T={T}; the worst rank of each launch. One process would hold "
          f"{one_process / MiB:.0f} MiB of model states (4 x 4 bytes / parameter).\n")
    print("| layout | params | accumulator | AdamW m+v | model states | / one process | / unsharded engine | "
          "step peak | peak / unsharded engine |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, ranks in rows.items():
        worst = max(ranks, key=lambda r: sum(r["states"].values()))
        s = worst["states"]
        total = sum(s.values())
        peak = max(r["step_peak"] for r in ranks)
        acc = f"{s['accumulator'] / MiB:.0f} MiB" if "accumulator" in s else "-"
        print(f"| {name} | {s['params'] / MiB:.0f} MiB | {acc} | {s['adamw'] / MiB:.0f} MiB | {total / MiB:.0f} MiB | "
              f"{total / one_process:.3f} | {total / ref_states:.3f} | {peak / MiB:.0f} MiB | {peak / ref_peak:.2f} |")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3])
    else:
        main()
