"""A small, plain reference Llama (RMSNorm, RoPE, GQA, SwiGLU) for tests, benchmarks and the CLI.

The model is written so that capturing it as an FX graph is uneventful:

- no buffers at all: the RoPE tables are computed from ``position_ids`` inside ``forward``, so
  a graph captured for one sequence shard works for any shard once it is handed the shard's
  global positions, and meta / fake-tensor construction never has to materialise a table;
- attention is a single ``scaled_dot_product_attention(..., is_causal=True)`` call after an
  explicit ``repeat_interleave`` of the K/V heads, so the context-parallel pass finds one
  attention op with equal head counts on q, k and v;
- no hooks, no dropout, no KV cache.

The layout and numerics follow Hugging Face's ``LlamaForCausalLM`` (rotate-half RoPE over the
full head dim, RMSNorm in fp32, ``repeat_kv`` order), so HF weights port by renaming only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops  # noqa: F401  (registers longshield::ring_attention, the packed documents' attention)


@dataclass
class LlamaConfig:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    max_seq_len: int  # context length the shape is meant for; forward does not enforce it, the CLI warns past it
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


CONFIGS: dict[str, LlamaConfig] = {
    # Byte-level toy shapes for tests and quick runs.
    "tiny": LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                        ffn_dim=192, max_seq_len=2048, rope_theta=10000.0),
    "small": LlamaConfig(vocab_size=256, dim=256, n_layers=4, n_heads=8, n_kv_heads=2,
                         ffn_dim=768, max_seq_len=4096, rope_theta=10000.0),
    # Real Llama 3 shapes (as in the released HF configs, without Llama 3's long-context
    # rope scaling, which only changes RoPE frequencies, not shapes or parameter counts).
    "llama3.2-1b": LlamaConfig(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                               ffn_dim=8192, max_seq_len=131072, tie_embeddings=True),
    "llama3.2-3b": LlamaConfig(vocab_size=128256, dim=3072, n_layers=28, n_heads=24, n_kv_heads=8,
                               ffn_dim=8192, max_seq_len=131072, tie_embeddings=True),
    "llama3.1-8b": LlamaConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                               ffn_dim=14336, max_seq_len=131072, tie_embeddings=False),
}


class RMSNorm(nn.Module):
    """RMSNorm with a weight only; normalises in fp32 and casts back before the weight, as HF does."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin tables of shape (B, T, head_dim) for (B, T) positions (B may be 1).

    Computed in fp32 from the positions on every call (HF's convention: frequencies repeated
    over both halves of the head dim), so the positions may be global positions of a shard.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=position_ids.device,
                                             dtype=torch.float32) / head_dim))
    freqs = position_ids[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, H, T, D) by position; cos/sin are (B, T, D) and broadcast over heads."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                segment_ids: torch.Tensor | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if segment_ids is not None:
            # Packed documents: the document attention op (one process of the ring op; under
            # context parallelism the context_parallel pass gives it the ring), K/V un-repeated.
            out, _ = torch.ops.longshield.ring_attention(q, k, v, self.head_dim ** -0.5, "", 1, 0, segment_ids)
            return self.wo(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))
        # Explicit GQA expansion (query head h uses kv head h // n_rep, as HF's repeat_kv), so
        # the attention op itself sees equal head counts.
        n_rep = self.n_heads // self.n_kv_heads
        k = k.repeat_interleave(n_rep, dim=1)
        v = v.repeat_interleave(n_rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x); w1 = gate, w3 = up, w2 = down."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                segment_ids: torch.Tensor | None = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, segment_ids)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """Decoder-only Llama returning logits (B, T, vocab_size).

    With ``tie_embeddings`` the output head shares ``tok_embeddings.weight``; ``named_parameters``
    then lists the shared tensor once, as ``tok_embeddings.weight``.
    """

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        assert cfg.dim % cfg.n_heads == 0 and cfg.n_heads % cfg.n_kv_heads == 0, cfg
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_embeddings.weight
        self.reset_parameters()

    @classmethod
    def from_name(cls, name: str, **overrides) -> "Llama":
        """Build a model from a ``CONFIGS`` entry, replacing any config fields given as keywords."""
        return cls(dataclasses.replace(CONFIGS[name], **overrides))

    def reset_parameters(self) -> None:
        """N(0, 0.02) for every matrix and the embedding, ones for norms: a random model starts
        near the uniform-prediction loss log(vocab_size)."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                segment_ids: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids (B, T) -> logits (B, T, V).

        ``position_ids`` (B, T) or (1, T) default to ``arange(T)`` as (1, T), broadcast over the
        batch; pass global positions when the sequence is sharded. ``segment_ids`` (B, T), for
        packed documents: a token attends only to the tokens at or before it with its segment id.
        """
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        h = self.tok_embeddings(input_ids)
        cos, sin = rope_cos_sin(position_ids, self.cfg.head_dim, self.cfg.rope_theta, h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin, segment_ids)
        return self.lm_head(self.norm(h))
