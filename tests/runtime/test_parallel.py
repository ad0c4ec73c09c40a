"""Context and data parallelism on real gloo ranks (torchrun), against one process.

Every case of ``oracles.CP_CASES`` runs in one of two torchrun launches of ``cp_worker.py``
(2 and 4 ranks; the ``distributed`` fixture); each rank records what the context-parallel
engine computed on fixed batches. The oracle runs here, once per (model, dp): a
single-process engine built from the same seed, fed every replica's batch, WITHOUT the ``chunked_loss``
pass: the distributed engines chunk the LM head's loss (on by default), the oracle keeps the
plain logits, so each case also checks the chunked loss under cp against the plain graph.
"""
import math

import pytest
import torch

import longshield_fx as lf

from longshield_fx.ops.ring_schedule import blocks_per_rank, zigzag_index
from oracles import (CALIBRATION, CP_CASES, CP_CLIP, CP_LR, CP_NOISE_E, CP_NOISE_SEED, CP_STEPS, DROPOUT_P,
                     attention_shape, case_batches, case_model, gpt2_embedding_dropout, logical, rank_results)

CASES = [pytest.param(name, marks=pytest.mark.torchrun(world), id=name)
         for name, (world, *_) in CP_CASES.items()]
FULL_CASES = [p for p in CASES if not CP_CASES[p.values[0]].light]  # with the no-overlap and noisy engines


@pytest.fixture(scope="module")
def oracle():
    """``oracle(kind, dp)``: per-sample gradients of replica 0's batch, the loss of it, and the
    clipped and the noisy gradient over every replica's batch, all in one process."""
    cache = {}

    def get(kind, dp):
        if (kind, dp) not in cache:
            batches = case_batches(kind, dp)
            model = case_model(kind)
            plain = ("chunked_loss",)
            out = {"per_sample": lf.compile(model, disable_passes=plain).per_sample_grads(batches[0], batches[0])}
            with torch.no_grad():
                out["loss"] = float(model(batches[0], batches[0]).sum())
            for key, config, divisor in (
                    ("clipped", lf.DPConfig(CP_CLIP, 0.0), 1.0),
                    ("noisy", lf.DPConfig(CP_CLIP, 1.0, insecure_seed=CP_NOISE_SEED), CP_NOISE_E)):
                engine = lf.compile(model, config=config, disable_passes=plain)
                for b in batches:
                    engine.accumulate(b, b)
                engine.finalize(logical(2 * dp, divisor))
                out[key] = {n: p.grad.clone() for n, p in model.named_parameters()}
            engine = lf.compile(model, config=lf.DPConfig(CP_CLIP, 0.0), disable_passes=plain)
            optimizer = torch.optim.SGD(model.parameters(), lr=CP_LR)
            for _ in range(CP_STEPS):
                optimizer.zero_grad()
                for b in batches:
                    engine.accumulate(b, b)
                engine.finalize(logical(2 * dp))
                optimizer.step()
            out["trained"] = {n: p.detach().clone() for n, p in model.named_parameters()}
            cache[kind, dp] = out
        return cache[kind, dp]

    return get


def case(distributed, name):
    c = CP_CASES[name]
    return distributed.check(c.world, name), c.kind, c.dp, c.policy, c.comm


def worst(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def bit_identical(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("name", CASES)
def test_per_sample_gradients_match_one_process(distributed, oracle, name):
    ranks, kind, dp, _, _ = case(distributed, name)
    ref = oracle(kind, dp)
    for rank, r in ranks.items():  # full, unsharded per-sample gradients on every rank
        assert r["chunked_loss"], rank  # the LM head's loss was chunked here, not in the oracle
        assert worst(r["per_sample"], ref["per_sample"]) <= 1e-5, rank
    assert abs(ranks[0]["loss"] - ref["loss"]) <= 1e-4


@pytest.mark.parametrize("name", CASES)
def test_clipped_gradient_matches_one_process_on_every_rank(distributed, oracle, name):
    ranks, kind, dp, policy, comm = case(distributed, name)
    ref = oracle(kind, dp)
    assert all(r["clipped_something"] for r in ranks.values())
    tolerance = 1e-6 if policy else 1e-5
    for rank, r in ranks.items():
        assert worst(r["clipped"], ref["clipped"]) <= tolerance, rank
        # every rank holds the same full gradient (a replicated optimizer stays in step)
        assert bit_identical(r["clipped"], ranks[0]["clipped"]), rank
    moved = ranks[0]["bytes"]
    assert moved["reduce_scatter" if comm == "input_stationary" else "all_gather"] > 0, moved


def _noise_has_std(r: dict) -> None:
    """noisy - clipped / E[B] has mean 0 and std σC/E[B] over all coordinates."""
    noise = torch.cat([(r["noisy"][n] - r["clipped"][n] / CP_NOISE_E).flatten() for n in r["noisy"]]).double()
    expected, n = 1.0 * CP_CLIP / CP_NOISE_E, noise.numel()
    assert abs(float(noise.std()) - expected) <= 5 * expected / math.sqrt(2 * n)
    assert abs(float(noise.mean())) <= 5 * expected / math.sqrt(n)


@pytest.mark.parametrize("name", [p for p in FULL_CASES if CP_CASES[p.values[0]].fsdp is None])
def test_noise_is_added_once_per_coordinate(distributed, oracle, name):
    """Same key as the oracle: the same noise, added once (not per rank, shard or replica),
    divided by E[B]; so noisy - clipped / E[B] has std σC/E[B] over the coordinates."""
    ranks, kind, dp, _, _ = case(distributed, name)
    ref = oracle(kind, dp)
    for rank, r in ranks.items():
        assert worst(r["noisy"], ref["noisy"]) <= 1e-5, rank
        assert bit_identical(r["noisy"], ranks[0]["noisy"]), rank
    _noise_has_std(ranks[0])


SHARDED = [p for p in CASES if CP_CASES[p.values[0]].fsdp is not None]


@pytest.mark.parametrize("name", [p for p in SHARDED if p in FULL_CASES])
def test_sharded_noise_is_one_draw_per_coordinate(distributed, name):
    """Each shard draws its own coordinates' noise (its own nonces): std σC/E[B] over the
    gathered gradient, and no shard repeats another's draws; replicas of a shard (hybrid
    sharding) hold the same noisy shard, bit for bit."""
    ranks, *_ = case(distributed, name)
    _noise_has_std(ranks[0])
    by_shard: dict[int, list] = {}
    for rank, r in ranks.items():
        by_shard.setdefault(r["fsdp_index"], []).append(r)
    noise = [torch.cat([(r[0]["noisy_local"][n] - r[0]["clipped_local"][n] / CP_NOISE_E).flatten()
                        for n in sorted(r[0]["noisy_local"])]) for r in by_shard.values()]
    for i, a in enumerate(noise):
        for b in noise[i + 1:]:
            k = min(a.numel(), b.numel())  # a shared stream would repeat values position by position
            same = torch.isclose(a[:k], b[:k], rtol=1e-3, atol=1e-7).double().mean()
            assert same < 0.01, f"two shards drew the same noise ({float(same):.1%} of positions agree)"
    for replicas in by_shard.values():
        for r in replicas[1:]:
            assert bit_identical(r["noisy_local"], replicas[0]["noisy_local"])


@pytest.mark.parametrize("name", SHARDED)
def test_model_states_are_sharded_and_replicas_stay_equal(distributed, name):
    """After compile every parameter is a DTensor holding 1/n of its rows (n shards over the
    fsdp dims); after the training steps, replicas of a shard are bit-identical."""
    ranks, *_ = case(distributed, name)
    c = CP_CASES[name]
    n = {("dp", "cp"): c.world, ("cp",): c.world // c.dp, ("dp",): c.dp}[c.fsdp]
    shards = {r["fsdp_index"] for r in ranks.values()}
    assert shards == set(range(n))
    for rank, r in ranks.items():
        for param, (is_dtensor, local, full) in r["sharded"].items():
            assert is_dtensor, param
            rows = -(-full[0] // n)  # torch.chunk's (and DTensor's) cut: ceil rows, the last ranks fewer
            assert local[0] == max(0, min(rows, full[0] - r["fsdp_index"] * rows)), (param, local, full)
            assert local[1:] == full[1:], param
        peers = [p for p in ranks.values() if p["fsdp_index"] == r["fsdp_index"]]
        assert len(peers) == c.world // n
        assert all(bit_identical(p["trained_local"], r["trained_local"]) for p in peers), rank


@pytest.mark.parametrize("name", CASES)
def test_training_steps_match_one_process(distributed, oracle, name):
    """CP_STEPS SGD steps on the clipped sums (noise 0): the parameters equal one process's,
    and bit-identical on every rank (replicas stay in step); no step recaptured."""
    ranks, kind, dp, _, _ = case(distributed, name)
    ref = oracle(kind, dp)
    for rank, r in ranks.items():
        assert worst(r["trained"], ref["trained"]) <= 1e-5, rank
        assert bit_identical(r["trained"], ranks[0]["trained"]), rank
        assert r["captures"] == 1, rank
    moved = {n: float((ref["trained"][n] - p).abs().max()) for n, p in case_model(kind).named_parameters()}
    assert max(moved.values()) > 1e-3  # the steps did move the parameters


@pytest.mark.parametrize("name", FULL_CASES)
def test_overlap_pass_changes_no_bit(distributed, name):
    ranks, *_ = case(distributed, name)
    for rank, r in ranks.items():
        assert "overlap" in r["passes"] and "overlap" not in r["passes_no_overlap"]
        assert [p for p in r["passes"] if p != "overlap"] == r["passes_no_overlap"]
        assert bit_identical(r["clipped_no_overlap"], r["clipped"]), rank


@pytest.mark.parametrize("name", [p for p in CASES if CP_CASES[p.values[0]].policy is not None])
def test_checkpointed_matches_plain_context_parallel(distributed, name):
    """Checkpointed vs plain, the same mesh in the same launch: per-sample gradients to 1e-6."""
    ranks, kind, dp, policy, comm = case(distributed, name)
    plain_name = next(n for n, c in CP_CASES.items()
                      if c._replace(light=False) == CP_CASES[name]._replace(policy=None, light=False))
    plain, *_ = case(distributed, plain_name)
    assert ranks[0]["passes"][-1] == "checkpoint" and "checkpoint" not in plain[0]["passes"]
    for rank in ranks:
        assert worst(ranks[rank]["per_sample"], plain[rank]["per_sample"]) <= 1e-6, rank


# --- what attention communicates (issue 15) ---------------------------------------------------------
# The exactness tests above would pass if hp (or the double ring) were silently ignored: one
# ring over all four ranks computes the same attention. These read what each rank's graph
# communicates over and what its ring op computed.

def _layout(case) -> tuple[int, int, int]:
    """(cp, hp, w) of a case: w the inner ring size (cp for one ring)."""
    cp = case.world // (case.dp * case.hp)
    return cp, case.hp, case.inner_ring or cp


def _groups(case, rank) -> tuple[tuple, tuple]:
    """(hp group, cp group) of ``rank`` on cp_worker's mesh: dims ("dp", "cp", "hp"), hp
    innermost, so rank = (d * cp + c) * hp + h."""
    cp, hp, _ = _layout(case)
    d, c, h = rank // (cp * hp), rank // hp % cp, rank % hp
    return (tuple((d * cp + c) * hp + j for j in range(hp)) if hp > 1 else (),
            tuple((d * cp + j) * hp + h for j in range(cp)) if cp > 1 else ())


def expected_attention_bytes(case, T: int = 16) -> dict:
    """All-to-all and ring bytes per rank and step, from the paper's sizes (LoongTrain 4.5, as
    ``tests/passes/test_context_parallel.py`` checks them on a fake group): per layer 4 + 4
    all-to-alls sending (hp-1)/hp of 2 Size(q) + Size(kv) each way; K/V hops of Size(kv)
    (K and V of one rank's ring shard, K/V heads replicated to hp) cp-1 times forward and
    backward, plus the backward's fp32 dK/dV accumulators: cp hops around one ring, cp/w more
    on a double ring. Block checkpointing recomputes each layer's forward ring."""
    layers, H, Hkv, hd = attention_shape(case.kind)
    cp, hp, w = _layout(case)
    sp, fp32 = cp * hp, 4
    rows = 2 * (3 if case.kind == "llama_units" else 1)  # attention sees a unit's rows as sequences
    kv_heads = max(Hkv, hp)  # after replication (hp=1: Hkv)
    size_q = rows * H * (T // sp) * hd * fp32
    size_kv = 2 * rows * kv_heads * (T // sp) * hd * fp32
    accumulator_hops = cp + (cp // w if 1 < w < cp else 0)
    forwards = 2 if case.policy == "block" else 1
    ring = layers * ((forwards + 1) * (cp - 1) + accumulator_hops) * size_kv if cp > 1 else 0
    return {"all_to_all": layers * 2 * (2 * size_q + size_kv) * (hp - 1) // hp, "ring_attention": ring}


@pytest.mark.parametrize("name", CASES)
def test_attention_trades_heads_over_hp_and_rotates_blocks_around_cp(distributed, name):
    """Every rank's graph: per layer 8 all-to-alls over its hp group (none without hp), ring
    ops over its cp group with the case's cp and inner ring (cp=1: no group, no hops), and the
    bytes of the formulas; at run time its ring op computed the 2cp+1 chunk pairs of a ring
    of cp ranks in cp kernel calls (a ring over all sp ranks would compute more)."""
    ranks, *_ = case(distributed, name)
    c = CP_CASES[name]
    cp, hp, w = _layout(c)
    layers = attention_shape(c.kind)[0]
    expected = expected_attention_bytes(c)
    for rank, r in ranks.items():
        hp_group, cp_group = _groups(c, rank)
        graph = r["attention_collectives"]
        assert graph["all_to_all"] == [hp_group] * (8 * layers if hp > 1 else 0), rank
        ring_ops = (3 if c.policy == "block" else 2) * layers
        assert graph["ring"] == [(cp_group, cp, 0 if w == cp else w)] * ring_ops, rank
        moved = dict(r["bytes"])
        moved["all_to_all"] -= r["shard_exchange_bytes"]  # fsdp: the clipped-sum shards' exchange
        if c.fsdp == ("dp", "cp") and c.kind == "hf_qwen2":  # its widths divide: the exchange runs (and is exact)
            assert r["shard_exchange_bytes"] > 0, rank
        assert {k: moved[k] for k in expected} == expected, rank
        blocks = r["ring_blocks"]
        assert blocks["forward"] == blocks["backward"] == blocks_per_rank(cp)[rank // hp % cp] == 2 * cp + 1, rank
        assert blocks["forward_calls"] == blocks["backward_calls"] == cp, rank
    if hp > 1:
        assert expected["all_to_all"] > 0
    if cp == 1:  # Ulysses (hp=4): heads move, no K/V block does
        assert expected["ring_attention"] == 0 and all(r["bytes"]["ring_attention"] == 0 for r in ranks.values())


@pytest.mark.torchrun(4)
@pytest.mark.parametrize("kind", ["llama", "hf_qwen2"])
def test_double_ring_adds_the_outer_accumulator_hops_to_the_rings_bytes(distributed, kind):
    """cp=4 as two inner rings of 2 moves the same K/V hops as one ring of 4 (cp-1 = 3 each way)
    and its backward's fp32 dK/dV accumulators take cp/w = 2 outer hops per layer on top of the
    ring's cp = 4: 12 instead of 10 K/V-shard sizes per layer (README: 48 vs 40 MiB); nothing
    else changes."""
    single = distributed.check(4, f"cp4-{kind}")[0]["bytes"]
    double = distributed.check(4, f"cp4w2-{kind}")[0]["bytes"]
    layers, _, Hkv, hd = attention_shape(kind)
    accumulators = 2 * 2 * Hkv * (16 // 4) * hd * 4  # fp32 dK and dV of one rank's (B=2, Hkv, T/cp, hd) shard
    assert double["ring_attention"] - single["ring_attention"] == layers * 2 * accumulators > 0
    assert 10 * double["ring_attention"] == 12 * single["ring_attention"]
    assert {k: v for k, v in double.items() if k != "ring_attention"} == \
        {k: v for k, v in single.items() if k != "ring_attention"}


@pytest.mark.torchrun(2)
def test_dead_peer_gives_a_clear_error_not_a_hang(distributed):
    r = distributed.check(2, "dead_peer")
    assert 1 not in r  # rank 1 left
    assert r[0]["error"] and "peer rank probably died" in r[0]["error"], r[0]


@pytest.mark.torchrun(2)
def test_each_rank_draws_its_own_dropout_masks_and_ranks_stay_in_step(distributed):
    r = distributed.check(2, "model_rng")
    assert not torch.equal(r[0]["inside"], r[1]["inside"])
    assert torch.equal(r[0]["after"], r[1]["after"])


@pytest.mark.torchrun(2)
def test_noise_is_calibrated_on_rank_0_and_its_answer_or_its_error_reaches_every_rank(distributed):
    """The CLI and DPTrainer calibrate σ on rank 0 only; an error there (here a vacuous δ) is
    raised on every rank, not only on rank 0 while the others wait for its answer."""
    r = distributed.check(2, "calibration")
    assert r[0]["sigma"] == r[1]["sigma"] == lf.calibrate_noise(*CALIBRATION, method="rdp")
    assert r[0]["vacuous"] == r[1]["vacuous"] and "the guarantee is vacuous" in r[0]["vacuous"]


# --- dropout under cp=2 end to end (issue 13): cp_worker's "dropout", GPT-2 with embedding dropout ----

DROPOUT_T = 16  # case_batches' sequence length


def kept_entries(per_sample: dict) -> torch.Tensor:
    """(B, T-1, D) bool: the embedding dropout's keep mask, read off the per-sample gradient of
    the position embedding (``oracles.gpt2_embedding_dropout``); the last position, which no
    loss reaches, has none."""
    return per_sample["lm.transformer.wpe.weight"][:, :DROPOUT_T - 1] != 0


@pytest.mark.torchrun(2)
def test_dropout_under_context_parallelism_is_determined_by_the_torch_seed(distributed):
    """The same torch seed gives bit-identical per-sample gradients, another seed other masks;
    every rank holds the same full result; one capture for both graphs."""
    ranks = distributed.check(2, "dropout")
    for rank, r in ranks.items():
        assert bit_identical(r["first"], r["first_again"]), rank
        assert not torch.equal(kept_entries(r["first"]), kept_entries(r["second"])), rank
        assert bit_identical(r["first"], ranks[0]["first"]), rank
        assert r["captures"] == 1, rank
    kept = kept_entries(ranks[0]["first"]).float().mean()
    assert abs(float(kept) - (1 - DROPOUT_P)) < 0.1  # the masks were read right: p of the entries dropped


@pytest.mark.torchrun(2)
def test_each_cp_rank_drops_its_own_pattern_on_its_tokens(distributed):
    """Rank 0 holds positions 0-3 and 12-15 (zig-zag), rank 1 4-11: their masks, in each rank's
    own token order, are independent (they differ on about 2p(1-p) = half the entries); one
    stream shared by the ranks would drop the same pattern on both."""
    kept = kept_entries(distributed.check(2, "dropout")[0]["first"])
    local = [kept[:, zigzag_index(DROPOUT_T, 2, rank)[:7]] for rank in (0, 1)]  # rank 0's 8th is T-1
    assert float((local[0] != local[1]).float().mean()) > 0.3


class KeepMask(torch.nn.Module):
    """Dropout with a given keep mask (B, T, D), scaled like ``nn.Dropout``: x * mask / (1 - p)."""

    def __init__(self, kept: torch.Tensor, p: float):
        super().__init__()
        self.kept, self.p = kept, p

    def forward(self, x):
        return x * self.kept / (1 - self.p)


@pytest.mark.torchrun(2)
def test_dropout_under_context_parallelism_matches_one_process_with_the_same_masks(distributed):
    """One process, the masks the two ranks drew put back in place of the embedding dropout:
    its per-sample gradients (one backward per sample) equal the cp=2 ones, and the cp=2
    training step's clipped sum (same seed, so the same masks) equals its clipped sum."""
    ranks = distributed.check(2, "dropout")
    ours = ranks[0]["first"]
    ids = case_batches("hf_gpt2", 1)[0]
    B, D = ids.shape[0], ours["lm.transformer.wpe.weight"].shape[-1]
    kept = torch.ones(B, DROPOUT_T, D)
    kept[:, :DROPOUT_T - 1] = kept_entries(ours).float()
    model = gpt2_embedding_dropout()
    model.lm.transformer.drop = KeepMask(kept, DROPOUT_P)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = [p for p in model.parameters() if p.requires_grad]
    losses = model(ids, ids)
    rows = [torch.autograd.grad(losses[b], params, retain_graph=True) for b in range(B)]
    ref = {n: torch.stack([row[i] for row in rows]) for i, n in enumerate(names)}
    assert set(ours) == set(ref)
    for n in ref:
        torch.testing.assert_close(ours[n], ref[n], atol=1e-5, rtol=1e-4, msg=n)
    norms = torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1)
    factor = (CP_CLIP / (norms + 1e-6)).clamp(max=1.0)
    assert bool((factor < 1).any())  # the step clipped something
    clipped = {n: torch.einsum("b,b...->...", factor, g) for n, g in ref.items()}
    for rank, r in ranks.items():
        assert worst(r["clipped"], clipped) <= 1e-6, rank


def _pairs(noise: dict) -> torch.Tensor:
    """Every two consecutive values within each tensor, as one int64 of their float32 bits: a
    reused nonce repeats the stream's values in order, so its pairs come back (two values
    colliding by chance: ~1e-15)."""
    keys = []
    for t in noise.values() if isinstance(noise, dict) else [noise]:
        bits = t.detach().float().flatten().view(torch.int32).long()
        keys.append((bits[:-1] << 32) | (bits[1:] & 0xFFFFFFFF))
    return torch.cat(keys)


@pytest.mark.torchrun(4)
def test_a_sharded_run_saved_on_4_ranks_resumes_on_2(distributed, tmp_path):
    """DCP: ZeRO-3 over dp=2 x cp=2 saves after one AdamW step; a 2-rank run (cp=2, ZeRO-3 over
    both) loads it, re-sharded: its AdamW state is the saved one, bit for bit, and its next step
    (on other batches than the first) equals the uninterrupted 4-rank run's, where a fresh
    AdamW from the same parameters steps elsewhere (so the state did decide the step). With
    noise on (the engine's secret stream), the draws after the resume on 2 shards repeat none
    of the 4 shards' draws before the save, where a stream rewound to its first nonce would."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    saved = distributed.check(4, "dcp_save")
    worker = Path(__file__).parent / "cp_worker.py"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")  # a rank that aborts prints its stack
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(worker), str(tmp_path), f"--resume={saved[0]['path']},{saved[0]['noise_path']}"],
                          capture_output=True, text=True, env=env, timeout=600)
    results = {r: found for r in range(2) if (found := rank_results(tmp_path, r)) is not None}
    # the head: an aborted rank's own message and stack; the tail: torchrun's summary
    assert proc.returncode == 0 and len(results) == 2, proc.stdout[-2000:] + proc.stderr[:3000] + proc.stderr[-2000:]
    tolerance = 1e-5
    before_save = torch.cat([_pairs(s["noise_local"]) for s in saved.values()])
    assert sorted(s["noise_index"] for s in saved.values()) == [0, 1, 2, 3]
    for rank, r in results.items():
        resumed = r["dcp_resume"]
        assert resumed["steps_loaded"] == 1, rank  # the accountant came back too
        loaded, at_save = resumed["optimizer_loaded"], saved[0]["optimizer_saved"]
        assert set(loaded) == set(at_save), rank
        for name, state in at_save.items():
            assert set(state) == {"exp_avg", "exp_avg_sq", "step"}, name
            assert all(torch.equal(loaded[name][k], v) for k, v in state.items()), (rank, name)
        assert worst(resumed["after"], saved[0]["after"]) <= tolerance, rank
        assert worst(resumed["after_fresh_optimizer"], saved[0]["after"]) > 100 * tolerance, rank

        assert r["teardown"]["after"] == [], rank  # DCP's load imported after the group: see test below
        assert resumed["noise_index"] == rank and resumed["noise_key_is_fresh"], rank
        reused = torch.isin(_pairs(resumed["noise_local"]), before_save).double().mean()
        assert reused == 0, f"shard {rank} re-drew {float(reused):.1%} of the noise drawn before the save"
        rewound = torch.isin(_pairs(resumed["noise_rewound"]), before_save).double().mean()
        assert rewound > 0.25, rewound  # the control: a stream from nonce 0 repeats shard `rank`'s draws
    for name, state in saved[0]["optimizer_saved"].items():  # the state is not trivially zero
        assert float(state["exp_avg_sq"].max()) > 0, name
    moved = max(float((saved[0]["after"][n] - p).abs().max()) for n, p in case_model("llama").named_parameters())
    assert moved > 1e-3


@pytest.mark.torchrun(4)
def test_a_run_ends_with_every_gloo_thread_joined_before_the_interpreter_finalizes(distributed):
    """``_torch.destroy_process_groups`` (the CLI's teardown), at the end of the 4-rank launch:
    every gloo worker and transport thread is joined when it returns, though the cases' meshes
    live on in DTensor's caches and DCP was imported after the default group, both of which
    hold groups past ``destroy_process_group``. A gloo thread left running into interpreter
    finalization can abort the rank (std::terminate) after a run that did everything right."""
    for rank, r in distributed.check(4, "teardown").items():
        assert "pt_gloo_runloop" in r["before"] and "gloo_tcp_loop" in r["before"], (rank, r)
        assert r["after"] == [], (rank, r)
