"""Privacy accounting for Poisson-sampled DP-SGD.

The arithmetic is delegated to Google's ``dp_accounting`` library (DESIGN.md:
"Privacy is accounted with an existing accountant library, not a hand-written
one"). This module keeps the history of steps in a checkpointable form, feeds
it to one live ``dp_accounting`` accountant and asks that accountant for
epsilon; noise calibration (``calibration.py``) is ``dp_accounting.calibrate_dp_mechanism``.

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

import functools
import logging
from collections import Counter, defaultdict
import math
import numbers
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import dp_accounting

# dp_accounting (and the scipy under it) is imported where it is first used, not with this
# module: it is 0.9 s of every process's start, and only the rank that reports epsilon composes.


class _ExcludedOrders(logging.Filter):
    """Drops dp_accounting's "_compute_log_a_frac failed to converge ... Excluding this order from
    the epsilon computation": an order it cannot evaluate counts as infinite, so the RDP bound over
    the remaining orders stays valid (it only gets looser). Calibration's RDP starting guess for
    PLD hits it at large σ, a dozen lines per run that read as if ε were wrong. Its other warnings
    (a negative divergence, read as ε = 0) still print."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("_compute_log_a_frac failed to converge")


logging.getLogger("absl").addFilter(_ExcludedOrders())

__all__ = ["PrivacyAccountant", "epsilon_for", "DEFAULT_METHOD"]

DEFAULT_METHOD = "pld"
_METHODS = ("pld", "rdp")


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


def _step_event(noise_multiplier: float, sample_rate: float) -> dp_accounting.DpEvent:
    """One DP-SGD step: a Poisson-sampled Gaussian mechanism."""
    import dp_accounting

    return dp_accounting.PoissonSampledDpEvent(
        sample_rate, dp_accounting.GaussianDpEvent(noise_multiplier)
    )


@functools.lru_cache(maxsize=4)
def _gaussian_step_pld(noise_multiplier: float, sample_rate: float, interval: float):
    """One Poisson-sampled Gaussian step's PLD, as ``PLDAccountant`` builds it (pessimistic,
    connect-the-dots, add-or-remove-one). Kept for the last few (sigma, q): building one is a
    Python loop over every discretisation point (about 1 s at sigma = 0.35, interval 1e-4),
    and calibration's answer is the sigma the accountant asks for next."""
    from dp_accounting.pld import privacy_loss_distribution

    return privacy_loss_distribution.from_gaussian_mechanism(
        standard_deviation=noise_multiplier, sampling_prob=sample_rate,
        value_discretization_interval=interval)


@functools.lru_cache(maxsize=4)
def _gaussian_steps_pld(noise_multiplier: float, sample_rate: float, interval: float, n: int):
    """``n`` such steps self-composed, as ``PLDAccountant`` composes ``n`` of them (its
    self-composition truncates tails even for ``n = 1``); kept because training composes
    one step at a time, each the same."""
    return _gaussian_step_pld(noise_multiplier, sample_rate, interval).self_compose(n)


class _PLDSteps:
    """PLD composition with each distinct step's distribution built once.

    What ``PLDAccountant`` computes for Poisson-sampled Gaussian steps (same
    discretisation, add-or-remove-one), through dp_accounting's public PLD
    functions; ``PLDAccountant`` rebuilds the one-step distribution at every
    ``compose`` (0.6-2 s on this CPU), which made a per-step ``epsilon`` slow.
    """

    INTERVAL = 1e-4  # PLDAccountant's default value_discretization_interval

    def __init__(self, interval: float = INTERVAL) -> None:
        from dp_accounting.pld import privacy_loss_distribution

        self._interval = interval
        self._pld = privacy_loss_distribution.identity(value_discretization_interval=interval)

    def compose(self, noise_multiplier: float, sample_rate: float, n: int) -> None:
        self._pld = self._pld.compose(_gaussian_steps_pld(noise_multiplier, sample_rate, self._interval, n))

    def get_epsilon(self, delta: float) -> float:
        return self._pld.get_epsilon_for_delta(delta)


class _RdpSteps:
    """RDP composition through ``RdpAccountant``."""

    def __init__(self) -> None:
        from dp_accounting import rdp

        self._accountant = rdp.RdpAccountant()

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

    ``released_elsewhere`` (set by a fork: ``Engine.load_state_dict(..., fork=True)``) lists
    steps that other branches of the same run released, as ``(step, sigma, q)``. A step index
    means the same subsampled batch as this history's step of that index (the same sampling
    stream redraws it), released again with independent noise: the k releases of one batch are
    one Poisson-sampled Gaussian step at sigma_eff = (sum of sigma^-2)^-1/2 (for equal sigmas,
    sigma / sqrt(k)). ``None`` marks an independent Poisson draw (another stream), composed as
    a step of its own. Such a history is composed afresh at each new step.
    """

    def __init__(self, method: str = DEFAULT_METHOD) -> None:
        _check_method(method)
        self._method = method
        self._reset([])

    def _reset(self, runs: list[tuple[float, float, int]]) -> None:
        self._runs = list(runs)
        self._elsewhere: list[tuple[int | None, float, float]] = []
        self._num_steps = sum(n for _, _, n in runs)
        # Runs recorded but not yet composed into self._accountant, which the first epsilon makes.
        self._pending = list(runs)
        self._accountant: _PLDSteps | _RdpSteps | None = None
        # A noiseless step makes epsilon infinite for good; it is never composed.
        self._non_private = any(s == 0.0 for s, _, _ in runs)
        self._cache: dict[float, float] = {}

    @property
    def released_elsewhere(self) -> list[tuple[int | None, float, float]]:
        return list(self._elsewhere)

    @released_elsewhere.setter
    def released_elsewhere(self, steps) -> None:
        checked = []
        for step, s, q in steps:
            _check_noise_multiplier(s)
            _check_sample_rate(q)
            if step is not None:
                _check_count("step", step, 1)
            checked.append((None if step is None else int(step), float(s), float(q)))
        self._elsewhere = checked
        self._cache.clear()

    def step_parameters(self, first: int, last: int) -> list[tuple[float, float]]:
        """(sigma, q) of this history's steps ``first`` .. ``last`` (counted from 1)."""
        out, start = [], 1
        for s, q, n in self._runs:
            lo, hi = max(first, start), min(last, start + n - 1)
            out += [(s, q)] * max(0, hi - lo + 1)
            start += n
        return out

    def _composed_runs(self) -> list[tuple[float, float, int]]:
        """This history with ``released_elsewhere`` merged in, as (sigma, q, count) runs."""
        mine = self.step_parameters(1, self._num_steps)
        again = defaultdict(list)
        counts: Counter = Counter()
        for step, s, q in self._elsewhere:
            # One subsampled batch only where the draw can be the same: this branch's step, at its q.
            if step is not None and step <= self._num_steps and mine[step - 1][1] == q:
                again[step].append(s)
            else:  # an independent draw, or a step this branch has not redrawn (yet)
                counts[(s, q)] += 1
        for step, (s, q) in enumerate(mine, 1):
            sigmas = [s, *again.get(step, ())]
            counts[(0.0 if 0.0 in sigmas else sum(x ** -2 for x in sigmas) ** -0.5, q)] += 1
        return [(s, q, n) for (s, q), n in counts.items()]

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
        if self._elsewhere:
            runs = self._composed_runs()
            if any(s == 0.0 for s, _, _ in runs):
                eps = math.inf
            else:
                composed = _PLDSteps() if self._method == "pld" else _RdpSteps()
                for s, q, n in runs:
                    composed.compose(s, q, n)
                eps = float(composed.get_epsilon(delta))
        elif self._num_steps == 0:
            eps = 0.0  # nothing released yet
        elif self._non_private:
            eps = math.inf  # a noiseless release is not private at any epsilon
        else:
            if self._accountant is None:
                self._accountant = _PLDSteps() if self._method == "pld" else _RdpSteps()
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
        state = {"method": self._method, "history": [[s, q, n] for s, q, n in self._runs]}
        if self._elsewhere:
            state["released_elsewhere"] = [[step, s, q] for step, s, q in self._elsewhere]
        return state

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
        self.released_elsewhere = [tuple(e) for e in state.get("released_elsewhere", ())]


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
