"""Canaries for the one-run audit: which are in, how they enter training, how they are scored.

What: m canaries, each included in training by its own fair coin (``draw_canaries``), of one
of two kinds:

- white-box gradient canaries (``kind="white"``): ``WhiteBoxCanaries`` wraps the model with a
  dedicated audit parameter ``canary_directions`` of shape (m, 1). Canary j is a dataset row
  (a copy of a "null" row plus its index j in an extra batch column) whose per-sample loss is
  ``C * canary_directions[j]`` instead of the model's loss, so its per-sample gradient is
  exactly C·e_j and zero on every model parameter: at the clipping threshold, along a
  coordinate no real row touches (real rows get exactly 0 there). ``WhiteBoxScores`` scores
  it from the released noisy gradient of that coordinate at every step.
- black-box input canaries (``kind="black"``): random byte sequences (labels = the sequence,
  so every position is a random label); scored after training by how much their loss fell.

Assumes: the coins are drawn before training from a stream no part of training reads (its
own ChaCha20 key from the OS, or a test-only seed with purpose "canaries"); canary rows are
rows of the sampler like any other, so each is one privacy unit, Poisson-sampled and clipped
on its own; an excluded canary never becomes a row.

Guarantees: the scores are functions of what a DP run releases (the noisy gradients, or the
final model) and of public constants, never of the coins or of which steps sampled a canary
(that is secret too: the accountant's amplification by sampling assumes nobody knows it), so
the one-run bound of ``bound.py`` applies to them.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..runtime.noise import KeyStream, key_from_insecure_seed

__all__ = ["Canaries", "draw_canaries", "WhiteBoxCanaries", "training_rows", "PublicDivisor", "WhiteBoxScores",
           "canary_losses"]

KINDS = ("white", "black")


@dataclass
class Canaries:
    """m canaries and the coins that decide which are in (SECRET to the auditor until scoring)."""

    kind: str  # "white" or "black"
    included: torch.Tensor  # (m,) bool
    ids: torch.Tensor | None = None  # (m, T) int64 byte sequences of black-box canaries

    @property
    def m(self) -> int:
        return int(self.included.numel())


def draw_canaries(m: int, kind: str, *, seq_len: int | None = None, vocab_size: int = 256,
                  insecure_seed: int | None = None) -> Canaries:
    """m fair coins (and, for black-box canaries, m random sequences of ``seq_len`` tokens).

    The stream is ChaCha20 keyed by 256 bits from the OS; ``insecure_seed`` (tests only, warns)
    derives the key from a public seed with its own purpose, so it never repeats the noise's
    or the sampler's stream.
    """
    if kind not in KINDS:
        raise ValueError(f"canary kind must be one of {KINDS}, got {kind!r}")
    if m < 1:
        raise ValueError(f"need at least one canary, got {m}")
    stream = KeyStream(None if insecure_seed is None else key_from_insecure_seed(insecure_seed, "canaries"))
    included = stream.uniform53(m) < 2 ** 52  # a fair coin: the top bit of a 53-bit uniform
    ids = None
    if kind == "black":
        if seq_len is None or seq_len < 2:
            raise ValueError(f"black-box canaries need seq_len >= 2, got {seq_len}")
        # Exactly uniform for a power-of-two vocabulary (256 bytes): 2**53 is a multiple of it.
        ids = (stream.uniform53(m * seq_len) % vocab_size).view(m, seq_len)
    return Canaries(kind, included, ids)


class WhiteBoxCanaries(nn.Module):
    """``model`` plus the audit parameter ``canary_directions`` (m, 1), zero-initialised.

    ``forward(*batch, canary)``: ``canary`` (B,) int64 is -1 for a real row and j for canary
    j. A real row's loss is ``model(*batch)``; canary j's is ``scale * (d_j - d_j.detach())``
    with d_j = ``canary_directions[j]``: value exactly 0 (training losses stay the model's),
    gradient ``scale`` along coordinate j, nothing on the model (``where`` gives its branch a
    zero cotangent). With ``scale`` = C the canary sits at the clipping threshold.
    """

    def __init__(self, model: nn.Module, canaries: int, scale: float):
        super().__init__()
        self.model = model
        self.scale = float(scale)
        self.canary_directions = nn.Parameter(torch.zeros(canaries, 1))

    def forward(self, *batch):
        *batch, canary = batch
        losses = self.model(*batch)
        is_canary = canary >= 0
        # An embedding lookup: its per-sample gradient is one sparse row, so no (B, m) tensor.
        index = torch.where(is_canary, canary, torch.zeros_like(canary))
        d = F.embedding(index[:, None], self.canary_directions)[:, 0, 0]
        return torch.where(is_canary, self.scale * (d - d.detach()), losses)


def training_rows(fields: tuple[torch.Tensor, ...], canaries: Canaries,
                  null_row: tuple[torch.Tensor, ...] | None = None) -> tuple[torch.Tensor, ...]:
    """The dataset the audit trains on: the real rows first (row 0 stays real: the sampler pads
    with it), then one row per INCLUDED canary; an excluded canary has no row at all.

    White-box: every field gets a copy of ``null_row`` (default: real row 0; its model loss is
    discarded) for each canary, and a last column holds -1 (real) or the canary's index.
    Black-box: ``fields`` must be (ids, labels), (N, T) or units of R rows (N, R, T); a canary is
    its sequence as both, in its unit's first row (the others padding: id 0, label -100).
    """
    n = fields[0].shape[0]
    chosen = canaries.included.nonzero().squeeze(1)
    if canaries.kind == "black":
        if len(fields) != 2:
            raise ValueError(f"black-box canaries need (ids, labels) rows, got {len(fields)} fields")
        ids = canaries.ids[chosen].to(fields[0].dtype)
        if fields[0].dim() == 3:
            unit = ids.new_zeros(ids.shape[0], *fields[0].shape[1:])
            unit[:, 0] = ids
            labels = torch.full_like(unit, -100)
            labels[:, 0] = ids
            return torch.cat([fields[0], unit]), torch.cat([fields[1], labels])
        return tuple(torch.cat([f, ids]) for f in fields)
    null_row = tuple(f[0] for f in fields) if null_row is None else null_row
    k = int(chosen.numel())
    out = [torch.cat([f, r.unsqueeze(0).expand(k, *r.shape).to(f.dtype)]) for f, r in zip(fields, null_row)]
    out.append(torch.cat([torch.full((n,), -1, dtype=torch.long), chosen]))
    return tuple(out)


class PublicDivisor:
    """A ``PoissonBatches`` whose logical batches divide by a fixed public E[B].

    The sampler's own divisor is q·N, and N counts the included canaries, so it would publish
    their number (a function of all the coins: outside what per-canary DP covers). Here it is
    q·(N_real + m/2), which depends on no coin; q and the sampling are the sampler's.
    """

    def __init__(self, batches, expected_size: float):
        self.batches = batches
        self.expected_batch_size = float(expected_size)
        self.sample_rate = batches.sample_rate

    def __iter__(self):
        for logical in self.batches:
            yield dataclasses.replace(logical, expected_size=self.expected_batch_size)

    def __len__(self) -> int:
        return len(self.batches)

    @property
    def step(self) -> int:
        return self.batches.step

    def state_dict(self) -> dict:
        return self.batches.state_dict()


class WhiteBoxScores:
    """Per-canary log-likelihood ratio of "included" against "excluded", step by step.

    At each step the released gradient of coordinate j, times E[B] and over C, is
    z = b + N(0, σ²) with b = 1 if canary j was sampled (probability q if included, never if
    excluded). The Neyman-Pearson score of all steps is Σ_t log(1 - q + q·exp((z_t - 1/2)/σ²)):
    it needs the public q and σ only, not which steps sampled the canary (secret). σ = 0:
    Σ_t z_t (exactly 0 for an excluded canary).
    """

    def __init__(self, canaries: int, *, noise_multiplier: float, sample_rate: float, max_grad_norm: float):
        self.sigma, self.q, self.c = float(noise_multiplier), float(sample_rate), float(max_grad_norm)
        self.llr = np.zeros(canaries, dtype=np.float64)
        self.steps = 0

    def observe(self, grad: torch.Tensor, expected_size: float) -> None:
        """Add one step: ``grad`` is ``canary_directions.grad`` after ``engine.finalize``."""
        z = grad.detach().to("cpu", torch.float64).flatten().numpy() * (expected_size / self.c)
        if self.sigma == 0:
            self.llr += z
        else:
            log_in = math.log(self.q) + (z - 0.5) / self.sigma ** 2
            self.llr += log_in if self.q == 1 else np.logaddexp(math.log1p(-self.q), log_in)
        self.steps += 1

    @property
    def scores(self) -> np.ndarray:
        return self.llr.copy()


@torch.no_grad()
def canary_losses(model: nn.Module, ids: torch.Tensor, batch_size: int = 16) -> np.ndarray:
    """Each black-box canary's summed next-token loss under ``model`` (a ``CausalLMLoss``), in
    eval mode (no dropout noise in the score); the model's mode is restored."""
    device, was_training = next(model.parameters()).device, model.training
    model.eval()
    try:
        out = [model(chunk.to(device), chunk.to(device)).double().cpu() for chunk in ids.split(batch_size)]
    finally:
        model.train(was_training)
    return torch.cat(out).numpy()
