"""longshield_fx: differentially private training of long-context models by graph rewriting.

Public API: ``compile``, ``DPConfig``, ``CausalLMLoss`` (``PackedCausalLMLoss`` for packed
documents, ``packing.pack_documents``), ``calibrate_noise``,
``per_sample_rule``, ``UnsupportedModelError``, ``data.PoissonBatches``,
``save_checkpoint`` / ``load_checkpoint`` (DCP: model, optimizer and engine state, resumable
on another number of ranks) and ``documents.load_documents`` (imported on use:
``from longshield_fx.documents import ...``).
"""
from . import data
from .api import compile
from .capture import capture
from .config import DPConfig
from .errors import UnsupportedModelError
from .losses import CausalLMLoss, PackedCausalLMLoss
from .passes.per_sample import per_sample_rule
from .runtime.calibration import calibrate_noise
from .runtime.dcp import load as load_checkpoint, save as save_checkpoint

__all__ = ["compile", "capture", "DPConfig", "CausalLMLoss", "PackedCausalLMLoss", "calibrate_noise", "per_sample_rule",
           "UnsupportedModelError", "data", "load_checkpoint", "save_checkpoint"]
