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


@pytest.mark.parametrize("name", CASES)
def test_noise_is_added_once_per_coordinate(distributed, oracle, name):
    """Same key as the oracle: the same noise, added once (not per rank, shard or replica),
    divided by E[B]; so noisy - clipped / E[B] has std σC/E[B] over the coordinates."""
    ranks, kind, dp, _, _ = case(distributed, name)
    ref = oracle(kind, dp)
    for rank, r in ranks.items():
        assert worst(r["noisy"], ref["noisy"]) <= 1e-5, rank
        assert bit_identical(r["noisy"], ranks[0]["noisy"]), rank
    r = ranks[0]
    noise = torch.cat([(r["noisy"][n] - r["clipped"][n] / CP_NOISE_E).flatten() for n in r["noisy"]]).double()
    expected, n = 1.0 * CP_CLIP / CP_NOISE_E, noise.numel()
    assert abs(float(noise.std()) - expected) <= 5 * expected / math.sqrt(2 * n)
    assert abs(float(noise.mean())) <= 5 * expected / math.sqrt(n)


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
