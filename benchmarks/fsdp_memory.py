"""Sharded model states: per-rank memory of a DP step, one process vs unsharded vs ZeRO-3 (with
and without resharding after the forward) vs hybrid, beside FSDP2's ``fully_shard`` without DP.

A model where states dominate: the reference Llama with 8 layers, dim 512, 8 heads (4 K/V),
ffn 1536, vocab 32000 (58M parameters), fp32, B=1, T=256. Each configuration runs in its
own torchrun launch (fresh processes), RUNS times; each launch takes three training steps
(DP: accumulate, finalize, AdamW step; FSDP2: forward, backward, AdamW step), and each rank
reports:

- model-state bytes it holds: parameters, the clipped-sum accumulator (DP; measured between
  accumulate and finalize) and AdamW's exp_avg / exp_avg_sq, counted from the local tensors;
- its step peak: the highest resident set size during the last two steps minus the resident
  set after imports, before the model was built (so the interpreter and torch's own ~0.3 GB
  are left out), sampled every 0.2 ms with small malloc thresholds so RSS follows live memory.

A launch's peak is its worst rank's; the table shows the median of the RUNS launches and
their spread (max - min). Model states do not vary between launches (the first is shown).

Layouts: the DP engine in one process (no mesh: the "single process" every ratio of model
states is taken against, measured); on 4 ranks dp=2 x cp=2 with ``fsdp=None`` (every rank
holds every state), ``("dp", "cp")`` (ZeRO-3 over all 4; also with
``reshard_after_forward=False``) and ``("cp",)`` (hybrid: 2 shards, replicated over dp);
FSDP2 over 4 data-parallel ranks, each with its own T=256 sequence. Also printed: the
gathered working set, one block's parameters in the compute dtype (fp32 here), and the
largest single gathered parameter (the embedding and the LM head).

    python benchmarks/fsdp_memory.py
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ONE_PROCESS = "DP engine, 1 process, unsharded"
UNSHARDED = "DP engine, unsharded"
LAYOUTS = {  # name -> (ranks, compile's fsdp or "fsdp2", reshard_after_forward)
    ONE_PROCESS: (1, None, True),
    UNSHARDED: (4, None, True),
    "DP engine, ZeRO-3 fsdp=(dp, cp)": (4, ("dp", "cp"), True),
    "DP engine, ZeRO-3 fsdp=(dp, cp), reshard_after_forward=False": (4, ("dp", "cp"), False),
    "DP engine, hybrid fsdp=(cp,)": (4, ("cp",), True),
    "FSDP2 fully_shard, no DP": (4, "fsdp2", True),
}
MODEL = dict(vocab_size=32000, dim=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=1536, max_seq_len=256)
T, STEPS, RUNS = 256, 3, 3


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

    ranks, layout, reshard_after_forward = LAYOUTS[layout_name]
    from longshield_fx._torch import serial_gloo

    dist.init_process_group(serial_gloo())  # gloo, one worker thread: _torch.serial_gloo
    rank = dist.get_rank()
    baseline = rss_bytes()
    torch.manual_seed(0)
    model = lf.CausalLMLoss(Llama(LlamaConfig(**MODEL)))
    one_block = sum(p.numel() * p.element_size() for p in model.lm.layers[0].parameters())
    largest = max(p.numel() * p.element_size() for p in model.parameters())
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
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp")) if ranks > 1 else None
        engine = lf.compile(model, mesh, config=lf.DPConfig(1.0, 1.0), fsdp=layout,
                            reshard_after_forward=reshard_after_forward)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        samples = 2 if ranks > 1 else 1  # one sample per dp replica
        logical = lf.data.LogicalBatch(size=samples, indices=torch.arange(samples), physical=[], sample_rate=1.0,
                                       expected_size=float(samples))

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
    result = {"states": states, "step_peak": peak.peak - baseline, "one_block": one_block, "largest": largest,
              "params_total": sum(p.numel() for p in model.parameters())}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def launch(layout_name: str) -> list[dict]:
    ranks = LAYOUTS[layout_name][0]
    with tempfile.TemporaryDirectory() as out:
        here = os.path.dirname(os.path.abspath(__file__))  # _measure; and the library of this checkout
        env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536", PYTHONWARNINGS="ignore",
                   PYTHONPATH=os.pathsep.join([here, os.path.dirname(here)]))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               os.path.abspath(__file__), "--worker", layout_name, out]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"{layout_name}: launch failed:\n{proc.stderr[-3000:]}")
        return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(ranks)]


def main():
    MiB = 2 ** 20
    began = time.time()
    launches = {name: [] for name in LAYOUTS}
    for run in range(RUNS):  # round robin: a slow spell of the shared machine hits every layout
        for name in LAYOUTS:
            start = time.time()
            launches[name].append(launch(name))
            print(f"run {run + 1}/{RUNS} {name}: {time.time() - start:.0f} s", file=sys.stderr)
    first = launches[ONE_PROCESS][0][0]
    params, one_block, largest = first["params_total"], first["one_block"], first["largest"]
    one_process = sum(first["states"].values())
    peaks = {name: [max(r["step_peak"] for r in ranks) for ranks in runs] for name, runs in launches.items()}
    ref_peak = statistics.median(peaks[UNSHARDED])
    zero3 = max(sum(r["states"].values()) for r in launches["DP engine, ZeRO-3 fsdp=(dp, cp)"][0])
    print(f"Per-rank memory, reference Llama {params / 1e6:.0f}M parameters (8 layers, dim 512, vocab 32000), "
          f"fp32, B=1, T={T}, gloo; model states of the worst rank; step peak: the worst rank's, median of {RUNS} "
          f"launches (fresh processes) and their spread. One process holds {one_process / MiB:.0f} MiB of model "
          f"states (measured); a quarter of it is {one_process / 4 / MiB:.0f} MiB, and ZeRO-3's ranks hold "
          f"{zero3 / MiB:.0f} MiB ({(zero3 - one_process / 4) / MiB:+.1f} MiB). Gathered working set (compute "
          f"dtype fp32): one block's parameters {one_block / MiB:.1f} MiB; the largest single parameter "
          f"(embedding, LM head) {largest / MiB:.1f} MiB. Total {(time.time() - began) / 60:.0f} min.\n")
    print("| layout | ranks | params | accumulator | AdamW m+v | model states | / one process | "
          "step peak (median) | spread | peak / unsharded engine |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, runs in launches.items():
        worst = max(runs[0], key=lambda r: sum(r["states"].values()))
        s = worst["states"]
        total = sum(s.values())
        peak = statistics.median(peaks[name])
        acc = f"{s['accumulator'] / MiB:.0f} MiB" if "accumulator" in s else "-"
        print(f"| {name} | {LAYOUTS[name][0]} | {s['params'] / MiB:.0f} MiB | {acc} | {s['adamw'] / MiB:.0f} MiB | "
              f"{total / MiB:.0f} MiB | {total / one_process:.3f} | {peak / MiB:.0f} MiB | "
              f"{(max(peaks[name]) - min(peaks[name])) / MiB:.0f} MiB | {peak / ref_peak:.3f} |")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3])
    else:
        main()
