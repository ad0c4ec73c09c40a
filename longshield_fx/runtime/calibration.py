"""``calibrate_noise``: the smallest noise multiplier that meets a privacy target.

The search is ``dp_accounting.calibrate_dp_mechanism``; what is ours is the bracket it
needs and the order in which accountants are asked. A PLD evaluation costs up to seconds
at small sigma (a Python loop over every discretisation point), so the PLD search starts
from RDP's answer and passes through coarser PLD discretisations, each about ten times
cheaper than the next and within a few percent of it: the accountant that decides (PLD at
the accountant's own 1e-4) is asked at about two sigmas. No epsilon is computed twice.
"""
from __future__ import annotations

import math
import numbers
from typing import TYPE_CHECKING

from .accounting import (DEFAULT_METHOD, _check_count, _check_delta, _check_method, _check_sample_rate,
                         _PLDSteps, _RdpSteps)

if TYPE_CHECKING:
    import dp_accounting  # imported where used: 0.9 s of a process's start (see accounting.py)

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
# The value discretisations the PLD search passes through, coarse to fine; the last is the
# accountant's own, so the answer is checked by the accountant that reports epsilon.
_PLD_INTERVALS = (1e-2, 1e-3, _PLDSteps.INTERVAL)


class _UnreachableTarget(ValueError):
    """calibrate_noise: no sigma <= SIGMA_MAX meets the target (message says what to change)."""


class _Stage:
    """Epsilon of ``steps`` Poisson-sampled Gaussian steps as a function of x = log(sigma),
    under one accountant (RDP, or PLD at one discretisation), each sigma evaluated once.

    ``new_accountant`` is what calibrate_dp_mechanism wants: a fresh accountant whose
    ``compose(event)``/``get_epsilon(delta)`` answer from the same memo.
    """

    def __init__(self, interval: float | None, sample_rate: float, steps: int, delta: float) -> None:
        self.interval, self._q, self._steps, self._delta = interval, sample_rate, steps, delta
        self._memo: dict[float, float] = {}

    def event(self, x: float) -> dp_accounting.DpEvent:
        import dp_accounting

        step = dp_accounting.PoissonSampledDpEvent(self._q, dp_accounting.GaussianDpEvent(math.exp(x)))
        return dp_accounting.SelfComposedDpEvent(step, self._steps)

    def at_sigma(self, sigma: float) -> float:
        if sigma not in self._memo:
            steps = _RdpSteps() if self.interval is None else _PLDSteps(self.interval)
            steps.compose(sigma, self._q, self._steps)
            self._memo[sigma] = float(steps.get_epsilon(self._delta))
        return self._memo[sigma]

    def eps(self, x: float) -> float:
        return self.at_sigma(math.exp(x))

    def new_accountant(self) -> "_OneEvent":
        return _OneEvent(self)


class _OneEvent:
    """A fresh accountant for calibrate_dp_mechanism: one ``event`` of ``_Stage`` composed once."""

    def __init__(self, stage: _Stage) -> None:
        self._stage, self._event = stage, None

    @property
    def ledger(self) -> dp_accounting.DpEvent:
        import dp_accounting

        return dp_accounting.NoOpDpEvent() if self._event is None else self._event

    def compose(self, event: dp_accounting.DpEvent, count: int = 1) -> "_OneEvent":
        if self._event is not None or count != 1:
            raise NotImplementedError("calibrate_noise composes one event into a fresh accountant")
        self._event = event
        return self

    def get_epsilon(self, target_delta: float) -> float:
        return self._stage.at_sigma(self._event.event.event.noise_multiplier)


def _bracket(eps, target_epsilon: float, x0: float, step: float) -> tuple[float, float] | None:
    """[lo, hi] in log(sigma) with eps(lo) > target >= eps(hi), walking from x0 in steps that
    double at each move; None when even SIGMA_MIN meets the target. Raises
    ``_UnreachableTarget(eps, sigma)`` when SIGMA_MAX does not."""
    x_min, x_max = math.log(SIGMA_MIN), math.log(SIGMA_MAX)
    hi, lo = min(max(x0, x_min), x_max), None
    while (e := eps(hi)) > target_epsilon:
        if hi >= x_max:
            raise _UnreachableTarget(e, math.exp(hi))
        lo, hi, step = hi, min(hi + step, x_max), 2 * step
    if lo is None:  # feasible at the start: walk down until it is not
        lo = hi
        while eps(lo) <= target_epsilon:
            if lo <= x_min:
                return None
            hi, lo, step = lo, max(lo - step, x_min), 2 * step
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
    walking from a guess in steps that double at each move: from sigma = 1
    for RDP. PLD first takes RDP's answer (PLD is tighter, so it needs 5-20 %
    less noise), then refines it with PLD at value discretisations 1e-2 and
    1e-3 and finally the accountant's 1e-4, each stage walking from the last
    answer in steps of ``tol``: when the coarser answer is within ``tol``
    (the usual case), the final accountant is asked twice. Every answer comes
    from the last stage alone, so the contract above is that accountant's.
    An epsilon already computed in one calibration is never computed again.

    If even ``SIGMA_MIN`` meets the target (only for huge targets),
    ``SIGMA_MIN`` is returned, with epsilon below the target. If
    ``SIGMA_MAX`` does not, or if delta is so large that the guarantee is
    vacuous, a ``ValueError`` says what to change.
    """
    _check_calibration(target_epsilon, delta, sample_rate, steps, method)
    target_epsilon, delta, sample_rate, steps = float(target_epsilon), float(delta), float(sample_rate), int(steps)
    intervals = [None, *(_PLD_INTERVALS if method == "pld" else ())]  # None: RDP
    x, step = 0.0, math.log(2.0)
    for i, interval in enumerate(intervals):
        stage = _Stage(interval, sample_rate, steps, delta)
        try:
            bracket = _bracket(stage.eps, target_epsilon, x, step)
        except _UnreachableTarget as unreachable:
            if i < len(intervals) - 1:  # a tighter accountant may still reach it
                x, step = math.log(SIGMA_MAX), _CALIBRATION_LOG_TOL
                continue
            e, sigma = unreachable.args
            raise _UnreachableTarget(
                f"target_epsilon={target_epsilon} at delta={delta} is unreachable with noise_multiplier <= "
                f"{SIGMA_MAX:g} for sample_rate={sample_rate} and steps={steps} ({method}: eps={e:.4g} at "
                f"sigma={sigma:g}); use fewer steps, a smaller sample_rate or a larger target_epsilon") from None
        if bracket is None:  # even SIGMA_MIN meets it here
            x = math.log(SIGMA_MIN)
        else:
            import dp_accounting

            lo, hi = bracket
            x = hi if hi - lo <= _CALIBRATION_LOG_TOL else dp_accounting.calibrate_dp_mechanism(
                stage.new_accountant, stage.event, target_epsilon, delta,
                bracket_interval=dp_accounting.ExplicitBracketInterval(lo, hi), discrete=False,
                tol=_CALIBRATION_LOG_TOL)
        step = _CALIBRATION_LOG_TOL
    return SIGMA_MIN if bracket is None else math.exp(x)


def calibrate_noise_on_rank_0(target_epsilon: float, delta: float, sample_rate: float, steps: int,
                              method: str = DEFAULT_METHOD) -> float:
    """``calibrate_noise`` on rank 0 of the default process group and its answer on every rank:
    every rank would reach the same sigma at the same cost (seconds of PLD), and ranks sharing a
    machine share its cores. A target it cannot meet raises the same ``ValueError`` on every
    rank (had rank 0 raised alone, the others would fail on its closed connection, or wait for an
    answer that never comes while it lives on)."""
    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return calibrate_noise(target_epsilon, delta, sample_rate, steps, method)
    answer: list = [None, None]  # (sigma, the error's message)
    if dist.get_rank() == 0:
        try:
            answer[0] = calibrate_noise(target_epsilon, delta, sample_rate, steps, method)
        except ValueError as e:
            answer[1] = str(e)
    dist.broadcast_object_list(answer, src=0)
    if answer[1] is not None:
        raise ValueError(answer[1])
    return answer[0]
