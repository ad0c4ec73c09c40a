"""The one-run ε lower bound of Steinke, Nasr and Jagielski (NeurIPS 2023).

What: m canaries are each included in training independently with probability 1/2; after
the run an auditor guesses "in" for the k₊ highest-scoring canaries and "out" for the k₋
lowest (abstaining on the rest), r = k₊ + k₋ guesses of which v are right. If training is
(ε, δ)-DP with respect to each canary, then (the paper's theorem for (ε, δ)-DP, with abstention)

    P[v or more right] <= β + 2·m·δ·α,   β = P[Binomial(r, p) >= v],  p = e^ε / (1 + e^ε),
    α = max over i = 1..v of P[v - i <= Binomial(r, p) < v] / i,

so a run whose v makes that probability smaller than 1 - confidence refutes (ε, δ)-DP. The
bound is the largest such ε (a root search: the probability grows with ε).

Assumes: the inclusion bits are independent fair coins, drawn before training and known only
to the auditor, and the guesses are a function of what the run released (the scores) and of
nothing that depends on the bits; the numbers k₊, k₋ are fixed before the scores are seen.
Choosing the best of several (k₊, k₋) after seeing the scores is allowed only with a
correction: ``audit_bound`` applies Bonferroni's (each of G candidates tested at
(1 - confidence) / G), so its result is a valid lower bound at the stated confidence.

Guarantees: ``epsilon_lower_bound`` never exceeds the true ε of an (ε, δ)-DP mechanism except
with probability at most 1 - confidence over the canaries' coin flips and the training noise.
The implementation follows the paper's formula (jax-privacy's ``auditing`` module computes the
same quantity); it uses scipy, which dp-accounting already requires.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import optimize, stats
from scipy.special import expit

__all__ = ["p_value", "epsilon_lower_bound", "AuditBound", "audit_bound", "count_correct", "default_guesses"]

# α is a maximum over i = 1..v of (a probability)/i; past i = _ALPHA_TERMS every term is below
# 1/_ALPHA_TERMS, so that value bounds the rest from above (conservative, never optimistic).
_ALPHA_TERMS = 20000
_EPS_MAX = 60.0  # e^60 guesses would be needed to refute more; the search stops there


def _check_counts(m: int, r: int, v: int) -> None:
    if not (0 <= v <= r <= m):
        raise ValueError(f"need 0 <= correct ({v}) <= guesses ({r}) <= canaries ({m})")


def p_value(m: int, r: int, v: int, eps: float, delta: float) -> float:
    """Probability of ``v`` or more right of ``r`` guesses on ``m`` canaries if training were
    (eps, delta)-DP: small values refute that claim."""
    _check_counts(m, r, v)
    if not (eps >= 0 and 0 <= delta <= 1):
        raise ValueError(f"need eps >= 0 and 0 <= delta <= 1, got eps={eps}, delta={delta}")
    if v == 0:
        return 1.0
    p = float(expit(eps))  # the best accuracy of one guess under eps-DP (randomized response)
    beta = float(stats.binom.sf(v - 1, r, p))
    if delta == 0:
        return min(beta, 1.0)
    n = min(v, _ALPHA_TERMS)
    # P[v - i <= Bin < v] for i = 1..n, as cumulative sums of the pmf just below v.
    tails = np.cumsum(stats.binom.pmf(np.arange(v - 1, v - 1 - n, -1), r, p))
    alpha = float(np.max(tails / np.arange(1, n + 1)))
    if n < v:
        alpha = max(alpha, 1.0 / (n + 1))
    return min(beta + 2.0 * m * delta * alpha, 1.0)


def epsilon_lower_bound(m: int, r: int, v: int, delta: float, confidence: float = 0.95) -> float:
    """The largest ε that ``v`` right of ``r`` guesses on ``m`` canaries refutes at
    ``confidence``: (ε, delta)-DP would give that many right with probability < 1 - confidence.
    0 when even ε = 0 is not refuted."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    significance = 1.0 - confidence
    if p_value(m, r, v, 0.0, delta) >= significance:
        return 0.0
    lo, hi = 0.0, 1.0  # p_value(lo) < significance <= p_value(hi) once hi is bracketed
    while p_value(m, r, v, hi, delta) < significance:
        lo, hi = hi, 2.0 * hi
        if hi > _EPS_MAX:
            return _EPS_MAX
    # The p-value grows continuously with ε: its crossing of the significance level is the bound.
    return float(optimize.brentq(lambda eps: p_value(m, r, v, eps, delta) - significance, lo, hi, xtol=1e-9))


def default_guesses(m: int) -> list[tuple[int, int]]:
    """(k₊, k₋) candidates fixed before any score is seen: "in" guesses alone for the top 1%
    to 45% of the canaries, and as many "out" guesses at the bottom alongside."""
    out = []
    for frac in (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.45):
        k = max(1, int(frac * m))
        out += [(k, 0), (k, k)]
    return sorted({(a, b) for a, b in out if a + b <= m})


def fewest_canaries(delta: float, confidence: float = 0.95) -> int:
    """The smallest m with which ``audit_bound`` can refute any ε > 0 at all: with fewer, even
    every guess right (of every default guess set, Bonferroni-corrected) is not significant."""
    def can_refute(m):
        candidates = default_guesses(m)
        corrected = 1.0 - (1.0 - confidence) / len(candidates)
        return any(p_value(m, a + b, a + b, 0.0, delta) < 1.0 - corrected for a, b in candidates)

    m = 1
    while not can_refute(m):
        m += 1
    return m


@dataclass(frozen=True)
class AuditBound:
    """The bound and the guesses behind it (the best of ``candidates`` after Bonferroni)."""

    epsilon: float  # the ε lower bound at ``confidence``
    confidence: float
    delta: float
    canaries: int  # m
    k_plus: int
    k_minus: int
    guesses: int  # r = k₊ + k₋
    correct: int  # v
    candidates: int  # G, the number of (k₊, k₋) tried: each tested at (1 - confidence) / G


def count_correct(scores, included, k_plus: int, k_minus: int) -> int:
    """Right guesses when the ``k_plus`` highest scores are called "in" and the ``k_minus``
    lowest "out". Ties are broken by canary index, which does not depend on inclusion."""
    return _count(_ranked(scores, included), k_plus, k_minus)


def _ranked(scores, included) -> np.ndarray:
    """Inclusion bits ordered from the highest score to the lowest (stable: ties by index)."""
    scores, included = np.asarray(scores, dtype=np.float64), np.asarray(included, dtype=bool)
    if included.shape != scores.shape or scores.ndim != 1 or len(scores) == 0:
        raise ValueError(f"need one inclusion bit per score, got {included.shape} and {scores.shape}")
    if not np.isfinite(scores).all():
        raise ValueError("canary scores must be finite")
    return included[np.argsort(-scores, kind="stable")]


def _count(ranked: np.ndarray, k_plus: int, k_minus: int) -> int:
    if k_plus < 0 or k_minus < 0 or k_plus + k_minus > len(ranked):
        raise ValueError(f"guesses ({k_plus} in, {k_minus} out) must be >= 0 and at most the {len(ranked)} canaries")
    return int(ranked[:k_plus].sum() + (~ranked[len(ranked) - k_minus:]).sum())


def audit_bound(scores, included, delta: float, confidence: float = 0.95,
                guesses: list[tuple[int, int]] | None = None) -> AuditBound:
    """The one-run ε lower bound from canary ``scores`` (higher = more likely included) and
    the true ``included`` bits, at ``delta`` and ``confidence``.

    ``guesses``: the (k₊, k₋) candidates, fixed before the scores were seen (default
    ``default_guesses(m)``); the best is reported, each tested at (1 - confidence) / G.
    """
    ranked = _ranked(scores, included)
    m = len(ranked)
    candidates = default_guesses(m) if guesses is None else [(int(a), int(b)) for a, b in guesses]
    if not candidates:
        raise ValueError("need at least one (k_plus, k_minus) guess set")
    corrected = 1.0 - (1.0 - confidence) / len(candidates)
    counted = [(k_plus, k_minus, _count(ranked, k_plus, k_minus)) for k_plus, k_minus in candidates]
    # Most precise first; a candidate that cannot refute the best ε so far even at δ = 0 (δ only
    # raises the p-value) is skipped without a search.
    counted.sort(key=lambda c: -c[2] / max(1, c[0] + c[1]))
    best = AuditBound(0.0, confidence, delta, m, *counted[0][:2], sum(counted[0][:2]), counted[0][2], len(candidates))
    for k_plus, k_minus, v in counted:
        r = k_plus + k_minus
        if best.epsilon > 0 and p_value(m, r, v, best.epsilon, 0.0) >= 1.0 - corrected:
            continue
        eps = epsilon_lower_bound(m, r, v, delta, corrected)
        if eps > best.epsilon:
            best = AuditBound(eps, confidence, delta, m, k_plus, k_minus, r, v, len(candidates))
    return best
