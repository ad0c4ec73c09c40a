"""Empirical privacy audit in one training run (Steinke, Nasr and Jagielski, NeurIPS 2023).

``bound`` computes the ε lower bound from canary guesses; ``canaries`` makes white-box gradient
canaries and black-box input canaries and scores them; ``run`` trains once with canaries and
reports the claimed ε beside the bound (``longshield-fx audit`` is the command-line form).
Nothing here is used by ``compile`` or ``longshield-fx train``: a run without the audit never
sees a canary.
"""
from .bound import AuditBound, audit_bound, count_correct, default_guesses, epsilon_lower_bound, p_value
from .canaries import (Canaries, PublicDivisor, WhiteBoxCanaries, WhiteBoxScores, canary_losses, draw_canaries,
                       training_rows)
from .run import AuditReport, run_audit, score_histogram, write_report

__all__ = ["AuditBound", "audit_bound", "count_correct", "default_guesses", "epsilon_lower_bound", "p_value",
           "Canaries", "PublicDivisor", "WhiteBoxCanaries", "WhiteBoxScores", "canary_losses", "draw_canaries",
           "training_rows", "AuditReport", "run_audit", "score_histogram", "write_report"]
