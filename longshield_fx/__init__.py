"""longshield_fx: differentially private training of long-context models by graph rewriting.

Public API: ``compile``, ``DPConfig``, ``CausalLMLoss``, ``calibrate_noise``,
``per_sample_rule``, ``UnsupportedModelError``, ``data.PoissonBatches`` and
``documents.load_documents`` (imported on use: ``from longshield_fx.documents import ...``).
"""
from . import data
from .api import compile
from .capture import capture
from .config import DPConfig
from .errors import UnsupportedModelError
from .losses import CausalLMLoss
from .passes.per_sample import per_sample_rule
from .runtime.calibration import calibrate_noise

__all__ = ["compile", "capture", "DPConfig", "CausalLMLoss", "calibrate_noise", "per_sample_rule",
           "UnsupportedModelError", "data"]
