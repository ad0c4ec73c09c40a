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

from oracles import (CP_CASES, CP_CLIP, CP_LR, CP_NOISE_E, CP_NOISE_SEED, CP_STEPS, case_batches, case_model,
                     logical)

CASES = [pytest.param(name, marks=pytest.mark.torchrun(world), id=name)
         for name, (world, *_) in CP_CASES.items()]


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


@pytest.mark.parametrize("name", [p for p in CASES if CP_CASES[p.values[0]].fsdp is None])
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


@pytest.mark.parametrize("name", SHARDED)
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


@pytest.mark.parametrize("name", CASES)
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
    plain_name = next(n for n, c in CP_CASES.items() if c == CP_CASES[name]._replace(policy=None))
    plain, *_ = case(distributed, plain_name)
    assert ranks[0]["passes"][-1] == "checkpoint" and "checkpoint" not in plain[0]["passes"]
    for rank in ranks:
        assert worst(ranks[rank]["per_sample"], plain[rank]["per_sample"]) <= 1e-6, rank


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


@pytest.mark.torchrun(4)
def test_a_sharded_run_saved_on_4_ranks_resumes_on_2(distributed, tmp_path):
    """DCP: ZeRO-3 over dp=2 x cp=2 saves after one AdamW step; a 2-rank run (cp=2, ZeRO-3 over
    both) loads it, re-sharded, and its next step equals the uninterrupted 4-rank run's."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    saved = distributed.check(4, "dcp_save")
    worker = Path(__file__).parent / "cp_worker.py"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(worker), str(tmp_path), f"--resume={saved[0]['path']}"],
                          capture_output=True, text=True, env=env, timeout=600)
    results = {r: torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)
               if (tmp_path / f"rank{r}.pt").exists()}
    assert proc.returncode == 0 and len(results) == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank, r in results.items():
        resumed = r["dcp_resume"]
        assert resumed["steps_loaded"] == 1, rank  # the accountant came back too
        assert worst(resumed["after"], saved[0]["after"]) <= 1e-5, rank
    moved = max(float((saved[0]["after"][n] - p).abs().max()) for n, p in case_model("llama").named_parameters())
    assert moved > 1e-3
