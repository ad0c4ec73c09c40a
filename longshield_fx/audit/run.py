"""One DP training run with canaries, and what it reports: claimed ε beside the empirical bound.

What: ``run_audit`` trains ``model`` on ``fields`` plus the included canaries with the
library's own engine (``longshield_fx.compile``) and Poisson sampler, scores every canary and
returns an ``AuditReport``; ``write_report`` saves it as JSON and a score histogram (PNG). The
``longshield-fx audit`` command runs the same pieces inside the training loop of
``longshield-fx train``.

Assumes: ``model(*fields_row)`` returns per-sample losses (black-box canaries: a
``CausalLMLoss``, rows ``(ids, labels)``); everything on one device, one process.

Guarantees: the claimed ε is ``engine.epsilon(delta)`` of this very run (one row = one unit);
the bound is ``bound.audit_bound`` of the scores at the same δ; nothing outside the returned
report is changed (the caller's model is trained, as asked).
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

from ..api import compile as compile_engine
from ..data import PoissonBatches
from .bound import AuditBound, audit_bound
from .canaries import Canaries, PublicDivisor, WhiteBoxCanaries, WhiteBoxScores, canary_losses, training_rows

__all__ = ["AuditReport", "run_audit", "write_report", "score_histogram"]


@dataclass
class AuditReport:
    """The claimed ε and the empirical lower bound of one run, with what they rest on."""

    kind: str
    claimed_epsilon: float
    bound: AuditBound
    scores: np.ndarray = field(repr=False)
    included: np.ndarray = field(repr=False)
    run: dict = field(default_factory=dict)  # σ, q, steps, C, N, ...: public settings of the run

    def summary(self) -> dict:
        """JSON-ready: everything but the per-canary arrays."""
        return {"kind": self.kind, "claimed_epsilon": _finite_or_str(self.claimed_epsilon),
                "epsilon_lower_bound": self.bound.epsilon, **{k: v for k, v in asdict(self.bound).items()
                                                               if k != "epsilon"},
                "canaries_included": int(self.included.sum()), "run": self.run}

    def line(self) -> str:
        b = self.bound
        return (f"claimed ε = {_fmt(self.claimed_epsilon)}, empirical lower bound ε >= {b.epsilon:.3f} at "
                f"{b.confidence:.0%} confidence (δ = {b.delta:.3g}; {b.canaries} {self.kind}-box canaries; best of "
                f"{b.candidates} guess sets: {b.correct}/{b.guesses} right, {b.k_plus} 'in' + {b.k_minus} 'out')")


def _fmt(eps: float) -> str:
    return "inf (σ = 0: not private)" if math.isinf(eps) else f"{eps:.3f}"


def _finite_or_str(eps: float):
    return eps if math.isfinite(eps) else "inf"


def run_audit(model: nn.Module, fields: tuple[torch.Tensor, ...], canaries: Canaries, *, config, sample_rate: float,
              steps: int, physical_batch_size: int, delta: float, confidence: float = 0.95,
              guesses: list[tuple[int, int]] | None = None, null_row: tuple[torch.Tensor, ...] | None = None,
              optimizer: Callable | None = None, insecure_seed: int | None = None) -> AuditReport:
    """Train ``model`` with ``canaries`` (DP-SGD by ``config``, Poisson rate ``sample_rate``,
    ``steps`` logical batches) and return the claimed ε beside the one-run lower bound.

    ``optimizer``: a factory of the model's parameters (default AdamW, lr 1e-3).
    ``insecure_seed``: TESTS ONLY, seeds the sampler (the noise seed is ``config``'s).
    """
    white = canaries.kind == "white"
    net = WhiteBoxCanaries(model, canaries.m, config.max_grad_norm) if white else model
    device = next(model.parameters()).device
    net.to(device)
    engine = compile_engine(net, config=config)
    opt = (optimizer or (lambda p: torch.optim.AdamW(p, lr=1e-3)))(model.parameters())
    rows = training_rows(fields, canaries, null_row)
    sampler = PoissonBatches(TensorDataset(*rows), sample_rate, physical_batch_size, insecure_seed=insecure_seed,
                             steps=steps)
    batches = PublicDivisor(sampler, sample_rate * (fields[0].shape[0] + canaries.m / 2))
    recorder = WhiteBoxScores(canaries.m, noise_multiplier=config.noise_multiplier, sample_rate=sample_rate,
                              max_grad_norm=config.max_grad_norm) if white else None
    before = None if white else canary_losses(model, canaries.ids)
    for logical in batches:
        for batch, mask in logical.physical:
            engine.accumulate(*(t.to(device) for t in batch), mask=mask.to(device))
        engine.finalize(logical)
        if recorder is not None:  # the released gradient, before the optimizer reads it
            recorder.observe(net.canary_directions.grad, logical.expected_size)
        opt.step()
        opt.zero_grad(set_to_none=True)
    scores = recorder.scores if white else before - canary_losses(model, canaries.ids)
    included = canaries.included.numpy()
    run = {"noise_multiplier": config.noise_multiplier, "sample_rate": sample_rate, "steps": steps,
           "max_grad_norm": config.max_grad_norm, "real_rows": int(fields[0].shape[0]),
           "expected_batch_size": batches.expected_batch_size}
    return AuditReport(canaries.kind, engine.epsilon(delta), audit_bound(scores, included, delta, confidence, guesses),
                       scores, included, run)


def score_histogram(report: AuditReport, path: str | Path, title: str = "") -> Path:
    """Scores of the included and the excluded canaries, overlaid, as PNG (matplotlib, Agg);
    ``title`` is a first line above the claimed ε and the bound."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    scores, inc = report.scores, report.included
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=110)
    bins = np.histogram_bin_edges(scores, bins=60)
    ax.hist(scores[~inc], bins=bins, alpha=0.55, color="tab:blue", label=f"excluded ({int((~inc).sum())})")
    ax.hist(scores[inc], bins=bins, alpha=0.55, color="tab:red", label=f"included ({int(inc.sum())})")
    ax.set_yscale("log")
    ax.set_xlabel("canary score (white-box: log-likelihood ratio; black-box: loss before - after)")
    ax.set_ylabel("canaries")
    claim = (f"claimed ε {_fmt(report.claimed_epsilon)}, lower bound {report.bound.epsilon:.2f} at "
             f"{report.bound.confidence:.0%} confidence (δ = {report.bound.delta:.2g})")
    ax.set_title(f"{title}\n{claim}" if title else claim, fontsize=9)
    ax.legend(loc="upper right")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, format="png")
    plt.close(fig)
    return path


def write_report(report: AuditReport, out_dir: str | Path, title: str = "") -> tuple[Path, Path]:
    """``audit.json`` (the summary) and ``audit_scores.png`` in ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = out_dir / "audit.json"
    summary.write_text(json.dumps(report.summary(), indent=1) + "\n")
    return summary, score_histogram(report, out_dir / "audit_scores.png", title)
