"""Reference models used by tests, benchmarks and the CLI."""

from longshield_fx.models.llama import CONFIGS, Llama, LlamaConfig

__all__ = ["CONFIGS", "Llama", "LlamaConfig"]
