"""Worker for multi-process tests, run under torchrun by tests/runtime/test_parallel.py.

Each rank compares the context-parallel engine against a single-process engine built from
the same seed (the oracle), on the same batches; prints one JSON line on rank 0.
"""
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
import longshield_fx as lf  # noqa: E402
from oracles import hf_llama, logical, tiny_llama  # noqa: E402


def build(kind):
    return {"llama": lambda: tiny_llama(seed=0), "hf_llama": lambda: hf_llama(seed=0)}[kind]()


def main():
    cp, dp, kind, T = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    policy = sys.argv[5] if len(sys.argv) > 5 and sys.argv[5] != "none" else None  # checkpointing of the cp engine
    comm = sys.argv[6] if len(sys.argv) > 6 else "input_stationary"
    if kind == "dead_peer":
        return dead_peer(cp)
    dist.init_process_group("gloo")
    if dp > 1:
        mesh = init_device_mesh("cpu", (dp, cp), mesh_dim_names=("dp", "cp"))
    else:
        mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    vocab = 128 if kind == "hf_llama" else 256
    batches = [torch.randint(0, vocab, (2, T), generator=torch.Generator().manual_seed(s)) for s in range(dp)]
    cfg = lf.DPConfig(max_grad_norm=0.05, noise_multiplier=0.0, per_sample_comm=comm)
    single_model, cp_model = build(kind), build(kind)
    single = lf.compile(single_model, config=cfg)
    parallel = lf.compile(cp_model, mesh, config=cfg, checkpoint=policy)

    ids = batches[0]
    ref = single.per_sample_grads(ids, ids)
    ours = parallel.per_sample_grads(ids, ids)
    worst_ps = max(float((ours[n] - ref[n]).abs().max()) for n in ref)
    vs_plain_cp = 0.0
    if policy is not None:  # checkpointed vs plain, both context parallel
        plain_cp = lf.compile(build(kind), mesh, config=cfg).per_sample_grads(ids, ids)
        vs_plain_cp = max(float((ours[n] - plain_cp[n]).abs().max()) for n in ref)

    for b in batches:
        single.accumulate(b, b)
    single.finalize(logical(2 * dp))
    dp_rank = mesh["dp"].get_local_rank() if dp > 1 else 0
    loss = parallel.accumulate(batches[dp_rank], batches[dp_rank])
    parallel.finalize(logical(2 * dp))
    worst_clip = max(float((p.grad - q.grad).abs().max())
                     for p, q in zip(single_model.parameters(), cp_model.parameters()))
    # The overlap pass only reorders: clipped gradients must be bit-identical without it.
    no_overlap_model = build(kind)
    no_overlap = lf.compile(no_overlap_model, mesh, config=cfg, checkpoint=policy)
    no_overlap.parallel.overlap = False
    no_overlap.accumulate(batches[dp_rank], batches[dp_rank])
    no_overlap.finalize(logical(2 * dp))
    overlap_identical = all(torch.equal(p.grad, q.grad)
                            for p, q in zip(no_overlap_model.parameters(), cp_model.parameters()))
    clipped = bool((parallel.last_norms > cfg.max_grad_norm).any())
    ref_loss = single_model(batches[dp_rank], batches[dp_rank]).sum()
    # Noise: same key, σ > 0: the parallel engine must add exactly the single-process noise
    # (once per coordinate, not once per rank or per dp replica).
    noisy = lf.DPConfig(max_grad_norm=0.05, noise_multiplier=1.0, insecure_seed=7, per_sample_comm=comm)
    single = lf.compile(single_model, config=noisy)
    parallel = lf.compile(cp_model, mesh, config=noisy, checkpoint=policy)
    for b in batches:
        single.accumulate(b, b)
    single.finalize(logical(2 * dp, 4.0))
    parallel.accumulate(batches[dp_rank], batches[dp_rank])
    parallel.finalize(logical(2 * dp, 4.0))
    worst_noise = max(float((p.grad - q.grad).abs().max())
                      for p, q in zip(single_model.parameters(), cp_model.parameters()))
    result = {"overlap_identical": overlap_identical, "vs_plain_cp": vs_plain_cp, "noisy": worst_noise, "per_sample": worst_ps, "clipped_sum": worst_clip, "clipped_something": clipped,
              "loss": abs(float(loss) - float(ref_loss)), "bytes": parallel.communication_bytes(),
              "rank": dist.get_rank()}
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


def dead_peer(cp):
    """Rank 1 dies after compile; rank 0 must get a clear error within the PG timeout."""
    import datetime
    import time

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=5))
    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    engine = lf.compile(tiny_llama(), mesh, config=lf.DPConfig(1.0, 0.0))
    if dist.get_rank() == 1:
        os._exit(0)
    ids = torch.zeros(2, 16, dtype=torch.long)
    start = time.time()
    try:
        engine.accumulate(ids, ids)
    except RuntimeError as e:
        print("RESULT " + json.dumps({"error": str(e)[:300], "seconds": time.time() - start}), flush=True)
        os._exit(0)
    print("RESULT " + json.dumps({"error": None}), flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
