"""Privacy accounting for Poisson-sampled DP-SGD.

The arithmetic is delegated to Google's ``dp_accounting`` library (DESIGN.md:
"Privacy is accounted with an existing accountant library, not a hand-written
one"). This module keeps the history of steps in a checkpointable form, feeds
it to one live ``dp_accounting`` accountant and asks that accountant for
epsilon; noise calibration is ``dp_accounting.calibrate_dp_mechanism``.

Every DP-SGD step is modelled as ``PoissonSampledDpEvent(q, GaussianDpEvent(sigma))``
under the add-or-remove-one neighbouring relation, which is what
``longshield_fx.data.PoissonBatches`` implements (true Poisson sampling, noise
std ``sigma * C`` once per logical batch).

The default method is ``"pld"`` (privacy loss distributions), the tightest
accountant dp_accounting offers (DESIGN.md: "The default accountant is the
tightest one the library offers"); ``"rdp"`` is faster and slightly
pessimistic.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import dp_accounting
from dp_accounting import pld as _pld
from dp_accounting.pld import privacy_loss_distribution as _pld_lib
from dp_accounting import rdp as _rdp

__all__ = ["PrivacyAccountant", "epsilon_for", "calibrate_noise", "DEFAULT_METHOD"]

DEFAULT_METHOD = "pld"
_METHODS = ("pld", "rdp")

# calibrate_noise searches sigma in this range. At SIGMA_MIN epsilon is already
# in the hundreds for any non-vacuous delta, and PLD takes tens of seconds per
# evaluation below it; above SIGMA_MAX the gradient signal is drowned for any
# realistic batch, so a target that needs more is a configuration mistake (too
# many steps, too large q, too small epsilon).
SIGMA_MIN = 0.1
SIGMA_MAX = 1e4

# Tolerance handed to dp_accounting.calibrate_dp_mechanism, which searches in
# log(sigma) (see calibrate_noise): the returned sigma is within a factor
# exp(1e-3), i.e. 0.1 %, above the smallest sigma that meets the target.
_CALIBRATION_LOG_TOL = 1e-3
# Bracketing factor for PLD calibration, which starts from the RDP answer
# (PLD needs a little less noise than RDP, typically 5-20 % less).
_PLD_BRACKET_FACTOR = 1.25


def _check_method(method: Any) -> None:
    if method not in _METHODS:
        raise ValueError(f"method must be one of {_METHODS}, got {method!r}")


def _check_delta(delta: float) -> None:
    if not (isinstance(delta, numbers.Real) and 0.0 < delta < 1.0):
        raise ValueError(f"delta must be in the open interval (0, 1), got {delta!r}")


def _check_sample_rate(sample_rate: float) -> None:
    if not (isinstance(sample_rate, numbers.Real) and 0.0 < sample_rate <= 1.0):
        raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate!r}")


def _check_noise_multiplier(noise_multiplier: float) -> None:
    if not (
        isinstance(noise_multiplier, numbers.Real)
        and noise_multiplier >= 0.0
        and math.isfinite(noise_multiplier)
    ):
        raise ValueError(
            f"noise_multiplier must be a finite float >= 0, got {noise_multiplier!r}"
        )


def _check_count(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _new_accountant(method: str) -> dp_accounting.PrivacyAccountant:
    """A fresh, empty dp_accounting accountant for ``method`` (add-or-remove-one)."""
    return _pld.PLDAccountant() if method == "pld" else _rdp.RdpAccountant()


def _step_event(noise_multiplier: float, sample_rate: float) -> dp_accounting.DpEvent:
    """One DP-SGD step: a Poisson-sampled Gaussian mechanism."""
    return dp_accounting.PoissonSampledDpEvent(
        sample_rate, dp_accounting.GaussianDpEvent(noise_multiplier)
    )


class _PLDSteps:
    """PLD composition with each distinct step's distribution built once.

    What ``PLDAccountant`` computes for Poisson-sampled Gaussian steps (same
    discretisation, add-or-remove-one), through dp_accounting's public PLD
    functions; ``PLDAccountant`` rebuilds the one-step distribution at every
    ``compose`` (0.6-2 s on this CPU), which made a per-step ``epsilon`` slow.
    """

    _INTERVAL = 1e-4  # PLDAccountant's default value_discretization_interval

    def __init__(self) -> None:
        self._pld = _pld_lib.identity(value_discretization_interval=self._INTERVAL)
        self._steps: dict[tuple[float, float], Any] = {}

    def compose(self, noise_multiplier: float, sample_rate: float, n: int) -> None:
        key = (noise_multiplier, sample_rate)
        if key not in self._steps:
            self._steps[key] = _pld_lib.from_gaussian_mechanism(
                standard_deviation=noise_multiplier, sampling_prob=sample_rate,
                value_discretization_interval=self._INTERVAL)
        step = self._steps[key]
        self._pld = self._pld.compose(step.self_compose(n))

    def get_epsilon(self, delta: float) -> float:
        return self._pld.get_epsilon_for_delta(delta)


class _RdpSteps:
    """RDP composition through ``RdpAccountant``."""

    def __init__(self) -> None:
        self._accountant = _rdp.RdpAccountant()

    def compose(self, noise_multiplier: float, sample_rate: float, n: int) -> None:
        self._accountant.compose(_step_event(noise_multiplier, sample_rate), n)

    def get_epsilon(self, delta: float) -> float:
        return self._accountant.get_epsilon(delta)


class PrivacyAccountant:
    """History of DP-SGD steps, and the epsilon it has spent so far.

    ``method`` (``"pld"``, the default and the tightest, or ``"rdp"``) is fixed
    at construction. The history is a list of ``(noise_multiplier,
    sample_rate, num_steps)`` runs; consecutive steps with the same parameters
    are merged so that a long training run stays a handful of entries (and
    ``state_dict`` stays small). Changing sigma or q mid-training (e.g. a
    schedule) is accounted exactly.

    Epsilon is incremental: one composed privacy loss (a PLD, or an
    ``RdpAccountant``) lives as long as this object, and :meth:`epsilon`
    composes into it only the steps recorded since its previous call, with
    each distinct (sigma, q) step's PLD built once; so the cost of a call does
    not depend on how many steps came before it (beyond the growth of PLD's own
    privacy-loss PMF). The answer is cached per delta until the next step.
    """

    def __init__(self, method: str = DEFAULT_METHOD) -> None:
        _check_method(method)
        self._method = method
        self._reset([])

    def _reset(self, runs: list[tuple[float, float, int]]) -> None:
        self._runs = list(runs)
        self._num_steps = sum(n for _, _, n in runs)
        # Runs recorded but not yet composed into self._accountant.
        self._pending = list(runs)
        self._accountant = _PLDSteps() if self._method == "pld" else _RdpSteps()
        # A noiseless step makes epsilon infinite for good; it is never composed.
        self._non_private = any(s == 0.0 for s, _, _ in runs)
        self._cache: dict[float, float] = {}

    @property
    def method(self) -> str:
        """The accountant, ``"pld"`` or ``"rdp"``, fixed at construction."""
        return self._method

    def step(self, noise_multiplier: float, sample_rate: float, n: int = 1) -> None:
        """Record ``n`` DP-SGD steps with the given noise multiplier and rate."""
        _check_noise_multiplier(noise_multiplier)
        _check_sample_rate(sample_rate)
        _check_count("n", n, 0)
        if n == 0:
            return
        s, q, n = float(noise_multiplier), float(sample_rate), int(n)
        for runs in (self._runs, self._pending):
            if runs and runs[-1][:2] == (s, q):
                runs[-1] = (s, q, runs[-1][2] + n)
            else:
                runs.append((s, q, n))
        self._num_steps += n
        self._non_private = self._non_private or s == 0.0
        self._cache.clear()

    @property
    def steps(self) -> int:
        """Total number of recorded steps."""
        return self._num_steps

    @property
    def history(self) -> list[tuple[float, float, int]]:
        """A copy of the merged ``(noise_multiplier, sample_rate, num_steps)`` runs."""
        return list(self._runs)

    def epsilon(self, delta: float) -> float:
        """Epsilon spent so far at ``delta``; 0 with no steps, inf if any sigma is 0.

        Composes the steps recorded since the previous call into the live
        accountant, then asks it for epsilon; a repeated call with no new step
        in between returns the cached value without touching the accountant.
        """
        _check_delta(delta)
        delta = float(delta)
        cached = self._cache.get(delta)
        if cached is not None:
            return cached
        if self._num_steps == 0:
            eps = 0.0  # nothing released yet
        elif self._non_private:
            eps = math.inf  # a noiseless release is not private at any epsilon
        else:
            while self._pending:
                s, q, n = self._pending[0]
                self._accountant.compose(s, q, n)
                self._pending.pop(0)
            eps = float(self._accountant.get_epsilon(delta))
        if len(self._cache) >= 64:  # many deltas without a step: keep it bounded
            self._cache.clear()
        self._cache[delta] = eps
        return eps

    def state_dict(self) -> dict:
        """Plain python lists/floats/ints/str, safe for ``torch.save(weights_only=True)``."""
        return {"method": self._method, "history": [[s, q, n] for s, q, n in self._runs]}

    def load_state_dict(self, state: dict) -> None:
        """Replace the history with the one saved by :meth:`state_dict`.

        A state saved by an accountant of another method is refused: the
        epsilon reported so far would silently change meaning mid-run. (A
        state with no ``"method"`` key, written before it was recorded, is
        taken as this accountant's.) The live dp_accounting accountant is
        rebuilt from the loaded history at the next :meth:`epsilon` call.
        """
        if not isinstance(state, dict) or "history" not in state:
            raise ValueError("state must be a dict with a 'history' key from state_dict()")
        method = state.get("method", self._method)
        if method not in _METHODS:
            raise ValueError(f"state has method {method!r}; expected one of {_METHODS}")
        if method != self._method:
            raise ValueError(
                f"this state was saved by a {method!r} accountant, but this accountant "
                f"uses {self._method!r}; construct PrivacyAccountant({method!r}) to "
                f"resume it (its epsilon would otherwise change meaning mid-run)"
            )
        runs = []
        for entry in state["history"]:
            if len(entry) != 3:
                raise ValueError(
                    f"each history entry must be [noise_multiplier, sample_rate, "
                    f"num_steps], got {entry!r}"
                )
            s, q, n = entry
            _check_noise_multiplier(s)
            _check_sample_rate(q)
            _check_count("num_steps", n, 1)
            runs.append((float(s), float(q), int(n)))
        self._reset(runs)


def epsilon_for(
    noise_multiplier: float,
    sample_rate: float,
    steps: int,
    delta: float,
    method: str = DEFAULT_METHOD,
) -> float:
    """Epsilon of ``steps`` Poisson-sampled Gaussian steps (no accountant object needed)."""
    _check_noise_multiplier(noise_multiplier)
    _check_sample_rate(sample_rate)
    _check_count("steps", steps, 0)
    acc = PrivacyAccountant(method)
    acc.step(noise_multiplier, sample_rate, steps)
    return acc.epsilon(delta)


class _UnreachableTarget(ValueError):
    """calibrate_noise: no sigma <= SIGMA_MAX meets the target (message says what to change)."""


class _RememberingAccountant:
    """What calibrate_noise hands dp_accounting.calibrate_dp_mechanism as a fresh accountant.

    It behaves as a fresh dp_accounting accountant of ``method`` (empty
    ledger, ``compose(event)``, ``get_epsilon(delta)``), and the epsilon is
    that accountant's, but an event already evaluated in this calibration (by
    the bracketing, or by calibrate_dp_mechanism itself, which re-evaluates
    the bracket ends and its answer) is looked up instead of recomputed,
    which saves seconds per repeat for PLD.
    """

    def __init__(self, method: str, memo: dict) -> None:
        self._method, self._memo, self._event = method, memo, None

    @property
    def ledger(self) -> dp_accounting.DpEvent:
        return dp_accounting.NoOpDpEvent() if self._event is None else self._event

    def compose(self, event: dp_accounting.DpEvent, count: int = 1) -> "_RememberingAccountant":
        if self._event is not None or count != 1:
            raise NotImplementedError("calibrate_noise composes one event into a fresh accountant")
        self._event = event
        return self

    def get_epsilon(self, target_delta: float) -> float:
        key = (self._event, target_delta)
        if key not in self._memo:
            accountant = _new_accountant(self._method).compose(self._event)
            self._memo[key] = float(accountant.get_epsilon(target_delta))
        return self._memo[key]


def calibrate_noise(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    method: str = DEFAULT_METHOD,
) -> float:
    """Smallest noise multiplier whose epsilon does not exceed ``target_epsilon``.

    The search is ``dp_accounting.calibrate_dp_mechanism`` (Brent's method
    with a bisection fallback) over ``x = log(sigma)``, evaluating the event
    ``steps`` x ``PoissonSampled(sample_rate, Gaussian(exp(x)))`` in a fresh
    accountant of ``method``. Its contract is that the returned parameter has
    epsilon <= target, so the returned sigma is never over budget, and is
    within ``tol`` of the smallest sigma that meets the target.

    Tolerance: ``tol = 1e-3`` in log(sigma), i.e. the returned sigma is at
    most 0.1 % above that smallest sigma (the tests check that 0.2 % less
    noise is over budget). Epsilon falls like sigma^-1 to sigma^-2.5 in the
    cases measured, so at most about 0.25 % of the budget is left unused: far
    below anything visible in utility, while each further digit would cost
    another accountant evaluation (seconds for PLD at small sigma). Searching
    in log(sigma) makes the tolerance relative, the same for sigma = 0.3 and
    sigma = 30.

    calibrate_dp_mechanism needs a bracket, which this function finds by
    walking in factors of 2 from sigma = 1 (RDP) or of 1.25 from the RDP
    answer (PLD: it is tighter, so it needs no more noise, and its
    evaluations cost up to seconds, so the walk starts close). An epsilon
    already computed during one calibration is never computed again.

    If even ``SIGMA_MIN`` meets the target (only for huge targets),
    ``SIGMA_MIN`` is returned, with epsilon below the target. If
    ``SIGMA_MAX`` does not, or if delta is so large that the guarantee is
    vacuous, a ``ValueError`` says what to change.
    """
    if not (
        isinstance(target_epsilon, numbers.Real)
        and target_epsilon > 0
        and math.isfinite(target_epsilon)
    ):
        raise ValueError(f"target_epsilon must be a finite float > 0, got {target_epsilon!r}")
    _check_delta(delta)
    _check_sample_rate(sample_rate)
    _check_count("steps", steps, 1)
    _check_method(method)
    target_epsilon, delta, sample_rate = float(target_epsilon), float(delta), float(sample_rate)
    steps = int(steps)

    # An example is sampled at least once with probability 1 - (1 - q)^T; if
    # delta covers that, even sigma = 0 "meets" any epsilon, calibration is
    # meaningless (and PLD would crawl towards sigma = 0 at great cost).
    sampled_mass = -math.expm1(steps * math.log1p(-sample_rate)) if sample_rate < 1 else 1.0
    if delta >= sampled_mass:
        raise ValueError(
            f"delta={delta} is >= {sampled_mass:.3g}, the probability that a given "
            f"example is sampled at all in {steps} steps at sample_rate={sample_rate}; "
            f"the guarantee is vacuous (no noise is needed to meet it). Use delta well "
            f"below 1/dataset_size"
        )

    memo: dict = {}

    def new_accountant() -> _RememberingAccountant:
        return _RememberingAccountant(method, memo)

    def event(x: float) -> dp_accounting.DpEvent:
        return dp_accounting.SelfComposedDpEvent(_step_event(math.exp(x), sample_rate), steps)

    def eps(x: float) -> float:  # epsilon at sigma = exp(x), exactly as the search sees it
        return new_accountant().compose(event(x)).get_epsilon(delta)

    x_min, x_max = math.log(SIGMA_MIN), math.log(SIGMA_MAX)
    if method == "rdp":
        x0, step = 0.0, math.log(2.0)
    else:
        try:
            x0 = math.log(calibrate_noise(target_epsilon, delta, sample_rate, steps, "rdp"))
        except _UnreachableTarget:  # RDP cannot reach it; PLD, being tighter, might
            x0 = x_max
        step = math.log(_PLD_BRACKET_FACTOR)

    # Bracket [lo, hi] in log(sigma) with eps(lo) > target >= eps(hi).
    hi, lo = min(max(x0, x_min), x_max), None
    while (e := eps(hi)) > target_epsilon:
        if hi >= x_max:
            raise _UnreachableTarget(
                f"target_epsilon={target_epsilon} at delta={delta} is unreachable "
                f"with noise_multiplier <= {SIGMA_MAX:g} for sample_rate="
                f"{sample_rate} and steps={steps} ({method}: eps={e:.4g} "
                f"at sigma={math.exp(hi):g}); use fewer steps, a smaller sample_rate "
                f"or a larger target_epsilon"
            )
        lo, hi = hi, min(hi + step, x_max)
    if lo is None:  # feasible at the start: walk down until it is not
        lo = hi
        while eps(lo) <= target_epsilon:
            if lo <= x_min:
                return SIGMA_MIN
            hi, lo = lo, max(lo - step, x_min)

    x = dp_accounting.calibrate_dp_mechanism(
        new_accountant,
        event,
        target_epsilon,
        delta,
        bracket_interval=dp_accounting.ExplicitBracketInterval(lo, hi),
        discrete=False,
        tol=_CALIBRATION_LOG_TOL,
    )
    return math.exp(x)
