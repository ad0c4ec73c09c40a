"""Worker for the multi-process tests: ONE torchrun launch per world size runs every
distributed check of that size and writes what it measured; the tests compare (the
``distributed`` fixture of tests/conftest.py launches it, once per session per size):

    python -m torch.distributed.run --standalone --nproc-per-node=N cp_worker.py OUT_DIR

- world 4: the ring attention op on gloo (cp=4 on the world group, then cp=2 on two
  strided groups, i.e. dp=2), against full causal attention; then the engine cases of
  ``oracles.CP_CASES`` with world size 4 (cp=4, dp=2 x cp=2, 2D attention hp x cp, dp=2 x hp=2).
  Then a DCP checkpoint of a ZeRO-3 run (``dcp_save``), which the test resumes on 2 ranks
  (``cp_worker.py OUT_DIR --resume=PATH``, its own launch).
- world 2: the engine cases with world size 2 (cp=2: plain, block / selective
  checkpointing, output-stationary); the model's per-rank random stream (dropout); then a
  dead peer (rank 1 exits, rank 0 must get a clear error, not a hang).

Each rank writes OUT_DIR/rank{r}.pt after every check: {check name: results}. An engine
case records, on the same batches the single-process oracle gets in the test process:
full per-sample gradients, the clipped (noise-free) gradient after ``finalize``, the same
without the overlap pass, a noisy gradient (fixed insecure seed, so the oracle can draw
the same noise), the loss, the communication bytes, and the parameters after
``CP_STEPS`` SGD steps on the clipped sums.
"""
import datetime
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
import longshield_fx as lf  # noqa: E402
from longshield_fx.ops import ring_attention as ra  # noqa: E402
from oracles import (CP_CASES, CP_CLIP, CP_LR, CP_NOISE_E, CP_NOISE_SEED, CP_STEPS, attention_inputs,  # noqa: E402
                     case_batches, case_model, causal_attention, logical, tiny_llama)


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank (a sharded DTensor is gathered)."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def grads(model) -> dict:
    return {n: full(p.grad) for n, p in model.named_parameters()}


def local_shards(model, attr: str) -> dict:
    """This rank's shard of each parameter (``attr`` "data") or gradient ("grad")."""
    return {n: getattr(p, attr).to_local().detach().clone() for n, p in model.named_parameters()}


def case_mesh(world: int, dp: int, hp: int):
    """("dp", "cp", "hp") with the dims of size 1 left out (but one of "cp" / "hp" kept)."""
    cp = world // (dp * hp)
    dims = [(n, s) for n, s in (("dp", dp), ("cp", cp), ("hp", hp)) if s > 1 or (n == "cp" and hp == 1)]
    return init_device_mesh("cpu", tuple(s for _, s in dims), mesh_dim_names=tuple(n for n, _ in dims))


def engine_case(case) -> dict:
    kind, world, dp, policy, comm, hp = case.kind, case.world, case.dp, case.policy, case.comm, case.hp
    mesh = case_mesh(world, dp, hp)
    dp_rank = mesh["dp"].get_local_rank() if dp > 1 else 0
    batches = case_batches(kind, dp)
    mine = batches[dp_rank]
    clean = lf.DPConfig(max_grad_norm=CP_CLIP, noise_multiplier=0.0, per_sample_comm=comm)
    model = case_model(kind)
    out = {}

    kwargs = dict(checkpoint=policy, inner_ring=case.inner_ring, fsdp=case.fsdp)
    engine = lf.compile(model, mesh, config=clean, **kwargs)
    if case.fsdp:
        out["sharded"] = {n: (isinstance(p, DTensor), tuple(p.to_local().shape) if isinstance(p, DTensor) else None,
                              tuple(p.shape)) for n, p in model.named_parameters()}
    out["per_sample"] = engine.per_sample_grads(batches[0], batches[0])  # full, on every rank
    out["loss"] = float(engine.accumulate(mine, mine))  # summed over cp: this replica's batch
    engine.finalize(logical(2 * dp))  # E[B] = 1: .grad is the clipped sum over every replica
    out["clipped"] = grads(model)
    if case.fsdp:
        out["clipped_local"] = local_shards(model, "grad")
    out["clipped_something"] = bool((engine.last_norms > CP_CLIP).any())
    out["bytes"] = engine.communication_bytes()
    lowered = engine.lower(mine, mine)
    out["passes"] = lowered.passes
    out["chunked_loss"] = any(n.target is torch.ops.longshield.lm_head_loss.default for n in lowered.gm.graph.nodes)

    # The overlap pass only reorders: without it the clipped gradient must be bit-identical.
    no_overlap = lf.compile(model, mesh, config=clean, disable_passes=("overlap",), **kwargs)
    no_overlap.accumulate(mine, mine)
    no_overlap.finalize(logical(2 * dp))
    out["clipped_no_overlap"] = grads(model)
    out["passes_no_overlap"] = no_overlap.lower(mine, mine).passes

    # Noise with a fixed key: the oracle adds the same draw once; here it must be added once
    # per coordinate too (not once per rank, shard or replica), divided by E[B].
    noisy = lf.DPConfig(max_grad_norm=CP_CLIP, noise_multiplier=1.0, insecure_seed=CP_NOISE_SEED, per_sample_comm=comm)
    noisy_engine = lf.compile(model, mesh, config=noisy, **kwargs)
    noisy_engine.accumulate(mine, mine)
    noisy_engine.finalize(logical(2 * dp, CP_NOISE_E))
    out["noisy"] = grads(model)
    if case.fsdp:
        out["noisy_local"] = local_shards(model, "grad")

    # Training: SGD steps on the clipped sums (the first engine's graph, no recapture).
    optimizer = torch.optim.SGD(model.parameters(), lr=CP_LR)
    for _ in range(CP_STEPS):
        optimizer.zero_grad()
        engine.accumulate(mine, mine)
        engine.finalize(logical(2 * dp))
        optimizer.step()
    out["trained"] = {n: full(p) for n, p in model.named_parameters()}
    if case.fsdp:
        out["trained_local"] = local_shards(model, "data")
        out["fsdp_index"] = engine.sharding.index
    out["captures"] = engine.captures
    return out


DCP_OPTIMIZER = dict(lr=0.01, eps=1e-2)  # AdamW; a large eps keeps the update continuous in tiny gradients


def _dcp_step(engine, optimizer, batches) -> None:
    optimizer.zero_grad()
    for b in batches:
        engine.accumulate(b, b)
    engine.finalize(logical(4))
    optimizer.step()


def dcp_save(out_dir: str) -> dict:
    """4 ranks, dp=2 x cp=2, ZeRO-3, AdamW: one step, a DCP checkpoint, a second step."""
    mesh = case_mesh(4, 2, 1)
    batches = case_batches("llama", 2)
    mine = [batches[mesh["dp"].get_local_rank()]]
    model = case_model("llama")
    engine = lf.compile(model, mesh, config=lf.DPConfig(CP_CLIP, 0.0), fsdp=("dp", "cp"))
    optimizer = torch.optim.AdamW(model.parameters(), **DCP_OPTIMIZER)
    _dcp_step(engine, optimizer, mine)
    path = os.path.join(out_dir, "dcp")
    lf.save_checkpoint(path, engine, optimizer)
    _dcp_step(engine, optimizer, mine)
    return {"path": path, "after": {n: full(p) for n, p in model.named_parameters()}}


def dcp_resume(path: str) -> dict:
    """2 ranks, cp=2, ZeRO-3 over both: load the 4-rank checkpoint, take the second step on
    both replicas' batches (one replica now)."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    model = case_model("llama")
    engine = lf.compile(model, mesh, config=lf.DPConfig(CP_CLIP, 0.0), fsdp=("cp",))
    optimizer = torch.optim.AdamW(model.parameters(), **DCP_OPTIMIZER)
    lf.load_checkpoint(path, engine, optimizer)
    steps = engine.accountant.steps
    _dcp_step(engine, optimizer, case_batches("llama", 2))
    return {"after": {n: full(p) for n, p in model.named_parameters()}, "steps_loaded": steps}


def ring_case(world: int, cp: int, hkv: int, inner: int = 0) -> dict:
    """Ring attention over cp ranks (a double ring with inner rings of ``inner``). cp groups are
    strided ({0, 2}, {1, 3} for world 4, cp 2) so that global and group ranks differ; each
    group (dp replica) gets its own data.
    Returns, per tensor, None or assert_close's message, and the block counts of each rank."""
    rank = dist.get_rank()
    n_rep = world // cp
    groups = [dist.new_group(list(range(d, world, n_rep))) for d in range(n_rep)]
    dp = rank % n_rep
    group = groups[dp]
    cp_rank = dist.get_rank(group)
    assert cp_rank == rank // n_rep

    q, k, v, grad = attention_inputs(100 * cp + dp, HKV=hkv)
    B, HQ, T, D = q.shape
    HKV = k.shape[1]
    ref_out, ref_lse, ref_grads = causal_attention(q, k, v, grad)
    local = [ra.shard_sequence(t, cp, cp_rank, dim=2) for t in (q, k, v, grad)]
    ql, kl, vl = (t.clone().requires_grad_() for t in local[:3])
    out, lse = torch.ops.longshield.ring_attention(ql, kl, vl, D**-0.5, group.group_name, cp, inner)
    dq, dk, dv = torch.autograd.grad(out, (ql, kl, vl), local[3])
    result = {"shapes": [tuple(out.shape), tuple(lse.shape), tuple(dk.shape), tuple(dv.shape)],
              "expected_shapes": [(B, HQ, T // cp, D), (B, HQ, T // cp), (B, HKV, T // cp, D), (B, HKV, T // cp, D)]}

    def gathered(x):
        parts = [torch.empty_like(x) for _ in range(cp)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return ra.unshard_sequence(parts, cp, dim=2)  # (B, H, L[, D]): sequence is dim 2

    for name, got, want in [("out", out, ref_out), ("lse", lse, ref_lse),
                            ("dq", dq, ref_grads[0]), ("dk", dk, ref_grads[1]), ("dv", dv, ref_grads[2])]:
        try:
            torch.testing.assert_close(gathered(got), want, atol=1e-5, rtol=1e-5)
            result[name] = None
        except AssertionError as e:
            result[name] = f"cp={cp} {name}: {e}"
    counts = [None] * cp
    dist.all_gather_object(counts, dict(ra.last_block_counts), group=group)
    result["counts"] = counts
    result["expected_blocks"] = ra.blocks_per_rank(cp)[cp_rank]
    return result


def model_rng() -> dict:
    """The model's random ops under the mesh: ranks seeded alike draw differently inside
    ``model_rng`` (each rank's tokens get their own dropout masks) and stay in step after it."""
    from longshield_fx.runtime.parallel import Parallel
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    parallel = Parallel(mesh, mesh["cp"].get_group())
    torch.manual_seed(0)
    with parallel.model_rng():
        inside = torch.rand(64)
    return {"inside": inside, "after": torch.rand(4)}


def dead_peer() -> dict:
    """Rank 1 exits after compile; rank 0 must get a clear error within the group's timeout."""
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=5))
    mesh = DeviceMesh.from_group(group, "cpu", mesh_dim_names=("cp",))
    engine = lf.compile(tiny_llama(), mesh, config=lf.DPConfig(1.0, 0.0))
    if dist.get_rank() == 1:
        os._exit(0)
    ids = torch.zeros(2, 16, dtype=torch.long)
    start = time.time()
    try:
        engine.accumulate(ids, ids)
    except RuntimeError as e:
        return {"error": str(e)[:300], "seconds": time.time() - start}
    return {"error": None}


def main():
    out_path = os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.pt")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    world = dist.get_world_size()
    results = {}

    def record(name, fn, *args):
        start = time.time()
        try:
            results[name] = fn(*args)
        except Exception:
            results[name] = {"error": traceback.format_exc()}
            torch.save(results, out_path)
            raise  # the ranks would fall out of step: stop the launch (the tests show the error)
        results[name]["_seconds"] = time.time() - start
        torch.save(results, out_path)

    if world == 4:
        for cp in (4, 2):
            for hkv in (2, 1):  # one KV head: dk and dv must still be separate buffers
                record(f"ring-cp{cp}-hkv{hkv}", ring_case, world, cp, hkv)
        for inner in (2, 1):  # two inner rings of 2; four of 1 (the outer ring does every hop)
            record(f"ring-cp4-w{inner}", ring_case, world, 4, 2, inner)
    resume = [a.split("=", 1)[1] for a in sys.argv[2:] if a.startswith("--resume=")]
    if resume:  # ``cp_worker.py OUT_DIR --resume=PATH``: only the resumed run
        record("dcp_resume", dcp_resume, resume[0])
        dist.barrier()
        # Interpreter teardown after DCP's load sometimes aborts in a C++ destructor ("terminate
        # called without an active exception", seen once in CI); the results are on disk.
        os._exit(0)
    only = set(sys.argv[2:])  # by hand: ``cp_worker.py OUT_DIR NAME ...`` runs just those engine cases
    for name, case in CP_CASES.items():
        if case.world == world and (not only or name in only):
            record(name, engine_case, case)
    if world == 4 and not only:
        record("dcp_save", dcp_save, sys.argv[1])
    if world == 2:
        record("model_rng", model_rng)
        record("dead_peer", dead_peer)
        os._exit(0)  # the default group has a dead peer: do not wait for it at teardown
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
