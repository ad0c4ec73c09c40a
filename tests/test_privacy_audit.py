"""The one-run privacy audit (``longshield_fx.audit``): the bound, the canaries, and the engine
audited both ways.

- the bound: the paper's formula against a direct evaluation, its closed form for all-correct
  guesses, and synthetic Gaussian scores (a Gaussian mechanism of known ε): valid (below the
  true ε, at most 5% of runs above it) and rising with the signal;
- the canaries: a white-box canary's per-sample gradient is exactly C·e_j and nothing else,
  a real row's is its own and 0 on the audit parameter; only included canaries become rows;
  the coins are secret unless a test seed is asked for;
- the engine, white-box, seeded, on a shrunk tiny Llama with m >= 50,000 canaries: σ = 0 gives
  a bound far above 8; a run claiming ε = 8 gives a bound <= 8 and > 0; the same run with its
  noise divided by 10 (test-only fault injection) gives a bound above the claim.
"""
from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from dp_accounting.pld.privacy_loss_mechanism import GaussianPrivacyLoss
from scipy import optimize

import longshield_fx as lf
from longshield_fx.audit import (WhiteBoxCanaries, WhiteBoxScores, audit_bound, count_correct, draw_canaries,
                                 epsilon_lower_bound, p_value, run_audit, training_rows)
from longshield_fx.runtime.accounting import epsilon_for
from longshield_fx.runtime.noise import InsecureSeedWarning, NoiseGenerator
from oracles import tiny_llama, token_batch, vmap_per_sample_grads

# --- the bound ----------------------------------------------------------------------------------


def _p_value_by_hand(m, r, v, eps, delta):
    """Steinke et al.'s p-value written out term by term (exact binomials, plain loops)."""
    p = math.exp(eps) / (1 + math.exp(eps))
    pmf = [math.comb(r, k) * p ** k * (1 - p) ** (r - k) for k in range(r + 1)]
    beta = sum(pmf[v:])
    alpha = max(sum(pmf[v - i:v]) / i for i in range(1, v + 1))
    return min(1.0, beta + 2 * m * delta * alpha)


@pytest.mark.parametrize("m, r, v, eps, delta", [(100, 30, 25, 1.0, 1e-3), (50, 50, 40, 0.5, 1e-2),
                                                  (1000, 40, 40, 2.0, 0.0), (200, 20, 11, 0.1, 1e-4)])
def test_p_value_is_the_papers_formula(m, r, v, eps, delta):
    assert p_value(m, r, v, eps, delta) == pytest.approx(_p_value_by_hand(m, r, v, eps, delta), rel=1e-9, abs=1e-15)


@pytest.mark.parametrize("r", [10, 100, 1000, 10000])
def test_all_correct_guesses_give_the_closed_form(r):
    """r guesses, all right, δ = 0: (ε, 0)-DP allows that with probability at most p^r, p =
    e^ε/(1+e^ε), so the 95% bound is logit(0.05^(1/r)) (the paper's ceiling for r guesses,
    about ln(r/3): 1.05, 3.49, 5.81, 8.11)."""
    p = 0.05 ** (1 / r)
    assert epsilon_lower_bound(r, r, r, 0.0) == pytest.approx(math.log(p / (1 - p)), abs=1e-6)


def test_delta_lowers_the_bound_and_a_coin_flip_refutes_nothing():
    assert epsilon_lower_bound(1000, 100, 100, 1e-4) < epsilon_lower_bound(1000, 100, 100, 0.0)
    assert epsilon_lower_bound(1000, 100, 50, 1e-5) == 0.0
    assert epsilon_lower_bound(1000, 0, 0, 1e-5) == 0.0


def test_guesses_are_the_top_and_bottom_scores():
    scores = [0.9, 0.1, 0.5, 0.8, 0.2, 0.3]
    included = [True, False, False, True, True, False]
    assert count_correct(scores, included, 2, 0) == 2  # 0.9, 0.8: both in
    assert count_correct(scores, included, 0, 2) == 1  # 0.1 out (right), 0.2 in (wrong)
    assert count_correct(scores, included, 3, 3) == 4
    with pytest.raises(ValueError):
        count_correct(scores, included, 4, 3)
    single = audit_bound(np.arange(10.0), np.arange(10) >= 5, 0.0, guesses=[(5, 5)])
    assert (single.correct, single.guesses) == (10, 10)
    assert single.epsilon == epsilon_lower_bound(10, 10, 10, 0.0)


def _gaussian_scores(m, mu, seed):
    """Scores of a Gaussian mechanism with sensitivity/σ = mu: N(mu, 1) if in, N(0, 1) if out."""
    rng = np.random.default_rng(seed)
    included = rng.random(m) < 0.5
    return rng.standard_normal(m) + mu * included, included


def _gaussian_epsilon(mu, delta):
    """ε at δ of one Gaussian mechanism with sensitivity/σ = mu (dp-accounting's exact δ(ε))."""
    loss = GaussianPrivacyLoss(standard_deviation=1 / mu)
    return optimize.brentq(lambda eps: loss.get_delta_for_epsilon(eps) - delta, 0.0, 100.0, xtol=1e-9)


def test_gaussian_scores_bound_is_below_the_true_epsilon_and_rises_with_the_signal():
    """The paper's idealised setting: a canary's score is a Gaussian mechanism whose ε at δ is
    known (dp-accounting's exact privacy loss of a Gaussian). With the same draws (common random numbers)
    the bound rises with mu and stays below the true ε (far below: with m canaries it cannot
    pass about ln(m), and a Gaussian is not the worst case for ε)."""
    delta, m = 1e-5, 10_000
    noise, included = _gaussian_scores(m, 0.0, seed=1)
    bounds, truths = [], []
    for mu in (0.5, 1.0, 2.0, 4.0):
        truths.append(_gaussian_epsilon(mu, delta))  # 2.0, 4.4, 10.0, 24.4
        bounds.append(audit_bound(noise + mu * included, included, delta).epsilon)
    assert all(b < t for b, t in zip(bounds, truths)), (bounds, truths)
    assert bounds == sorted(bounds) and bounds[0] > 0.5 and bounds[-1] > 4.5, bounds


def test_bound_is_exact_for_randomized_response():
    """Validity, and that nothing is lost: if each of m guesses is right independently with
    probability e^ε/(1+e^ε) (randomized response, exactly ε-DP), the 95% bound exceeds ε in at
    most 5% of runs, and in nearly that many (the binomial tail is the theorem's own)."""
    eps, m, runs = 1.0, 1000, 400
    right = np.random.default_rng(0).random((runs, m)) < math.exp(eps) / (1 + math.exp(eps))
    above = sum(epsilon_lower_bound(m, m, int(v), 0.0) > eps for v in right.sum(1))
    assert 0.01 * runs <= above <= 0.05 * runs + 2 * math.sqrt(0.05 * 0.95 * runs), above


# --- the canaries -------------------------------------------------------------------------------


def test_white_box_canary_gradient_is_exactly_c_e_j_and_real_rows_keep_theirs():
    """Through the compiled engine: canary j's per-sample gradient is C·e_j on the audit
    parameter and exactly 0 on the model; a real row's is its own gradient and exactly 0 on
    the audit parameter (so neither its norm nor its clipping changes)."""
    C, m = 0.5, 40
    model = tiny_llama()
    ids, labels = token_batch(B=5, T=16)
    canary = torch.tensor([-1, 7, -1, 39, 0])
    net = WhiteBoxCanaries(model, m, scale=C)
    grads = lf.compile(net).per_sample_grads(ids, labels, canary)
    real = canary < 0
    plain = vmap_per_sample_grads(model, (ids[real], labels[real]))  # torch.func, the model alone
    for row, j in enumerate(canary.tolist()):
        audit = grads["canary_directions"][row].flatten()
        if j >= 0:
            expected = torch.zeros(m)
            expected[j] = C
            assert torch.equal(audit, expected)
            assert all(not g[row].any() for name, g in grads.items() if name != "canary_directions")
        else:
            assert not audit.any()
    for name, g in plain.items():
        torch.testing.assert_close(grads[f"model.{name}"][real], g, atol=1e-5, rtol=1e-4, msg=name)
    losses = net(ids, labels, canary)
    assert torch.equal(losses[canary >= 0], torch.zeros(3))  # training losses stay the model's


def test_only_included_canaries_become_rows():
    fields = token_batch(B=6, T=8)
    for kind in ("white", "black"):
        canaries = draw_canaries(50, kind, seq_len=8, insecure_seed=1)
        rows = training_rows(fields, canaries)
        n_in = int(canaries.included.sum())
        assert 0 < n_in < 50 and rows[0].shape[0] == 6 + n_in
        assert torch.equal(rows[0][:6], fields[0])  # the real rows first, unchanged
        if kind == "white":
            assert torch.equal(rows[-1][:6], torch.full((6,), -1))
            assert torch.equal(rows[-1][6:], canaries.included.nonzero().squeeze(1))
        else:
            assert torch.equal(rows[0][6:], canaries.ids[canaries.included])


def test_a_black_box_canary_among_units_of_several_rows_is_a_unit_of_its_first_row():
    ids = torch.randint(0, 256, (5, 3, 8))
    fields = (ids, ids.clone())
    canaries = draw_canaries(40, "black", seq_len=8, insecure_seed=2)
    rows_ids, rows_labels = training_rows(fields, canaries)
    chosen = canaries.ids[canaries.included]
    assert rows_ids.shape == (5 + len(chosen), 3, 8) and torch.equal(rows_ids[:5], ids)
    assert torch.equal(rows_ids[5:, 0], chosen) and torch.equal(rows_labels[5:, 0], chosen)
    assert bool((rows_ids[5:, 1:] == 0).all()) and bool((rows_labels[5:, 1:] == -100).all())


def test_coins_are_secret_unless_a_test_seed_is_asked_for():
    a, b = draw_canaries(256, "white"), draw_canaries(256, "white")
    assert not torch.equal(a.included, b.included)  # fresh OS keys: 2^-256 chance of equality
    with pytest.warns(InsecureSeedWarning, match="canaries"):
        c = draw_canaries(256, "black", seq_len=4, insecure_seed=9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", InsecureSeedWarning)
        d = draw_canaries(256, "black", seq_len=4, insecure_seed=9)
    assert torch.equal(c.included, d.included) and torch.equal(c.ids, d.ids)
    assert 0.35 < float(c.included.float().mean()) < 0.65 and int(c.ids.max()) < 256


def test_white_box_score_is_the_likelihood_ratio_of_the_public_mechanism():
    """z = grad·E[B]/C; the score adds log(1 - q + q·exp((z - 1/2)/σ²)) per step (σ = 0: z)."""
    grad = torch.tensor([[0.3], [-0.1]])
    rec = WhiteBoxScores(2, noise_multiplier=2.0, sample_rate=0.25, max_grad_norm=0.5)
    rec.observe(grad, expected_size=5.0)
    z = grad.flatten().double().numpy() * 10
    np.testing.assert_allclose(rec.scores, np.log(0.75 + 0.25 * np.exp((z - 0.5) / 4)))
    zero = WhiteBoxScores(2, noise_multiplier=0.0, sample_rate=0.25, max_grad_norm=0.5)
    zero.observe(grad, 5.0)
    zero.observe(grad, 5.0)
    np.testing.assert_allclose(zero.scores, 2 * z)


def test_black_box_audit_scores_every_canary_by_its_loss_drop():
    """The library's black-box run: the model trains on the real rows plus the included random
    sequences; every canary (in or out) gets a finite score, the bound is at most the claim."""
    ids, labels = token_batch(B=16, T=8, seed=2)
    canaries = draw_canaries(40, "black", seq_len=8, insecure_seed=4)
    model = tiny_llama(dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=32)
    report = run_audit(model, (ids, labels), canaries, config=lf.DPConfig(1.0, 1.0, insecure_seed=5, accountant="rdp"),
                       sample_rate=0.5, steps=2, physical_batch_size=16, delta=1e-5, insecure_seed=6)
    assert report.kind == "black" and report.scores.shape == (40,) and np.isfinite(report.scores).all()
    assert np.array_equal(report.included, canaries.included.numpy())
    assert 0 <= report.bound.epsilon <= report.claimed_epsilon < math.inf
    assert report.run["expected_batch_size"] == 0.5 * (16 + 40 / 2)  # the public divisor


# --- the engine, audited both ways ----------------------------------------------------------------

DELTA, Q, STEPS = 1e-10, 0.5, 2


def _shrunk_tiny_audit(m, sigma, guesses=None, accountant="rdp"):
    """A white-box audit of DP-SGD on the tiny Llama shrunk to one layer of width 16 (10.5k
    parameters: a canary row costs a model row, and the one-run bound needs ~e^ε right guesses),
    256 real rows of 2 random bytes, Poisson q = 0.5, 2 steps; everything seeded."""
    ids, labels = token_batch(B=256, T=2, seed=1)
    model = tiny_llama(dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=32)
    canaries = draw_canaries(m, "white", insecure_seed=3)
    config = lf.DPConfig(1.0, sigma, insecure_seed=5, accountant=accountant)
    return run_audit(model, (ids, labels), canaries, config=config, sample_rate=Q, steps=STEPS,
                     physical_batch_size=512, delta=DELTA, guesses=guesses, null_row=(ids[0], torch.full((2,), -100)),
                     insecure_seed=6)


@pytest.fixture(scope="module")
def sigma_for_8():
    """σ for ε = 8 at δ = 1e-10 after the 2 steps, by the RDP accountant (the claim of these
    runs; PLD would take 10 s to calibrate here and claims less at the same σ)."""
    return lf.calibrate_noise(8.0, DELTA, Q, STEPS, method="rdp")


@pytest.mark.slow
def test_sigma_zero_bound_is_far_above_8(capsys):
    """No noise: every included canary sampled at least once (3/4 of them) has a positive score,
    every other one exactly 0. 36% of the canaries guessed "in" (fixed in advance: 37.5% are
    expected to be sampled) are all right, and 100,000 canaries refute ε = 9."""
    m = 100_000
    report = _shrunk_tiny_audit(m, 0.0, guesses=[(int(0.36 * m), 0)])
    with capsys.disabled():
        print(f"\nσ = 0: {report.line()}")
    assert math.isinf(report.claimed_epsilon)
    assert report.bound.correct == report.bound.guesses
    assert report.bound.epsilon > 9.0


@pytest.mark.slow
def test_claimed_epsilon_8_bound_is_at_most_8_and_not_zero(sigma_for_8, capsys):
    """The honest run: the best of the 14 default guess sets stays below the claim (and below
    PLD's tighter ε at the same σ), and is clearly above 0."""
    report = _shrunk_tiny_audit(50_000, sigma_for_8)
    pld = epsilon_for(sigma_for_8, Q, STEPS, DELTA)
    with capsys.disabled():
        print(f"\nclaimed ε = 8: {report.line()}; PLD ε at this σ = {pld:.3f}")
    assert report.claimed_epsilon == pytest.approx(8.0, abs=0.05)
    assert 0.5 < report.bound.epsilon <= pld <= report.claimed_epsilon <= 8.0


@pytest.mark.slow
def test_noise_divided_by_10_is_caught(sigma_for_8, monkeypatch, capsys):
    """Fault injection (test-only, by patching the noise generator; no flag reaches it): the
    engine draws σC/10 but still accounts σ. The audit sees it: the bound exceeds the claim."""
    real = NoiseGenerator.add_noise
    monkeypatch.setattr(NoiseGenerator, "add_noise", lambda self, tensors, std: real(self, tensors, std / 10))
    m = 50_000
    report = _shrunk_tiny_audit(m, sigma_for_8, guesses=[(int(0.36 * m), 0)])
    with capsys.disabled():
        print(f"\nnoise / 10: {report.line()}")
    assert report.claimed_epsilon == pytest.approx(8.0, abs=0.05)
    assert report.bound.epsilon > report.claimed_epsilon


def test_every_default_guess_set_fits_the_canaries_and_too_few_canaries_are_named():
    from longshield_fx.audit.bound import default_guesses, fewest_canaries

    rng = np.random.default_rng(0)
    for m in range(1, 40):
        assert all(a + b <= m for a, b in default_guesses(m)), m
        audit_bound(rng.normal(size=m), rng.random(m) < 0.5, delta=1e-5)  # never raises
    fewest = fewest_canaries(1e-5, 0.95)
    for m in (fewest - 1, fewest):  # all guesses right: no bound below the fewest, a bound at it
        included = np.arange(m) < (m + 1) // 2  # the highest scores in, the lowest out
        assert (audit_bound(np.arange(m, 0, -1.0), included, delta=1e-5).epsilon > 0) == (m == fewest), m
