"""Privacy accounting for Poisson-sampled DP-SGD.

The arithmetic is delegated to Google's ``dp_accounting`` library (DESIGN.md:
"Privacy is accounted with an existing accountant library, not a hand-written
one"). This module only keeps the history of steps in a checkpointable form,
turns it into a ``DpEvent`` and asks the library for epsilon.

Every DP-SGD step is modelled as ``PoissonSampledDpEvent(q, GaussianDpEvent(sigma))``
under the add-or-remove-one neighbouring relation, which is what
``longshield_fx.data.PoissonBatches`` implements (true Poisson sampling, noise
std ``sigma * C`` once per logical batch).
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import dp_accounting
from dp_accounting import pld as _pld
from dp_accounting import rdp as _rdp

__all__ = ["PrivacyAccountant", "epsilon_for", "calibrate_noise"]

_METHODS = ("rdp", "pld")

# calibrate_noise searches sigma in this range. At SIGMA_MIN epsilon is already
# in the hundreds for any non-vacuous delta, and PLD takes tens of seconds per
# evaluation below it; above SIGMA_MAX the gradient signal is drowned for any
# realistic batch, so a target that needs more is a configuration mistake (too
# many steps, too large q, too small epsilon).
SIGMA_MIN = 0.1
SIGMA_MAX = 1e4


def _check_method(method: str) -> None:
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


def _event(runs: list[tuple[float, float, int]]) -> dp_accounting.DpEvent:
    """The whole history as one composed DpEvent (one self-composition per run)."""
    return dp_accounting.ComposedDpEvent(
        [
            dp_accounting.SelfComposedDpEvent(
                dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(s)),
                n,
            )
            for s, q, n in runs
        ]
    )


def _epsilon(runs: list[tuple[float, float, int]], delta: float, method: str) -> float:
    _check_delta(delta)
    _check_method(method)
    runs = [r for r in runs if r[2] > 0]
    if not runs:
        return 0.0  # nothing released yet
    if any(s == 0.0 for s, _, _ in runs):
        return math.inf  # a noiseless release is not private at any epsilon
    accountant = _rdp.RdpAccountant() if method == "rdp" else _pld.PLDAccountant()
    accountant.compose(_event(runs))
    return float(accountant.get_epsilon(delta))


class PrivacyAccountant:
    """History of DP-SGD steps, and the epsilon it has spent so far.

    The history is a list of ``(noise_multiplier, sample_rate, num_steps)``
    runs; consecutive steps with the same parameters are merged so that a
    long training run stays a handful of entries (and ``state_dict`` stays
    small). Epsilon is recomputed from the full history on each call, so
    changing sigma or q mid-training (e.g. a schedule) is accounted exactly.
    """

    def __init__(self) -> None:
        self._runs: list[tuple[float, float, int]] = []

    def step(self, noise_multiplier: float, sample_rate: float, n: int = 1) -> None:
        """Record ``n`` DP-SGD steps with the given noise multiplier and rate."""
        _check_noise_multiplier(noise_multiplier)
        _check_sample_rate(sample_rate)
        _check_count("n", n, 0)
        if n == 0:
            return
        s, q = float(noise_multiplier), float(sample_rate)
        if self._runs and self._runs[-1][:2] == (s, q):
            self._runs[-1] = (s, q, self._runs[-1][2] + n)
        else:
            self._runs.append((s, q, n))

    @property
    def steps(self) -> int:
        """Total number of recorded steps."""
        return sum(n for _, _, n in self._runs)

    @property
    def history(self) -> list[tuple[float, float, int]]:
        """A copy of the merged ``(noise_multiplier, sample_rate, num_steps)`` runs."""
        return list(self._runs)

    def epsilon(self, delta: float, method: str = "rdp") -> float:
        """Epsilon spent so far at ``delta``; 0 with no steps, inf if any sigma is 0.

        ``method="rdp"`` is fast (tens of ms) and slightly pessimistic;
        ``method="pld"`` is tighter but can take seconds for small sigma.
        """
        return _epsilon(self._runs, delta, method)

    def state_dict(self) -> dict:
        """Plain python lists/floats/ints, safe for ``torch.save(weights_only=True)``."""
        return {"history": [[s, q, n] for s, q, n in self._runs]}

    def load_state_dict(self, state: dict) -> None:
        """Replace the history with the one saved by :meth:`state_dict`."""
        if not isinstance(state, dict) or "history" not in state:
            raise ValueError("state must be a dict with a 'history' key from state_dict()")
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
        self._runs = runs


def epsilon_for(
    noise_multiplier: float,
    sample_rate: float,
    steps: int,
    delta: float,
    method: str = "rdp",
) -> float:
    """Epsilon of ``steps`` Poisson-sampled Gaussian steps (no accountant object needed)."""
    _check_noise_multiplier(noise_multiplier)
    _check_sample_rate(sample_rate)
    _check_count("steps", steps, 0)
    return _epsilon([(float(noise_multiplier), float(sample_rate), steps)], delta, method)


def calibrate_noise(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    method: str = "rdp",
    *,
    rtol: float = 5e-3,
) -> float:
    """Smallest noise multiplier whose epsilon does not exceed ``target_epsilon``.

    Epsilon decreases with sigma, so we bracket the target (eps(lo) > target >=
    eps(hi)) and shrink the bracket in log-sigma. The search stops as soon as
    the feasible end has ``(1 - rtol) * target <= eps(hi) <= target``, so the
    returned sigma is never over budget and wastes at most ``rtol`` of it.

    Each step tries the log-log secant point (epsilon is close to a power law
    in sigma, so this usually lands in the window at once) and falls back to
    the geometric midpoint whenever the secant did not halve the bracket; this
    keeps bisection's guarantee while needing few evaluations, which matters
    for PLD (up to seconds per evaluation at small sigma). PLD starts from the
    RDP answer, since the two agree to within tens of percent.

    If epsilon jumps across the window (PLD discretisation), the search stops
    once the bracket is 1e-9 relative and returns its feasible end. If even
    ``SIGMA_MIN`` meets the target (only for huge targets), ``SIGMA_MIN`` is
    returned, with epsilon below the target. If ``SIGMA_MAX`` does not, or if
    delta is so large that the guarantee is vacuous, a ``ValueError`` says
    what to change.
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
    if not (isinstance(rtol, numbers.Real) and 0 < rtol < 0.5):
        raise ValueError(f"rtol must be in (0, 0.5), got {rtol!r}")

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

    def eps(sigma: float) -> float:
        return _epsilon([(sigma, float(sample_rate), steps)], delta, method)

    if method == "pld":
        guess = calibrate_noise(target_epsilon, delta, sample_rate, steps, "rdp", rtol=rtol)
        factor = 1.25
    else:
        guess, factor = 1.0, 2.0

    # Bracket: eps(lo) > target >= eps(hi).
    hi, eps_hi = guess, eps(guess)
    if eps_hi > target_epsilon:
        while eps_hi > target_epsilon:
            if hi >= SIGMA_MAX:
                raise ValueError(
                    f"target_epsilon={target_epsilon} at delta={delta} is unreachable "
                    f"with noise_multiplier <= {SIGMA_MAX:g} for sample_rate="
                    f"{sample_rate} and steps={steps} ({method}: eps={eps_hi:.4g} "
                    f"at sigma={hi:g}); use fewer steps, a smaller sample_rate "
                    f"or a larger target_epsilon"
                )
            lo, eps_lo = hi, eps_hi
            hi = min(hi * factor, SIGMA_MAX)
            eps_hi = eps(hi)
    else:
        lo, eps_lo = hi, eps_hi
        while eps_lo <= target_epsilon:
            if lo <= SIGMA_MIN:
                return SIGMA_MIN
            hi, eps_hi = lo, eps_lo
            lo = max(lo / factor, SIGMA_MIN)
            eps_lo = eps(lo)

    aim = math.log((1.0 - rtol / 2.0) * target_epsilon)
    secant_ok = True
    while eps_hi < (1.0 - rtol) * target_epsilon and hi / lo - 1.0 > 1e-9:
        a, b = math.log(lo), math.log(hi)
        mid = 0.5 * (a + b)
        if secant_ok and math.isfinite(eps_lo) and eps_hi > 0:
            ya, yb = math.log(eps_lo) - aim, math.log(eps_hi) - aim
            x = a - ya * (b - a) / (yb - ya)
            if a < x < b:
                mid = x
        width = b - a
        sigma = math.exp(mid)
        e = eps(sigma)
        if e <= target_epsilon:
            hi, eps_hi = sigma, e
        else:
            lo, eps_lo = sigma, e
        secant_ok = math.log(hi) - math.log(lo) <= 0.5 * width
    return hi
