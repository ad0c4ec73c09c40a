"""PrivacyAccountant / calibrate_noise against dp_accounting called directly."""

import inspect
import io
import math

import dp_accounting
import pytest
import torch
from dp_accounting import pld, rdp
from dp_accounting.pld import privacy_loss_distribution
from hypothesis import given, settings
from hypothesis import strategies as st

from longshield_fx.runtime import accounting, calibration
from longshield_fx.runtime.accounting import PrivacyAccountant, epsilon_for
from longshield_fx.runtime.calibration import SIGMA_MAX, SIGMA_MIN, calibrate_noise

DELTA = 1e-5
RUNS = [(1.0, 0.05, 30), (2.0, 0.05, 30), (1.5, 1.0, 5)]
# PLDAccountant's default value_discretization_interval: the grid of privacy-loss
# values on which it computes epsilon, i.e. the resolution PLD promises.
PLD_GRID = 1e-4


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
    acc = PrivacyAccountant(method)
    assert acc.method == method
    for sigma, q, n in RUNS:
        acc.step(sigma, q, n)
    assert acc.steps == 65
    expected = _direct(RUNS, DELTA, method)
    assert 0 < expected < math.inf
    assert acc.epsilon(DELTA) == pytest.approx(expected, rel=1e-9)


def test_pld_is_the_default_everywhere():
    """DESIGN.md: the default accountant is the tightest one the library offers (PLD)."""
    assert PrivacyAccountant().method == "pld"
    for fn in (PrivacyAccountant.__init__, epsilon_for, calibrate_noise):
        assert inspect.signature(fn).parameters["method"].default == "pld", fn
    acc = PrivacyAccountant()
    acc.step(1.0, 0.05, 30)
    expected = _direct([(1.0, 0.05, 30)], DELTA, "pld")
    assert acc.epsilon(DELTA) == pytest.approx(expected, rel=1e-9)
    assert epsilon_for(1.0, 0.05, 30, DELTA) == pytest.approx(expected, rel=1e-9)
    assert expected < _direct([(1.0, 0.05, 30)], DELTA, "rdp")


def test_method_is_fixed_at_construction():
    with pytest.raises(ValueError, match="method must be one of"):
        PrivacyAccountant("gdp")
    with pytest.raises(TypeError):
        PrivacyAccountant("rdp").epsilon(DELTA, method="pld")  # no per-call method
    with pytest.raises(AttributeError):
        PrivacyAccountant().method = "rdp"


# A history mixing sigma and q, with epsilon() asked in between (at two deltas).
# (Large sigmas: dp_accounting builds a step's PLD in ~0.2 s there, ~1 s at sigma = 1.)
MIXED = [(2.0, 0.05, 3), (3.0, 0.05, 1), (2.0, 0.05, 2), (1.5, 1.0, 1), (3.0, 0.2, 4),
         (3.0, 0.05, 2), (2.0, 0.05, 1)]


@pytest.mark.parametrize("method", ["rdp", "pld"])
def test_incremental_epsilon_equals_from_scratch(method):
    """Composing step by step into one live accountant gives the from-scratch answer.

    RDP adds the same per-order vectors, so it agrees to rounding (rel 1e-9). PLD
    convolves the same discretised per-step PMFs in another grouping; only the
    tail truncation (<= 1e-15 mass per composition) and FFT rounding differ
    (measured ~1e-10 relative), so we assert agreement within one step of the
    PLD grid (PLD_GRID = 1e-4 absolute), the resolution PLD itself promises.
    """
    inc = PrivacyAccountant(method)
    for sigma, q, n in MIXED:
        for i in range(n):
            inc.step(sigma, q)
            if i % 2 == 0:
                inc.epsilon(DELTA)
            if i == 1:
                inc.epsilon(1e-3)
    assert inc.steps == sum(n for _, _, n in MIXED)
    tol = dict(rel=1e-9) if method == "rdp" else dict(abs=PLD_GRID)
    scratch = rdp.RdpAccountant() if method == "rdp" else pld.PLDAccountant()
    for sigma, q, n in MIXED:  # what a user of dp_accounting would write by hand
        event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))
        scratch.compose(event, n)
    rebuilt = PrivacyAccountant(method)
    rebuilt.load_state_dict(inc.state_dict())
    for delta in (DELTA, 1e-3, 1e-7):
        expected = scratch.get_epsilon(delta)
        assert 0 < expected < math.inf
        assert inc.epsilon(delta) == pytest.approx(expected, **tol)
        # load_state_dict composes the merged runs, which is the same grouping as by hand
        assert rebuilt.epsilon(delta) == pytest.approx(expected, rel=1e-9)


class _Counting:
    """Counts compose / get_epsilon calls on the accountant's composed privacy loss."""

    def __init__(self, monkeypatch):
        self.composed: list[tuple[float, float, int]] = []
        self.queries = 0
        for cls in (accounting._RdpSteps, accounting._PLDSteps):
            compose, get_epsilon = cls.compose, cls.get_epsilon

            def counting_compose(acc, sigma, q, n, _orig=compose):
                self.composed.append((sigma, q, n))
                return _orig(acc, sigma, q, n)

            def counting_get_epsilon(acc, delta, _orig=get_epsilon):
                self.queries += 1
                return _orig(acc, delta)

            monkeypatch.setattr(cls, "compose", counting_compose)
            monkeypatch.setattr(cls, "get_epsilon", counting_get_epsilon)


def test_pld_builds_each_distinct_step_once(monkeypatch):
    built = []
    original = privacy_loss_distribution.from_gaussian_mechanism

    def counting(**kwargs):
        built.append((kwargs["standard_deviation"], kwargs["sampling_prob"]))
        return original(**kwargs)

    monkeypatch.setattr(privacy_loss_distribution, "from_gaussian_mechanism", counting)
    accounting._gaussian_step_pld.cache_clear()
    accounting._gaussian_steps_pld.cache_clear()
    acc = PrivacyAccountant("pld")
    for sigma in (1.0, 1.0, 2.0, 1.0, 1.0):
        acc.step(sigma, 0.05)
        acc.epsilon(DELTA)
    assert built == [(1.0, 0.05), (2.0, 0.05)]


@pytest.mark.parametrize("method", ["rdp", "pld"])
def test_epsilon_composes_only_new_steps_and_caches(monkeypatch, method):
    calls = _Counting(monkeypatch)
    acc = PrivacyAccountant(method)
    assert acc.epsilon(DELTA) == 0.0
    assert (calls.composed, calls.queries) == ([], 0)

    acc.step(1.0, 0.05, 3)
    first = acc.epsilon(DELTA)
    assert (calls.composed, calls.queries) == ([(1.0, 0.05, 3)], 1)
    # No new step: cached, the accountant is not touched at all.
    assert acc.epsilon(DELTA) == first
    assert (len(calls.composed), calls.queries) == (1, 1)
    # Another delta: asked of the live accountant, nothing recomposed; then cached.
    acc.epsilon(1e-3)
    acc.epsilon(1e-3)
    assert (len(calls.composed), calls.queries) == (1, 2)

    # Only the steps since the last call are composed (merged runs stay merged).
    acc.step(1.0, 0.05)
    acc.step(1.0, 0.05)
    acc.step(2.0, 0.5)
    second = acc.epsilon(DELTA)
    assert calls.composed[1:] == [(1.0, 0.05, 2), (2.0, 0.5, 1)]
    assert calls.queries == 3
    assert second > first
    assert acc.history == [(1.0, 0.05, 5), (2.0, 0.5, 1)]
    acc.step(2.0, 0.5, n=0)  # a no-op step keeps the cache
    acc.epsilon(DELTA)
    assert (len(calls.composed), calls.queries) == (3, 3)

    # load_state_dict rebuilds a fresh accountant from the whole saved history.
    restored = PrivacyAccountant(method)
    restored.load_state_dict(acc.state_dict())
    assert restored.epsilon(DELTA) == pytest.approx(second, rel=1e-9 if method == "rdp" else 0,
                                                    abs=0 if method == "rdp" else PLD_GRID)
    assert calls.composed[3:] == [(1.0, 0.05, 5), (2.0, 0.5, 1)]


@pytest.mark.parametrize("method", ["rdp", "pld"])
def test_epsilon_for_matches_dp_accounting(method):
    expected = _direct([(1.1, 0.05, 50)], 1e-6, method)
    assert epsilon_for(1.1, 0.05, 50, 1e-6, method) == pytest.approx(expected, rel=1e-9)


def test_pld_is_tighter_than_rdp():
    eps = {}
    for method in ("pld", "rdp"):
        acc = PrivacyAccountant(method)
        acc.step(1.0, 0.01, 100)
        eps[method] = acc.epsilon(DELTA)
    assert eps["pld"] < eps["rdp"]


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
    acc = PrivacyAccountant(method)
    assert acc.epsilon(DELTA) == 0.0
    assert epsilon_for(1.0, 0.1, 0, DELTA, method) == 0.0
    acc.step(1.0, 0.01, 10)
    assert 0 < acc.epsilon(DELTA) < math.inf
    acc.step(0.0, 0.01, 1)
    assert acc.epsilon(DELTA) == math.inf
    acc.step(1.0, 0.01, 10)  # noise afterwards does not undo a noiseless release
    assert acc.epsilon(DELTA) == math.inf
    restored = PrivacyAccountant(method)
    restored.load_state_dict(acc.state_dict())
    assert restored.epsilon(DELTA) == math.inf
    assert epsilon_for(0.0, 0.5, 3, DELTA, method) == math.inf


@pytest.mark.parametrize("method", ["rdp", "pld"])
def test_state_dict_round_trips_through_torch_checkpoint(method):
    acc = PrivacyAccountant(method)
    for sigma, q, n in RUNS:
        acc.step(sigma, q, n)
    buf = io.BytesIO()
    torch.save({"accountant": acc.state_dict()}, buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)["accountant"]
    assert state["method"] == method
    restored = PrivacyAccountant(method)
    restored.load_state_dict(state)
    assert restored.method == method
    assert restored.history == acc.history
    assert restored.steps == acc.steps
    assert restored.epsilon(DELTA) == acc.epsilon(DELTA)
    restored.step(1.5, 1.0, 2)  # continues the last run
    assert restored.history[-1] == (1.5, 1.0, 7)
    assert restored.epsilon(DELTA) > acc.epsilon(DELTA)


@pytest.mark.parametrize("saved, loading", [("rdp", "pld"), ("pld", "rdp")])
def test_load_state_dict_refuses_another_method(saved, loading):
    acc = PrivacyAccountant(saved)
    acc.step(1.0, 0.05, 3)
    other = PrivacyAccountant(loading)
    other.step(2.0, 0.1, 1)
    with pytest.raises(ValueError, match=rf"saved by a '{saved}' accountant.*uses '{loading}'"):
        other.load_state_dict(acc.state_dict())
    assert other.history == [(2.0, 0.1, 1)]  # untouched


def test_load_state_dict_accepts_state_without_method():
    """States written before the method was recorded carry only the history."""
    acc = PrivacyAccountant("rdp")
    acc.load_state_dict({"history": [[1.0, 0.05, 3]]})
    assert acc.history == [(1.0, 0.05, 3)]
    assert acc.epsilon(DELTA) == pytest.approx(_direct([(1.0, 0.05, 3)], DELTA, "rdp"), rel=1e-9)


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
     {"history": [[1.0, 0.1, 0]]}, {"method": "gdp", "history": []}],
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
    for bad in (0.0, 1.0, -1e-5, float("nan")):
        with pytest.raises(ValueError, match=r"delta must be in the open interval \(0, 1\)"):
            acc.epsilon(bad)


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
    # Never over budget, and wastes little of it...
    assert 0.99 * target <= eps <= target
    # ...because it is (nearly) the smallest such sigma: calibrate_noise searches to
    # 1e-3 in log(sigma), so 0.2 % less noise is already over budget.
    assert epsilon_for(sigma * 0.998, q, steps, DELTA, method) > target
    return sigma


@pytest.mark.parametrize("target, q, steps", RDP_CASES)
def test_calibrate_noise_rdp(target, q, steps):
    _check_calibrated(target, q, steps, "rdp")


@pytest.mark.parametrize("target, q, steps", [(2.0, 1.0, 5), (3.0, 0.1, 100)])
def test_calibrate_noise_pld(target, q, steps):
    sigma_pld = _check_calibrated(target, q, steps, "pld")
    # PLD is tighter, so it needs no more noise than RDP.
    assert sigma_pld <= calibrate_noise(target, DELTA, q, steps, "rdp")


def test_pld_calibration_asks_the_reporting_accountant_at_few_sigmas(monkeypatch):
    """Coarser PLDs narrow the search, so PLD at the accountant's own discretisation (seconds per
    evaluation at small sigma) is asked only near the answer; and the accountant that reports
    epsilon afterwards reuses the answer's one-step PLD instead of building it again."""
    asked: dict = {}
    at_sigma = calibration._Stage.at_sigma

    def counting(stage, sigma):
        asked.setdefault(stage.interval, set()).add(sigma)
        return at_sigma(stage, sigma)

    monkeypatch.setattr(calibration._Stage, "at_sigma", counting)
    sigma = _check_calibrated(8.0, 0.1, 12, "pld")  # the CLI's default target, a short run
    assert list(asked) == [None, *calibration._PLD_INTERVALS]  # RDP first, then PLD coarse to fine
    assert len(asked[accounting._PLDSteps.INTERVAL]) <= 3
    built = []
    original = privacy_loss_distribution.from_gaussian_mechanism
    monkeypatch.setattr(privacy_loss_distribution, "from_gaussian_mechanism",
                        lambda **kw: built.append(kw) or original(**kw))
    acc = PrivacyAccountant("pld")
    acc.step(sigma, 0.1)
    acc.epsilon(DELTA)
    assert built == []


def test_calibrate_noise_floor_for_huge_target():
    sigma = calibrate_noise(1e4, DELTA, 1.0, 1, "rdp")
    assert sigma == SIGMA_MIN
    assert epsilon_for(sigma, 1.0, 1, DELTA, "rdp") <= 1e4


@pytest.mark.parametrize("method", ["rdp", "pld"])
def test_calibrate_noise_floor_branch(monkeypatch, method):
    # Same branch with a raised floor: PLD takes ~8 s per evaluation at sigma = 0.1.
    monkeypatch.setattr(calibration, "SIGMA_MIN", 2.0)
    target = 1.01 * epsilon_for(2.0, 1.0, 1, DELTA, method)
    assert calibrate_noise(target, DELTA, 1.0, 1, method) == 2.0


@pytest.mark.parametrize("method", ["rdp", "pld"])
def test_calibrate_noise_unreachable_target_explains(method):
    with pytest.raises(ValueError, match=rf"unreachable.*\({method}: .*fewer steps"):
        calibrate_noise(1e-3, DELTA, 1.0, 1_000_000, method)


def test_calibrate_noise_pld_reaches_what_rdp_cannot():
    """Between the two accountants' epsilons at SIGMA_MAX: only PLD meets the target."""
    eps_rdp = epsilon_for(SIGMA_MAX, 1.0, 10_000, DELTA, "rdp")
    eps_pld = epsilon_for(SIGMA_MAX, 1.0, 10_000, DELTA, "pld")
    target = 0.5 * (eps_rdp + eps_pld)
    assert eps_pld < target < eps_rdp
    with pytest.raises(ValueError, match="unreachable"):
        calibrate_noise(target, DELTA, 1.0, 10_000, "rdp")
    _check_calibrated(target, 1.0, 10_000, "pld")


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
