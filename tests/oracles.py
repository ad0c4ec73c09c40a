"""Shared test oracles and tiny models."""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

import longshield_fx as lf
from longshield_fx.data import LogicalBatch
from longshield_fx.models import Llama


def logical(size: int, expected_size: float = 1.0, sample_rate: float = 1.0) -> LogicalBatch:
    """A logical batch of ``size`` real samples, for ``engine.finalize`` in tests that pass
    their physical batches by hand (``expected_size`` is the divisor)."""
    return LogicalBatch(size=size, indices=torch.arange(size), physical=[], sample_rate=sample_rate,
                        expected_size=expected_size)


def vmap_per_sample_grads(model: nn.Module, batch) -> dict:
    """The oracle: torch.func per-sample gradients of each sample's loss."""
    params = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}
    buffers = {k: v.detach() for k, v in model.named_buffers()}

    def loss(p, *sample):
        return functional_call(model, (p, buffers), tuple(s[None] for s in sample)).sum()

    return vmap(grad(loss), in_dims=(None, *([0] * len(batch))))(params, *batch)


class MLP(nn.Module):
    """Two linear layers with biases; per-sample loss is summed over a token axis."""

    def __init__(self, d_in=6, hidden=8, classes=3):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x, y):
        logits = self.fc2(F.relu(self.fc1(x)))  # (B, T, C)
        return F.cross_entropy(logits.transpose(1, 2), y, reduction="none").sum(1)


def mlp_batch(B=4, T=5, d_in=6, classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, d_in, generator=g), torch.randint(0, classes, (B, T), generator=g)


def tiny_llama(seed=0, **overrides):
    torch.manual_seed(seed)
    return lf.CausalLMLoss(Llama.from_name("tiny", **overrides))


def token_batch(B=3, T=16, vocab=256, seed=0):
    ids = torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))
    return ids, ids.clone()


def hf_llama(seed=0):
    import transformers
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   attn_implementation="sdpa")
    return lf.CausalLMLoss(transformers.LlamaForCausalLM(cfg))


def hf_gpt2(seed=0):
    import transformers
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None,
                                  eos_token_id=None, tie_word_embeddings=True, attn_implementation="sdpa")
    return lf.CausalLMLoss(transformers.GPT2LMHeadModel(cfg))
