"""Worker for the multi-process tests: ONE torchrun launch per world size runs every
distributed check of that size and writes what it measured; the tests compare (the
``distributed`` fixture of tests/conftest.py launches it, once per session per size):

    python -m torch.distributed.run --standalone --nproc-per-node=N cp_worker.py OUT_DIR

- world 4: the ring attention op on gloo (cp=4 on the world group, then cp=2 on two
  strided groups, i.e. dp=2), against full causal attention; then the engine cases of
  ``oracles.CP_CASES`` with world size 4 (cp=4, dp=2 x cp=2, 2D attention hp x cp, dp=2 x hp=2).
  Then DCP checkpoints of a ZeRO-3 run and of a noisy one (``dcp_save``), which the test
  resumes on 2 ranks (``cp_worker.py OUT_DIR --resume=PATH,NOISY_PATH``, its own launch).
  Then packed documents (the reference Llama, ``packed_case``) at cp=4 with block checkpointing,
  and at dp=2 x cp=2 with ZeRO-3 over both.
- world 2: the engine cases with world size 2 (cp=2: plain, block / selective
  checkpointing, output-stationary); packed documents in Hugging Face Llama, Qwen2 and GPT-2
  at cp=2; the model's per-rank random stream, alone and in a
  train-mode GPT-2 with embedding dropout (``dropout``); then a dead peer (rank 1 exits,
  rank 0 must get a clear error, not a hang).

Each rank writes OUT_DIR/rank{r}/NNN.pt after every check: (check name, results), read back
by ``oracles.rank_results`` (one file per check: rewriting one file of every result so far
after each check wrote ~1 GB per rank). An engine
case records, on the same batches the single-process oracle gets in the test process:
full per-sample gradients, the clipped (noise-free) gradient after ``finalize``, the same
without the overlap pass, a noisy gradient (fixed insecure seed, so the oracle can draw
the same noise), the loss, the communication bytes, the groups the attention collectives
of its graph run over, the ring op's block counts, and the parameters after ``CP_STEPS``
SGD steps on the clipped sums (a ``light`` case: not the two middle ones).
"""
import datetime
import gc
import itertools
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
from longshield_fx._torch import destroy_process_groups, resolve_process_group, serial_gloo  # noqa: E402
from longshield_fx.cli.inspect import collective_bytes  # noqa: E402
from longshield_fx.passes._graph import is_head_all_to_all  # noqa: E402
from longshield_fx.ops import ring_attention as ra  # noqa: E402
from longshield_fx.ops import ring_schedule as schedule  # noqa: E402
from longshield_fx.runtime.noise import NoiseGenerator  # noqa: E402
from oracles import (CALIBRATION, CP_CASES, CP_CLIP, CP_LR, CP_NOISE_E, CP_NOISE_SEED, CP_STEPS,  # noqa: E402
                     DROPOUT_SEEDS, attention_inputs, case_batches, case_model, causal_attention, document_attention,
                     gpt2_embedding_dropout, logical, packed_segments, tiny_llama)
from oracles import (PACKED_C, PACKED_CFG, PACKED_ROWS, PACKED_T, PACKED_U, packed_model,  # noqa: E402
                     packed_units)
from longshield_fx.data import LogicalBatch  # noqa: E402
from longshield_fx.packing import empty_batch, pack_documents  # noqa: E402


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank (a sharded DTensor is gathered)."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def grads(model) -> dict:
    return {n: full(p.grad) for n, p in model.named_parameters()}


def local_shards(model, attr: str) -> dict:
    """This rank's shard of each parameter (``attr`` "data") or gradient ("grad")."""
    return {n: getattr(p, attr).to_local().detach().clone() for n, p in model.named_parameters()}


def attention_collectives(gm) -> dict:
    """What the lowered graph's attention communicates over: the ranks of every head
    all-to-all's group, and (group ranks, cp, inner) of every ring attention op."""
    ring_ops = (torch.ops.longshield.ring_attention.default, torch.ops.longshield.ring_attention_backward.default)

    def ranks(group_name):
        return tuple(dist.get_process_group_ranks(resolve_process_group(group_name))) if group_name else ()

    all_to_all = [ranks(n.args[3]) for n in gm.graph.nodes if is_head_all_to_all(n)]
    ring = [(ranks(n.args[-3]), n.args[-2], n.args[-1]) for n in gm.graph.nodes if n.target in ring_ops]
    return {"all_to_all": all_to_all, "ring": ring}


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
    if case.fsdp:
        kwargs["reshard_after_forward"] = case.reshard_after_forward
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
    out["attention_collectives"] = attention_collectives(lowered.gm)
    exchanges = [n for n in lowered.gm.graph.nodes  # scatter_clipped_sums' all-to-all of clipped-sum shards
                 if n.target == torch.ops._c10d_functional.all_to_all_single.default and not is_head_all_to_all(n)]
    out["shard_exchange_bytes"] = sum(collective_bytes(engine, n) for n in exchanges)

    if not case.light:
        # The overlap pass only reorders: without it the clipped gradient must be bit-identical.
        no_overlap = lf.compile(model, mesh, config=clean, disable_passes=("overlap",), **kwargs)
        no_overlap.accumulate(mine, mine)
        no_overlap.finalize(logical(2 * dp))
        out["clipped_no_overlap"] = grads(model)
        out["passes_no_overlap"] = no_overlap.lower(mine, mine).passes

        # Noise with a fixed key: the oracle adds the same draw once; here it must be added once
        # per coordinate too (not once per rank, shard or replica), divided by E[B].
        noisy = lf.DPConfig(max_grad_norm=CP_CLIP, noise_multiplier=1.0, insecure_seed=CP_NOISE_SEED,
                            per_sample_comm=comm)
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
    # What this rank's ring ops computed at their last calls (chunk pairs and kernel calls,
    # forward and backward): a ring of cp ranks, whatever hp is.
    out["ring_blocks"] = dict(ra.last_block_counts)
    out["trained"] = {n: full(p) for n, p in model.named_parameters()}
    if case.fsdp:
        out["trained_local"] = local_shards(model, "data")
        out["fsdp_index"] = engine.sharding.index
    out["captures"] = engine.captures
    return out


# AdamW. The clipped gradients are ~3e-5 per coordinate (median; C = 0.05 over ~1e5 of them),
# so for most coordinates sqrt(v) >> eps: the step is m/sqrt(v), which the saved optimizer
# state decides (a fresh optimizer steps by about lr*sign(g)); gradients below eps
# (roundoff-sized ones) still move continuously.
DCP_OPTIMIZER = dict(lr=0.01, eps=1e-6)
DCP_SECOND_BATCHES = 2  # case_batches' first seed of the step after the save (the first step's: 0)
DCP_NOISE = lf.DPConfig(CP_CLIP, 1.0)  # the noisy run: the engine's secret key, secure draws


def dcp_noisy_model():
    """The noisy run's model: the tiny Llama with one layer (only its noise is looked at; a
    smaller graph to capture)."""
    return tiny_llama(n_layers=1)


def _dcp_step(engine, optimizer, batches) -> None:
    optimizer.zero_grad()
    for b in batches:
        engine.accumulate(b, b)
    engine.finalize(logical(2 * len(batches) * engine.parallel.dp))
    optimizer.step()


def _noise_step(engine, batch) -> None:
    """A step whose gradient is the noise alone: every row masked (the clipped sum is 0)."""
    engine.accumulate(batch, batch, mask=torch.zeros(batch.shape[0]))
    engine.finalize(logical(0))


def optimizer_state(model, optimizer) -> dict:
    """Parameter name -> its full AdamW state (exp_avg, exp_avg_sq, step), gathered."""
    return {n: {k: full(v) for k, v in optimizer.state[p].items()} for n, p in model.named_parameters()}


def dcp_save(out_dir: str) -> dict:
    """4 ranks, dp=2 x cp=2, ZeRO-3, AdamW: one step, a DCP checkpoint, a second step on other
    batches. Then a noisy run (sigma > 0, the engine's secret stream): one step whose gradient is
    the noise alone, saved too (``dcp_noisy``)."""
    mesh = case_mesh(4, 2, 1)
    dp_rank = mesh["dp"].get_local_rank()
    model = case_model("llama")
    engine = lf.compile(model, mesh, config=lf.DPConfig(CP_CLIP, 0.0), fsdp=("dp", "cp"))
    optimizer = torch.optim.AdamW(model.parameters(), **DCP_OPTIMIZER)
    _dcp_step(engine, optimizer, [case_batches("llama", 2)[dp_rank]])
    path = os.path.join(out_dir, "dcp")
    lf.save_checkpoint(path, engine, optimizer, run_dir=out_dir)
    saved_optimizer = optimizer_state(model, optimizer)
    _dcp_step(engine, optimizer, [case_batches("llama", 2, first_seed=DCP_SECOND_BATCHES)[dp_rank]])
    out = {"path": path, "optimizer_saved": saved_optimizer, "after": {n: full(p) for n, p in model.named_parameters()}}

    noisy_model = dcp_noisy_model()
    noisy = lf.compile(noisy_model, mesh, config=DCP_NOISE, fsdp=("dp", "cp"))
    _noise_step(noisy, case_batches("llama", 1)[0])
    out["noise_path"] = os.path.join(out_dir, "dcp_noisy")
    lf.save_checkpoint(out["noise_path"], noisy, torch.optim.SGD(noisy_model.parameters(), lr=CP_LR),
                       run_dir=out["noise_path"] + ".run")
    out["noise_local"] = local_shards(noisy_model, "grad")  # this shard's draws before the save
    out["noise_index"] = noisy.sharding.index
    out["noise_key"] = noisy._noise.stream.key  # not in the checkpoint: for the resume's control
    if dist.get_rank() == 0:
        torch.save(out["noise_key"], out["noise_path"] + ".key")
    return out


def dcp_resume(path: str, noise_path: str) -> dict:
    """2 ranks, cp=2, ZeRO-3 over both: load the 4-rank checkpoint; record the loaded AdamW
    state; take the second step (both replicas' batches, one replica now) once with a FRESH
    AdamW (the negative control: what a resume that lost the optimizer state would do), then,
    from the same loaded parameters, with the loaded one. Then the noisy run: load it and take
    one noise-only step (its key must be fresh, not the saved run's); and, as the control of that
    check, draw what the saved run's stream rewound to its first nonce would give this shard."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    model = case_model("llama")
    engine = lf.compile(model, mesh, config=lf.DPConfig(CP_CLIP, 0.0), fsdp=("cp",))
    optimizer = torch.optim.AdamW(model.parameters(), **DCP_OPTIMIZER)
    lf.load_checkpoint(path, engine, optimizer, run_dir=os.path.dirname(path))
    out = {"steps_loaded": engine.accountant.steps, "optimizer_loaded": optimizer_state(model, optimizer)}
    second = case_batches("llama", 2, first_seed=DCP_SECOND_BATCHES)
    loaded_params = {n: p.detach().clone() for n, p in model.named_parameters()}
    _dcp_step(engine, torch.optim.AdamW(model.parameters(), **DCP_OPTIMIZER), second)
    out["after_fresh_optimizer"] = {n: full(p) for n, p in model.named_parameters()}
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(loaded_params[n])
    _dcp_step(engine, optimizer, second)
    out["after"] = {n: full(p) for n, p in model.named_parameters()}

    noisy_model = dcp_noisy_model()
    noisy = lf.compile(noisy_model, mesh, config=DCP_NOISE, fsdp=("cp",))
    lf.load_checkpoint(noise_path, noisy, torch.optim.SGD(noisy_model.parameters(), lr=CP_LR),
                       run_dir=noise_path + ".run")
    saved_key = torch.load(noise_path + ".key")
    out["noise_key_is_fresh"] = noisy._noise.stream.key != saved_key and noisy._noise.stream.draws == 0
    _noise_step(noisy, case_batches("llama", 1)[0])
    out["noise_local"] = local_shards(noisy_model, "grad")
    out["noise_index"] = noisy.sharding.index
    rewound = NoiseGenerator("cpu", secure=DCP_NOISE.secure_rng, key=saved_key, stream=noisy.sharding.index)
    sigma_c = DCP_NOISE.noise_multiplier * DCP_NOISE.max_grad_norm
    out["noise_rewound"] = rewound.normal(sum(t.numel() for t in out["noise_local"].values()), sigma_c)
    return out


def ring_case(world: int, cp: int, hkv: int, inner: int = 0, packed: bool = False,
              dtype: torch.dtype = torch.float32) -> dict:
    """Ring attention over cp ranks (a double ring with inner rings of ``inner``), inputs in ``dtype``. cp groups are
    strided ({0, 2}, {1, 3} for world 4, cp 2) so that global and group ranks differ; each
    group (dp replica) gets its own data. ``packed``: rows of packed documents (the op's
    ``segments``) against ``document_attention``, and isolation: one document's q, k and v
    replaced leave every other token's out, lse, dq, dk and dv unchanged.
    Returns, per tensor, None or assert_close's message, and the block counts of each rank."""
    rank = dist.get_rank()
    n_rep = world // cp
    groups = [dist.new_group(list(range(d, world, n_rep))) for d in range(n_rep)]
    dp = rank % n_rep
    group = groups[dp]
    cp_rank = dist.get_rank(group)
    assert cp_rank == rank // n_rep

    q, k, v, grad = (x.to(dtype) for x in attention_inputs(100 * cp + dp, HKV=hkv))
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    B, HQ, T, D = q.shape
    HKV = k.shape[1]
    segments = packed_segments(B, T, seed=cp + dp) if packed else None
    if packed:
        ref_out, ref_lse, ref_grads = document_attention(q, k, v, grad, segments)
    else:
        ref_out, ref_lse, ref_grads = causal_attention(q, k, v, grad)

    def ring(q, k, v):
        local = [schedule.shard_sequence(t, cp, cp_rank, dim=2) for t in (q, k, v, grad)]
        seg = schedule.shard_sequence(segments, cp, cp_rank, dim=1) if packed else None
        ql, kl, vl = (t.clone().requires_grad_() for t in local[:3])
        out, lse = torch.ops.longshield.ring_attention(ql, kl, vl, D**-0.5, group.group_name, cp, inner, seg)
        return (out, lse, *torch.autograd.grad(out, (ql, kl, vl), local[3]))

    out, lse, dq, dk, dv = ring(q, k, v)
    result = {"shapes": [tuple(out.shape), tuple(lse.shape), tuple(dk.shape), tuple(dv.shape)],
              "expected_shapes": [(B, HQ, T // cp, D), (B, HQ, T // cp), (B, HKV, T // cp, D), (B, HKV, T // cp, D)]}

    def gathered(x):
        parts = [torch.empty_like(x) for _ in range(cp)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return schedule.unshard_sequence(parts, cp, dim=2)  # (B, H, L[, D]): sequence is dim 2

    for name, got, want in [("out", out, ref_out), ("lse", lse, ref_lse),
                            ("dq", dq, ref_grads[0]), ("dk", dk, ref_grads[1]), ("dv", dv, ref_grads[2])]:
        try:
            expected = torch.promote_types(dtype, torch.float32) if name == "lse" else dtype
            assert got.dtype == expected, f"cp={cp} {name}: {got.dtype}, not {expected}"
            torch.testing.assert_close(gathered(got), want, atol=tol, rtol=tol)
            result[name] = None
        except AssertionError as e:
            result[name] = f"cp={cp} {name}: {e}"
    counts = [None] * cp
    dist.all_gather_object(counts, dict(ra.last_block_counts), group=group)
    result["counts"] = counts
    result["expected_blocks"] = schedule.blocks_per_rank(cp)[cp_rank]
    if packed:  # isolation: the longest document of row 0 (it spans ranks) gets other values
        ids, lengths = segments[0].unique(return_counts=True)
        mine = segments == ids[lengths.argmax()]
        g = torch.Generator().manual_seed(7)  # the same replacement on every rank of the group
        other = [torch.where(mine[:, None, :, None], torch.randn(t.shape, generator=g) * 3, t) for t in (q, k, v)]
        keep = schedule.shard_sequence(~mine, cp, cp_rank, dim=1)
        changed = ring(*other)
        result["isolation"] = max(float((a - b).detach()[keep[:, None].expand(a.shape[:3])].abs().max())
                                  for a, b in zip((out, lse, dq, dk, dv), changed))
        moved = (changed[0] - out).detach().abs().max()
        dist.all_reduce(moved, op=dist.ReduceOp.MAX, group=group)  # the document lies on some ranks only
        result["document_changed"] = float(moved)
        result["segments"] = segments
    return result


def packed_case(kind: str, checkpoint: str | None = None, dp: int = 1, fsdp: tuple | None = None) -> dict:
    """Packed documents under cp (the world over dp replicas; ZeRO-3 over ``fsdp``), the model
    ``oracles.packed_model(kind)``: the per-unit gradients of the first physical batch; each
    physical batch's per-unit norms; the clipped sum of all of them (noise-free; the physical
    batches dealt round the dp replicas, a short replica running one of padding); that sum again
    without one unit (sensitivity); and isolation: one unit's tokens replaced leave every other
    unit's gradient unchanged. The test process holds the oracle (each unit alone)."""
    world = dist.get_world_size()
    dims = (("dp", dp), ("cp", world // dp)) if dp > 1 else (("cp", world),)
    mesh = init_device_mesh("cpu", tuple(n for _, n in dims), mesh_dim_names=tuple(d for d, _ in dims))
    dp_rank = mesh["dp"].get_local_rank() if dp > 1 else 0
    model = packed_model(kind)
    engine = lf.compile(model, mesh, config=lf.DPConfig(PACKED_C, 0.0), packed_units=PACKED_U, checkpoint=checkpoint,
                        fsdp=fsdp)
    units = packed_units(seed=5)
    batches, _ = pack_documents(units, seq_len=PACKED_T, rows=PACKED_ROWS, unit_slots=PACKED_U)
    first = batches[0]
    out = {"members": [pb.members for pb in batches],
           "per_unit": {n: g.clone() for n, g in engine.per_sample_grads(*first.tensors()).items()}}

    def clipped_sum(batches) -> tuple[dict, dict]:
        """The clipped sum, and this replica's per-unit norms by physical batch, the batches dealt
        round the replicas as the CLI deals them (``LogicalBatch.share``: rounds of equal rows)."""
        model.zero_grad()
        size = sum(len(pb.members) for pb in batches)
        dealt = LogicalBatch(size, torch.arange(size), [(pb.tensors(), None) for pb in batches], 1.0, 1.0,
                             blank=(empty_batch(PACKED_ROWS, PACKED_T, PACKED_U).tensors(), None))
        norms = {}
        for tensors, _ in dealt.share(dp_rank, dp):
            engine.accumulate(*tensors)
            ran = [i for i, pb in enumerate(batches) if tensors[0] is pb.input_ids]  # none: a blank
            if ran:
                norms[ran[0]] = engine.last_norms.clone()
        engine.finalize(logical(size))
        return {name: full(p.grad) for name, p in model.named_parameters()}, norms

    out["clipped_sum"], out["norms"] = clipped_sum(batches)
    left_out = first.members[0]
    without, _ = pack_documents([u for i, u in enumerate(units) if i != left_out], seq_len=PACKED_T,
                                rows=PACKED_ROWS, unit_slots=PACKED_U)
    out["clipped_sum_without"], _ = clipped_sum(without)
    out["left_out"] = left_out
    victim = max(range(len(first.members)), key=lambda s: int((first.units == s).sum()))  # spans rows and ranks
    ids = first.input_ids.clone()
    where = first.units == victim
    ids[where] = (ids[where] + 17) % PACKED_CFG.vocab_size
    labels = first.labels.clone()
    labels[where] = ids[where]
    changed = engine.per_sample_grads(ids, labels, first.position_ids, first.units)
    others = [s for s in range(len(first.members)) if s != victim]
    out["isolation"] = max(float((changed[n][others] - g[others]).abs().max()) for n, g in out["per_unit"].items())
    out["victim_moved"] = max(float((changed[n][victim] - g[victim]).abs().max()) for n, g in out["per_unit"].items())
    out["victim_ranks"] = [bool(where.index_select(1, schedule.zigzag_index(PACKED_T, mesh.size(), r)).any())
                           for r in range(mesh.size())]
    out["captures"] = engine.captures  # batches of other units and lengths: a graph per row count (4 and 2)
    out["sharded"] = all(isinstance(p, DTensor) for p in model.parameters())
    return out


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


def calibration() -> dict:
    """``calibrate_noise_on_rank_0`` on 2 ranks: a target it meets (σ on every rank) and a vacuous
    one (δ above the chance of ever sampling a unit), whose error must reach every rank."""
    from longshield_fx.runtime.calibration import calibrate_noise_on_rank_0

    out = {"sigma": calibrate_noise_on_rank_0(*CALIBRATION, method="rdp")}
    try:
        calibrate_noise_on_rank_0(1.0, 0.05, 0.01, 1, method="rdp")
    except ValueError as e:
        out["vacuous"] = str(e)
    return out


def dropout() -> dict:
    """cp=2 in train mode, GPT-2 with embedding dropout (``oracles.gpt2_embedding_dropout``):
    per-sample gradients from torch seed DROPOUT_SEEDS[0] twice and from DROPOUT_SEEDS[1] once,
    then one training step (noise 0) from the first seed again."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    model = gpt2_embedding_dropout()
    engine = lf.compile(model, mesh, config=lf.DPConfig(CP_CLIP, 0.0))
    ids = case_batches("hf_gpt2", 1)[0]
    out = {}
    for name, seed in (("first", DROPOUT_SEEDS[0]), ("first_again", DROPOUT_SEEDS[0]), ("second", DROPOUT_SEEDS[1])):
        torch.manual_seed(seed)
        out[name] = engine.per_sample_grads(ids, ids)
    torch.manual_seed(DROPOUT_SEEDS[0])
    engine.accumulate(ids, ids)
    engine.finalize(logical(2))
    out["clipped"] = grads(model)
    out["captures"] = engine.captures
    return out


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


def gloo_threads() -> list[str]:
    """The names of this process's gloo threads: each group's worker and transport loop (Linux)."""
    names = (open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
    return sorted(n for n in names if "gloo" in n)


def teardown() -> dict:
    """The end of a run as the CLI ends it: the groups destroyed and their gloo threads joined
    before the interpreter finalizes, though the cases' meshes (DTensor's caches hold them)
    and DCP, imported after the default group, would keep them."""
    before = gloo_threads()
    destroy_process_groups(peers_finished=True)
    return {"before": before, "after": gloo_threads()}


def _save(out_dir: str, index: int, name: str, results) -> None:
    """Written whole or not at all: torchrun ends the other ranks when one fails, maybe mid-write."""
    path = os.path.join(out_dir, f"{index:03d}.pt")
    torch.save((name, results), path + ".tmp")
    os.replace(path + ".tmp", path)


def main():
    out_dir = os.path.join(sys.argv[1], f"rank{os.environ['RANK']}")
    os.makedirs(out_dir, exist_ok=True)
    dist.init_process_group(serial_gloo(), timeout=datetime.timedelta(seconds=300))  # see serial_gloo
    gc.set_threshold(50_000, 10, 10)  # as tests/conftest.py
    world = dist.get_world_size()
    checks = itertools.count()

    def record(name, fn, *args):
        start = time.time()
        try:
            result = fn(*args)
        except Exception:
            _save(out_dir, next(checks), name, {"error": traceback.format_exc()})
            raise  # the ranks would fall out of step: stop the launch (the tests show the error)
        result["_seconds"] = time.time() - start
        _save(out_dir, next(checks), name, result)

    if world == 4:
        for cp in (4, 2):
            for hkv in (2, 1):  # one KV head: dk and dv must still be separate buffers
                record(f"ring-cp{cp}-hkv{hkv}", ring_case, world, cp, hkv)
        for inner in (2, 1):  # two inner rings of 2; four of 1 (the outer ring does every hop)
            record(f"ring-cp4-w{inner}", ring_case, world, 4, 2, inner)
        for cp, inner in ((4, 0), (2, 0), (4, 2)):  # packed documents: single rings, a double ring
            record(f"packed-ring-cp{cp}-w{inner or cp}", ring_case, world, cp, 2, inner, True)
        record("packed-ring-cp4-w2-float64", ring_case, world, 4, 2, 2, True, torch.float64)
    resume = [a.split("=", 1)[1] for a in sys.argv[2:] if a.startswith("--resume=")]
    if resume:  # ``cp_worker.py OUT_DIR --resume=PATH,NOISY_PATH``: only the resumed run
        record("dcp_resume", dcp_resume, *resume[0].split(","))
        record("teardown", teardown)
        return
    only = set(sys.argv[2:])  # by hand: ``cp_worker.py OUT_DIR NAME ...`` runs just those engine cases (and dcp_save)
    for name, case in CP_CASES.items():
        if case.world == world and (not only or name in only):
            record(name, engine_case, case)
    if world == 4 and (not only or "dcp_save" in only):
        record("dcp_save", dcp_save, sys.argv[1])
    if world == 4 and (not only or "packed" in only):
        record("packed-ref-block", packed_case, "ref", "block")
        record("packed-ref-fsdp", packed_case, "ref", None, 2, ("dp", "cp"))
        record("packed-llama-cp4", packed_case, "llama")  # Hugging Face Llama round a ring of 4
    if world == 2 and (not only or "packed" in only):
        for kind in ("ref", "llama", "qwen2", "gpt2"):
            record(f"packed-{kind}", packed_case, kind)
    if world == 2 and not only:
        record("model_rng", model_rng)
        record("calibration", calibration)
        record("dropout", dropout)
        record("dead_peer", dead_peer)
        os._exit(0)  # the default group has a dead peer: do not wait for it at teardown
    record("teardown", teardown)


if __name__ == "__main__":
    main()
