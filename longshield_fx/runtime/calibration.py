"""``calibrate_noise``: the smallest noise multiplier that meets a privacy target.

The search is ``dp_accounting.calibrate_dp_mechanism``; what is ours is the bracket it
needs (walked from the RDP answer for PLD, whose evaluations cost seconds) and a memo so
that no epsilon is computed twice in one calibration.
"""
from __future__ import annotations

import math
import numbers

import dp_accounting

from .accounting import (DEFAULT_METHOD, _check_count, _check_delta, _check_method, _check_sample_rate,
                         _new_accountant, _step_event)

__all__ = ["calibrate_noise"]

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


def _bracket(eps, target_epsilon: float, x0: float, step: float) -> tuple[float, float] | None:
    """[lo, hi] in log(sigma) with eps(lo) > target >= eps(hi), walking from x0 in ``step``s;
    None when even SIGMA_MIN meets the target. Raises ``_UnreachableTarget(eps, sigma)``
    when SIGMA_MAX does not."""
    x_min, x_max = math.log(SIGMA_MIN), math.log(SIGMA_MAX)
    hi, lo = min(max(x0, x_min), x_max), None
    while (e := eps(hi)) > target_epsilon:
        if hi >= x_max:
            raise _UnreachableTarget(e, math.exp(hi))
        lo, hi = hi, min(hi + step, x_max)
    if lo is None:  # feasible at the start: walk down until it is not
        lo = hi
        while eps(lo) <= target_epsilon:
            if lo <= x_min:
                return None
            hi, lo = lo, max(lo - step, x_min)
    return lo, hi


def _check_calibration(target_epsilon, delta, sample_rate, steps, method) -> None:
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
    _check_calibration(target_epsilon, delta, sample_rate, steps, method)
    target_epsilon, delta, sample_rate, steps = float(target_epsilon), float(delta), float(sample_rate), int(steps)
    memo: dict = {}

    def new_accountant() -> _RememberingAccountant:
        return _RememberingAccountant(method, memo)

    def event(x: float) -> dp_accounting.DpEvent:
        return dp_accounting.SelfComposedDpEvent(_step_event(math.exp(x), sample_rate), steps)

    def eps(x: float) -> float:  # epsilon at sigma = exp(x), exactly as the search sees it
        return new_accountant().compose(event(x)).get_epsilon(delta)

    if method == "rdp":
        x0, step = 0.0, math.log(2.0)
    else:
        try:
            x0 = math.log(calibrate_noise(target_epsilon, delta, sample_rate, steps, "rdp"))
        except _UnreachableTarget:  # RDP cannot reach it; PLD, being tighter, might
            x0 = math.log(SIGMA_MAX)
        step = math.log(_PLD_BRACKET_FACTOR)

    try:
        bracket = _bracket(eps, target_epsilon, x0, step)
    except _UnreachableTarget as unreachable:
        e, sigma = unreachable.args
        raise _UnreachableTarget(
            f"target_epsilon={target_epsilon} at delta={delta} is unreachable with noise_multiplier <= "
            f"{SIGMA_MAX:g} for sample_rate={sample_rate} and steps={steps} ({method}: eps={e:.4g} at "
            f"sigma={sigma:g}); use fewer steps, a smaller sample_rate or a larger target_epsilon") from None
    if bracket is None:
        return SIGMA_MIN
    lo, hi = bracket
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
