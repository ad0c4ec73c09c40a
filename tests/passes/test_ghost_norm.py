"""ghost_norm: the per-layer choice, and ghost norms + book-keeping sums against the per-sample
path and the torch.func oracle."""
import math

import pytest
import torch
import torch.nn as nn
from expecttest import assert_expected_inline

import longshield_fx as lf
from longshield_fx.passes._graph import val

from oracles import hf_llama, logical, tiny_llama, token_batch, vmap_per_sample_grads

OFF = ("ghost_norm",)


def clipped(model, batch, C, *, disable=(), mask=None, checkpoint=None, **config):
    """(clipped sum as .grad, per-sample norms, engine): noise 0, divisor 1."""
    engine = lf.compile(model, config=lf.DPConfig(C, 0.0, **config), disable_passes=disable, checkpoint=checkpoint)
    engine.accumulate(*batch, mask=mask)
    engine.finalize(logical(batch[0].shape[0] if mask is None else int(mask.sum())))
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return out, engine.last_norms.clone(), engine


def assert_same_sums(ours, ref, rtol=1e-6):
    for name in ref:
        scale = ref[name].abs().max().clamp(min=1e-30)
        err = ((ours[name] - ref[name]).abs().max() / scale).item()
        assert err <= rtol, f"{name}: relative error {err:.2e}"


class Wide(nn.Module):
    """Per-token features into one Linear(64, 64): T=3 tokens are well inside ghost's range."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 64, bias=False)

    def forward(self, x):
        return self.fc(x).pow(2).sum((1, 2))


MASK = torch.tensor([1.0, 0.0, 1.0])


@pytest.fixture(scope="module")
def flat():
    """The tiny Llama on ``token_batch()`` with row 1 masked, flat clipping: (model, sums, norms, engine)."""
    model = tiny_llama()
    return (model, *clipped(model, token_batch(), 0.05, mask=MASK))


def test_choice_per_layer_and_no_per_sample_gradient_for_ghost_layers(flat):
    model, _, _, engine = flat
    lowered = engine.lower(*token_batch())
    methods = lowered.norm_methods
    assert_expected_inline("\n".join(f"{n}: {m}" for n, m in methods.items() if "layers.1" not in n), """\
lm.tok_embeddings.weight: per-sample (rule embedding)
lm.layers.0.attention_norm.weight: per-sample (rule sum)
lm.layers.0.attention.wq.weight: ghost (2T(p+d)=4096 ≤ p·d=4096)
lm.layers.0.attention.wk.weight: per-sample (2T(p+d)=3072 > p·d=2048)
lm.layers.0.attention.wv.weight: per-sample (2T(p+d)=3072 > p·d=2048)
lm.layers.0.attention.wo.weight: ghost (2T(p+d)=4096 ≤ p·d=4096)
lm.layers.0.ffn_norm.weight: per-sample (rule sum)
lm.layers.0.feed_forward.w1.weight: ghost (2T(p+d)=8192 ≤ p·d=12288)
lm.layers.0.feed_forward.w2.weight: ghost (2T(p+d)=8192 ≤ p·d=12288)
lm.layers.0.feed_forward.w3.weight: ghost (2T(p+d)=8192 ≤ p·d=12288)
lm.norm.weight: per-sample (rule sum)
lm.lm_head.weight: per-sample (rule lm_head_loss)""")
    # A ghost layer's (B, p, d) per-sample gradient is never formed; the others' are.
    shapes = {tuple(val(n).shape) for n in lowered.gm.graph.nodes if n.op == "call_function" and val(n) is not None}
    params = dict(model.named_parameters())
    for name, method in methods.items():
        if "attention.w" in name or "feed_forward" in name:
            assert ((3, *params[name].shape) in shapes) == method.startswith("per-sample"), name
    # float64 Grams per layer: wq and wo in two chunks of samples (so their float64 copies stay
    # below their (B, 64, 64) gradients) x (L, R) = 8; w1, w2, w3 in one chunk: three L and
    # two R, since w1 and w3 read the same input = 5.
    grams = [n for n in lowered.gm.graph.nodes if n.target == torch.ops.aten.bmm.default
             and val(n).dtype == torch.float64]
    assert len(grams) == 2 * (8 + 5)


def test_flat_ghost_equals_per_sample_path_and_oracle_norms(flat):
    model, ghost, norms, _ = flat
    plain, plain_norms, _ = clipped(model, token_batch(), 0.05, mask=MASK, disable=OFF)
    assert_same_sums(ghost, plain)
    ref = vmap_per_sample_grads(model, token_batch())
    ref_norms = torch.sqrt(sum(g.double().pow(2).flatten(1).sum(1) for g in ref.values()))
    torch.testing.assert_close(norms, ref_norms * MASK.double(), rtol=1e-6, atol=0)
    torch.testing.assert_close(plain_norms, norms, rtol=1e-6, atol=0)


def test_per_layer_clipping_ghost_equals_per_sample_path(tiny, tokens):
    ghost, norms, _ = clipped(tiny, tokens, 0.05, mask=MASK, clipping="per_layer")
    plain, plain_norms, _ = clipped(tiny, tokens, 0.05, mask=MASK, clipping="per_layer", disable=OFF)
    assert_same_sums(ghost, plain)
    torch.testing.assert_close(plain_norms, norms, rtol=1e-6, atol=0)


@pytest.mark.parametrize("make,T,checkpoint", [(hf_llama, 8, None), (lambda: tiny_llama(n_layers=3), 24, "block")])
def test_ghost_equals_per_sample_path_on_hf_llama_and_under_checkpointing(make, T, checkpoint):
    """Block checkpointing with ghost against neither: the kept L and R may be recomputed copies."""
    model = make()
    batch = token_batch(B=2, T=T, vocab=128)
    ghost, _, engine = clipped(model, batch, 0.05, checkpoint=checkpoint)
    assert sum(m.startswith("ghost") for m in engine.lower(*batch).norm_methods.values()) >= 2
    plain, _, _ = clipped(model, batch, 0.05, disable=OFF)
    assert_same_sums(ghost, plain)


class CastWeight(nn.Module):
    """A weight used in another dtype (as autocast does): its gradient reaches the fp32
    parameter through a cast of the per-sample einsum."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(64, 64) / 8)

    def forward(self, x):
        return torch.nn.functional.linear(x.double(), self.weight.double()).pow(2).sum((1, 2))


def test_weight_used_through_a_cast_takes_ghost_norm_with_the_same_sums():
    torch.manual_seed(0)
    model, x = CastWeight(), torch.randn(4, 3, 64)
    ghost, norms, engine = clipped(model, (x,), 1.0)
    assert engine.lower(x).norm_methods["weight"].startswith("ghost")
    plain, plain_norms, _ = clipped(model, (x,), 1.0, disable=OFF)
    assert_same_sums(ghost, plain)
    torch.testing.assert_close(norms, plain_norms, rtol=1e-6, atol=0)


def test_padding_row_of_infinities_contributes_exactly_zero_and_nonfinite_real_sample_is_dropped():
    torch.manual_seed(0)
    model, x = Wide(), torch.randn(4, 3, 64)
    kept = torch.tensor([1.0, 0.0, 1.0, 1.0])
    clean, _, engine = clipped(model, (x,), 1.0, mask=kept)
    assert engine.lower(x).norm_methods["fc.weight"].startswith("ghost")
    poisoned = x.clone()
    poisoned[1] = float("inf")  # a padding row of garbage
    garbage, _, _ = clipped(model, (poisoned,), 1.0, mask=kept)
    for name in clean:
        assert torch.equal(garbage[name], clean[name]), name
    with pytest.warns(RuntimeWarning, match="1 real sample.*NOT covered by ε"):
        dropped, norms, engine = clipped(model, (poisoned,), 1.0)  # now row 1 is real
    assert not torch.isfinite(norms[1]) and engine.nonfinite_samples == 1
    for name in clean:
        assert torch.equal(dropped[name], clean[name]), name


def test_fp16_sample_whose_materialised_gradient_overflows_is_clipped_not_dropped():
    """The fp16 per-sample gradient of this sample overflows (tests/passes/test_clip.py drops
    it); ghost norm never forms it: float64 Grams of its fp16 factors give the true norm, so
    the sample is clipped to C like any other."""
    torch.manual_seed(0)
    model, x = Wide(), torch.randn(4, 3, 64)
    x[1] = 300.0
    x = x.half()
    mask = torch.tensor([0.0, 1.0, 0.0, 0.0])
    alone, norms, engine = clipped(model, (x,), 1.0, mask=mask, compute_dtype=torch.float16)
    assert engine.nonfinite_samples == 0 and torch.isfinite(norms[1]) and norms[1] > 65504
    contribution = math.sqrt(sum(g.double().pow(2).sum().item() for g in alone.values()))
    assert 1.0 * (1 - 1e-5) <= contribution <= 1.0 * (1 + 1e-6)
