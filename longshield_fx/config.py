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
    sample_rate: Poisson sampling rate q, for privacy accounting (``engine.epsilon``).
    seed: seed of the noise generator; None draws it from the operating system.
    secure_rng: seed the noise generator from the operating system's entropy; refuses ``seed``
        (which is what a None seed does too: the flag makes it impossible to pass one by
        mistake). The generator itself is torch's (Mersenne Twister on CPU, Philox on CUDA),
        not a cryptographically secure one.
    compute_dtype: dtype of the forward/backward (e.g. torch.bfloat16); parameters stay in
        their own dtype, norms and sums are fp32, and there is no loss scaling (a scaled
        loss would scale the clipping threshold, see dp-zero.md appendix C).
    accountant: "rdp" or "pld" (both from dp-accounting).
    per_sample_comm: under context parallelism, "input_stationary" (default: local einsum,
        then reduce-scatter; bytes constant in T) or "output_stationary" (gather activations
        and activation gradients, then a local einsum; bytes grow with T), longshield.md 3.2.
    """

    max_grad_norm: float
    noise_multiplier: float
    clipping: str = "flat"
    sample_rate: float | None = None
    seed: int | None = None
    secure_rng: bool = False
    compute_dtype: torch.dtype = torch.float32
    automatic_gamma: float = 0.01
    accountant: str = "rdp"
    per_sample_comm: str = "input_stationary"

    def __post_init__(self):
        if not (isinstance(self.max_grad_norm, (int, float)) and self.max_grad_norm > 0):
            raise ValueError(f"DPConfig: max_grad_norm must be > 0, got {self.max_grad_norm!r}")
        if not (isinstance(self.noise_multiplier, (int, float)) and self.noise_multiplier >= 0):
            raise ValueError(f"DPConfig: noise_multiplier must be >= 0, got {self.noise_multiplier!r}")
        if self.clipping not in CLIPPING_MODES:
            raise ValueError(f"DPConfig: clipping must be one of {CLIPPING_MODES}, got {self.clipping!r}")
        if self.sample_rate is not None and not 0 < self.sample_rate <= 1:
            raise ValueError(f"DPConfig: sample_rate must be in (0, 1], got {self.sample_rate!r}")
        if self.secure_rng and self.seed is not None:
            raise ValueError("DPConfig: secure_rng=True draws the noise seed from the operating system; "
                             "do not pass seed (or set secure_rng=False for reproducible noise)")
        if self.automatic_gamma <= 0:
            raise ValueError(f"DPConfig: automatic_gamma must be > 0, got {self.automatic_gamma!r}")
        if self.accountant not in ("rdp", "pld"):
            raise ValueError(f"DPConfig: accountant must be 'rdp' or 'pld', got {self.accountant!r}")
        if self.per_sample_comm not in ("input_stationary", "output_stationary"):
            raise ValueError(f"DPConfig: per_sample_comm must be 'input_stationary' or 'output_stationary', "
                             f"got {self.per_sample_comm!r}")
        if self.compute_dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            raise ValueError(f"DPConfig: compute_dtype must be a float dtype, got {self.compute_dtype!r}")
