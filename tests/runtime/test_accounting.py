"""PrivacyAccountant / calibrate_noise against dp_accounting called directly."""

import io
import math

import dp_accounting
import pytest
import torch
from dp_accounting import pld, rdp
from hypothesis import given, settings
from hypothesis import strategies as st

from longshield_fx.runtime.accounting import (
    SIGMA_MIN,
    PrivacyAccountant,
    calibrate_noise,
    epsilon_for,
)

DELTA = 1e-5
RUNS = [(1.0, 0.05, 30), (2.0, 0.05, 30), (1.5, 1.0, 5)]


def _direct(runs, delta, method):
    """What a user of dp_accounting would write by hand."""
    acc = rdp.RdpAccountant() if method == "rdp" else pld.PLDAccountant()
    for sigma, q, n in runs:
        acc.compose(
            dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), n
        )
    return acc.get_epsilon(delta)


@pytest.mark.parametrize("method", ["rdp", "pld"])
def test_epsilon_matches_dp_accounting(method):
    acc = PrivacyAccountant()
    for sigma, q, n in RUNS:
        acc.step(sigma, q, n)
    assert acc.steps == 65
    expected = _direct(RUNS, DELTA, method)
    assert 0 < expected < math.inf
    assert acc.epsilon(DELTA, method=method) == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("method", ["rdp", "pld"])
def test_epsilon_for_matches_dp_accounting(method):
    expected = _direct([(1.1, 0.05, 50)], 1e-6, method)
    assert epsilon_for(1.1, 0.05, 50, 1e-6, method) == pytest.approx(expected, rel=1e-9)


def test_pld_is_tighter_than_rdp():
    acc = PrivacyAccountant()
    acc.step(1.0, 0.01, 100)
    assert acc.epsilon(DELTA, "pld") < acc.epsilon(DELTA, "rdp")


def test_consecutive_identical_steps_merge():
    acc = PrivacyAccountant()
    for _ in range(5):
        acc.step(1.0, 0.01)
    acc.step(1.0, 0.01, n=3)
    acc.step(1.0, 0.02)
    acc.step(1.0, 0.01, n=0)  # no-op
    acc.step(1.0, 0.01)
    assert acc.history == [(1.0, 0.01, 8), (1.0, 0.02, 1), (1.0, 0.01, 1)]
    assert acc.steps == 10


@pytest.mark.parametrize("method", ["rdp", "pld"])
def test_zero_steps_and_zero_noise(method):
    acc = PrivacyAccountant()
    assert acc.epsilon(DELTA, method) == 0.0
    assert epsilon_for(1.0, 0.1, 0, DELTA, method) == 0.0
    acc.step(1.0, 0.01, 10)
    acc.step(0.0, 0.01, 1)
    assert acc.epsilon(DELTA, method) == math.inf
    assert epsilon_for(0.0, 0.5, 3, DELTA, method) == math.inf


def test_state_dict_round_trips_through_torch_checkpoint():
    acc = PrivacyAccountant()
    for sigma, q, n in RUNS:
        acc.step(sigma, q, n)
    buf = io.BytesIO()
    torch.save({"accountant": acc.state_dict()}, buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)["accountant"]
    restored = PrivacyAccountant()
    restored.load_state_dict(state)
    assert restored.history == acc.history
    assert restored.steps == acc.steps
    assert restored.epsilon(DELTA) == acc.epsilon(DELTA)
    restored.step(1.5, 1.0, 2)  # continues the last run
    assert restored.history[-1] == (1.5, 1.0, 7)


@settings(max_examples=50, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from([0.5, 1.0, 2.0]), st.sampled_from([0.01, 1.0]), st.integers(0, 5)
        ),
        max_size=20,
    )
)
def test_history_invariants(steps):
    """Merged history keeps every step, has no mergeable neighbours, and round-trips."""
    acc = PrivacyAccountant()
    for sigma, q, n in steps:
        acc.step(sigma, q, n)
    hist = acc.history
    assert acc.steps == sum(n for _, _, n in steps)
    assert all(n >= 1 for _, _, n in hist)
    assert all(a[:2] != b[:2] for a, b in zip(hist, hist[1:]))
    expanded = [(s, q) for s, q, n in steps for _ in range(n)]
    assert [(s, q) for s, q, n in hist for _ in range(n)] == expanded
    other = PrivacyAccountant()
    other.load_state_dict(acc.state_dict())
    assert other.history == hist


@pytest.mark.parametrize(
    "state",
    [{}, {"history": [[1.0, 0.1]]}, {"history": [[-1.0, 0.1, 3]]}, {"history": [[1.0, 2.0, 3]]},
     {"history": [[1.0, 0.1, 0]]}],
)
def test_load_state_dict_rejects_garbage(state):
    with pytest.raises(ValueError):
        PrivacyAccountant().load_state_dict(state)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(noise_multiplier=-1.0, sample_rate=0.1), "noise_multiplier"),
        (dict(noise_multiplier=float("nan"), sample_rate=0.1), "noise_multiplier"),
        (dict(noise_multiplier=1.0, sample_rate=0.0), "sample_rate"),
        (dict(noise_multiplier=1.0, sample_rate=1.5), "sample_rate"),
        (dict(noise_multiplier=1.0, sample_rate=0.1, n=-1), "n"),
        (dict(noise_multiplier=1.0, sample_rate=0.1, n=1.5), "n"),
    ],
)
def test_step_validates(kwargs, name):
    with pytest.raises(ValueError, match=name):
        PrivacyAccountant().step(**kwargs)


def test_epsilon_validates():
    acc = PrivacyAccountant()
    with pytest.raises(ValueError, match=r"delta must be in the open interval \(0, 1\)"):
        acc.epsilon(0.0)
    with pytest.raises(ValueError, match="method"):
        acc.epsilon(DELTA, method="gdp")


# calibrate_noise -------------------------------------------------------------

RDP_CASES = [
    (1.0, 0.01, 1000),
    (8.0, 0.01, 1000),
    (3.0, 0.1, 100),
    (0.5, 0.001, 10_000),
    (0.1, 1.0, 1),
    (20.0, 0.5, 10),
]


def _check_calibrated(target, q, steps, method):
    sigma = calibrate_noise(target, DELTA, q, steps, method)
    eps = epsilon_for(sigma, q, steps, DELTA, method)
    assert 0.99 * target <= eps <= target
    # ...and it is (nearly) the smallest such sigma: 1% less noise is over budget.
    assert epsilon_for(sigma * 0.99, q, steps, DELTA, method) > target
    return sigma


@pytest.mark.parametrize("target, q, steps", RDP_CASES)
def test_calibrate_noise_rdp(target, q, steps):
    _check_calibrated(target, q, steps, "rdp")


@pytest.mark.parametrize("target, q, steps", [(2.0, 1.0, 5), (3.0, 0.1, 100)])
def test_calibrate_noise_pld(target, q, steps):
    sigma_pld = _check_calibrated(target, q, steps, "pld")
    # PLD is tighter, so it needs no more noise than RDP.
    assert sigma_pld <= calibrate_noise(target, DELTA, q, steps, "rdp")


def test_calibrate_noise_floor_for_huge_target():
    sigma = calibrate_noise(1e4, DELTA, 1.0, 1)
    assert sigma == SIGMA_MIN
    assert epsilon_for(sigma, 1.0, 1, DELTA) <= 1e4


def test_calibrate_noise_unreachable_target_explains():
    with pytest.raises(ValueError, match="unreachable.*fewer steps"):
        calibrate_noise(1e-3, DELTA, 1.0, 1_000_000)


def test_calibrate_noise_rejects_vacuous_delta():
    with pytest.raises(ValueError, match="vacuous"):
        calibrate_noise(1.0, 0.5, 0.001, 10)


@pytest.mark.parametrize(
    "args, match",
    [
        ((0.0, DELTA, 0.1, 10), r"target_epsilon must be a finite float > 0"),
        ((-1.0, DELTA, 0.1, 10), r"target_epsilon must be a finite float > 0"),
        ((math.inf, DELTA, 0.1, 10), r"target_epsilon must be a finite float > 0"),
        ((1.0, 0.0, 0.1, 10), r"delta must be in the open interval \(0, 1\)"),
        ((1.0, 1.0, 0.1, 10), r"delta must be in the open interval \(0, 1\)"),
        ((1.0, DELTA, 0.0, 10), r"sample_rate must be in \(0, 1\]"),
        ((1.0, DELTA, 1.01, 10), r"sample_rate must be in \(0, 1\]"),
        ((1.0, DELTA, 0.1, 0), r"steps must be an integer >= 1"),
        ((1.0, DELTA, 0.1, 2.5), r"steps must be an integer >= 1"),
    ],
)
def test_calibrate_noise_validates(args, match):
    with pytest.raises(ValueError, match=match):
        calibrate_noise(*args)


def test_calibrate_noise_validates_method():
    with pytest.raises(ValueError, match="method"):
        calibrate_noise(1.0, DELTA, 0.1, 10, method="moments")
