"""``DPConfig``: the differential-privacy settings of a compiled training step."""
from __future__ import annotations

from dataclasses import dataclass

import torch

CLIPPING_MODES = ("flat", "per_layer", "automatic")


@dataclass(frozen=True)
class DPConfig:
    """DP-SGD settings.

    max_grad_norm: clipping threshold C (> 0).
    noise_multiplier: σ (≥ 0); ``finalize`` adds N(0, σ²C²) once per coordinate.
    clipping: "flat" (one norm over all parameters, default), "per_layer" (each parameter
        a group with threshold C/sqrt(K)), or "automatic" (C / (‖g‖ + automatic_gamma)).
    secure_rng: the noise is always drawn from a ChaCha20 stream keyed by 256 bits from the
        operating system (``runtime/noise.py``); True (default) also guards against
        floating-point attacks by summing four draws per value (Opacus' secure mode), at four
        times the stream. False draws one value per coordinate from the same secret stream.
    insecure_seed: TESTS ONLY. Derives the noise key from this public seed (with a warning):
        anyone who knows it can regenerate the noise and subtract it, so no privacy holds.
    compute_dtype: dtype of the forward/backward (e.g. torch.bfloat16); parameters stay in
        their own dtype, norms and sums are fp32, and there is no loss scaling (a scaled
        loss would scale the clipping threshold, see dp-zero.md appendix C).
    accountant: "pld" (default, the tightest) or "rdp" (both from dp-accounting).
    per_sample_comm: under context parallelism, "input_stationary" (default: local einsum,
        then reduce-scatter; bytes constant in T) or "output_stationary" (gather activations
        and activation gradients, then a local einsum; bytes grow with T), longshield.md 3.2.
    loss_chunk: rows of logits (positions, over the whole batch) the LM head's cross-entropy
        forms at a time (the ``chunked_loss`` pass): the (B, T, V) logits are never held, one
        chunk of (loss_chunk, V) is. Larger chunks: fewer, bigger matmuls.
    """

    max_grad_norm: float
    noise_multiplier: float
    clipping: str = "flat"
    secure_rng: bool = True
    compute_dtype: torch.dtype = torch.float32
    automatic_gamma: float = 0.01
    accountant: str = "pld"
    per_sample_comm: str = "input_stationary"
    insecure_seed: int | None = None
    loss_chunk: int = 1024

    def __post_init__(self):
        if not (isinstance(self.max_grad_norm, (int, float)) and self.max_grad_norm > 0):
            raise ValueError(f"DPConfig: max_grad_norm must be > 0, got {self.max_grad_norm!r}")
        if not (isinstance(self.noise_multiplier, (int, float)) and self.noise_multiplier >= 0):
            raise ValueError(f"DPConfig: noise_multiplier must be >= 0, got {self.noise_multiplier!r}")
        if self.clipping not in CLIPPING_MODES:
            raise ValueError(f"DPConfig: clipping must be one of {CLIPPING_MODES}, got {self.clipping!r}")
        if self.insecure_seed is not None and not isinstance(self.insecure_seed, int):
            raise ValueError(f"DPConfig: insecure_seed must be an int or None, got {self.insecure_seed!r}")
        if not (isinstance(self.loss_chunk, int) and self.loss_chunk >= 1):
            raise ValueError(f"DPConfig: loss_chunk must be an int >= 1, got {self.loss_chunk!r}")
        if self.automatic_gamma <= 0:
            raise ValueError(f"DPConfig: automatic_gamma must be > 0, got {self.automatic_gamma!r}")
        if self.accountant not in ("rdp", "pld"):
            raise ValueError(f"DPConfig: accountant must be 'rdp' or 'pld', got {self.accountant!r}")
        if self.per_sample_comm not in ("input_stationary", "output_stationary"):
            raise ValueError(f"DPConfig: per_sample_comm must be 'input_stationary' or 'output_stationary', "
                             f"got {self.per_sample_comm!r}")
        if self.compute_dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            raise ValueError(f"DPConfig: compute_dtype must be a float dtype, got {self.compute_dtype!r}")
