"""clip: flat clipping equals Opacus; contributions are bounded; padding contributes nothing."""
import math

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings, strategies as st

import longshield_fx as lf
from longshield_fx.models.llama import RMSNorm

import opacus
from opacus.grad_sample import register_grad_sampler

from oracles import MLP, hf_gpt2, logical, mlp_batch, tiny_llama, token_batch, vmap_per_sample_grads


def clipped_sum(model, batch, C, clipping="flat", mask=None, engine=None, **config):
    """The clipped sum as ``.grad`` (noise 0, divisor 1). ``engine``: reuse one compiled for
    ``model`` with the same C and clipping (the mask is a graph input: no recapture)."""
    engine = engine or lf.compile(model, config=lf.DPConfig(C, 0.0, clipping=clipping, **config))
    engine.accumulate(*batch, mask=mask)
    size = batch[0].shape[0] if mask is None else int(mask.sum())
    engine.finalize(logical(size, 1.0))  # noise 0 and divide by 1: .grad is the clipped sum
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return out, engine


def opacus_clipped_sum(model, batch, C):
    @register_grad_sampler(RMSNorm)
    def rmsnorm_grad_sample(layer, activations, backprops):
        x = activations[0].float()
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + layer.eps)
        return {layer.weight: torch.einsum("b...d,b...d->bd", backprops, normed.to(x.dtype))}

    gsm = opacus.GradSampleModule(model, batch_first=True, loss_reduction="sum")
    opt = opacus.optimizers.DPOptimizer(torch.optim.SGD(gsm.parameters(), lr=0.0), noise_multiplier=0.0,
                                        max_grad_norm=C, expected_batch_size=batch[0].shape[0],
                                        loss_reduction="sum")
    gsm(*batch).sum().backward()
    opt.pre_step()
    out = {n.removeprefix("_module."): p.grad.clone() for n, p in gsm.named_parameters()}
    gsm._close()
    return out


@pytest.mark.parametrize("make", ["mlp", "llama"])
def test_flat_clipping_equals_opacus(make, tiny, tokens):
    model, batch, C = (MLP(), mlp_batch(), 0.5) if make == "mlp" else (tiny, tokens, 1.0)
    ours, engine = clipped_sum(model, batch, C)
    assert engine.last_norms.gt(C).any(), "the test must clip something"
    theirs = opacus_clipped_sum(model, batch, C)
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], atol=1e-5, rtol=1e-4, msg=name)


def test_clipped_sum_with_rows_shared_by_every_sample_equals_per_sample_oracle():
    """GPT-2's learned position embedding: its gradient rows have the same ids in every sample
    (an expanded, stride-0 id tensor), which the sparse clipped sum must flatten by copy."""
    model, C = hf_gpt2(), 0.05
    batch = (torch.randint(0, 128, (3, 24), generator=torch.Generator().manual_seed(0)),) * 2
    ours, engine = clipped_sum(model, batch, C)
    assert engine.last_norms.gt(C).all(), "every sample must be clipped"
    per_sample = vmap_per_sample_grads(model, batch)
    norms = torch.sqrt(sum(g.double().pow(2).flatten(1).sum(1) for g in per_sample.values()))
    factors = (C / (norms + 1e-6)).clamp(max=1.0).float()
    for name, g in per_sample.items():
        torch.testing.assert_close(ours[name], torch.einsum("b,b...->...", factors, g), atol=1e-6, rtol=1e-4,
                                   msg=name)


def per_sample_contributions(model, batch, C, clipping, engine):
    """Each sample's contribution, by running the engine on that sample alone (others masked)."""
    B = batch[0].shape[0]
    out = []
    for i in range(B):
        mask = torch.zeros(B)
        mask[i] = 1
        grads, _ = clipped_sum(model, batch, C, clipping, mask, engine)
        out.append(grads)
    return out


def flat_norm(grads):
    return math.sqrt(sum(float(g.pow(2).sum()) for g in grads.values()))


@settings(max_examples=8, deadline=None)
@given(B=st.integers(1, 4), T=st.integers(1, 4), hidden=st.integers(1, 6), C=st.floats(0.05, 5.0),
       seed=st.integers(0, 1000), clipping=st.sampled_from(["flat", "per_layer", "automatic"]))
def test_each_contribution_is_bounded(B, T, hidden, C, seed, clipping):
    torch.manual_seed(seed)
    model = MLP(hidden=hidden)
    batch = mlp_batch(B=B, T=T, seed=seed)
    engine = lf.compile(model, config=lf.DPConfig(C, 0.0, clipping=clipping))  # one capture for every mask
    contributions = per_sample_contributions(model, batch, C, clipping, engine)
    total, _ = clipped_sum(model, batch, C, clipping, engine=engine)
    for name in total:  # contributions add up to the clipped sum
        torch.testing.assert_close(sum(c[name] for c in contributions), total[name], atol=1e-5, rtol=1e-4)
    for c in contributions:
        assert flat_norm(c) <= C * (1 + 1e-5)
        if clipping == "per_layer":  # each parameter is a group with threshold C / sqrt(K)
            threshold = C / math.sqrt(len(c))
            assert all(float(g.norm()) <= threshold * (1 + 1e-5) for g in c.values())
    # Removing one sample (masking it out) changes the pre-noise sum by at most C.
    mask = torch.ones(B)
    mask[0] = 0
    without, _ = clipped_sum(model, batch, C, clipping, mask, engine)
    assert engine.captures == 1
    assert flat_norm({n: total[n] - without[n] for n in total}) <= C * (1 + 1e-5)


def test_unclipped_when_threshold_is_large(tiny_per_sample):
    model, batch = tiny_llama(), tiny_per_sample.batch  # the same seed as the shared oracle's model
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), tiny_per_sample.model.parameters()))
    ours, _ = clipped_sum(model, batch, 1e6)
    ref = tiny_per_sample.ref
    assert set(ours) == set(ref)
    for name in ours:
        torch.testing.assert_close(ours[name], ref[name].sum(0), atol=1e-5, rtol=1e-4)


def test_padding_rows_contribute_exactly_zero_even_with_garbage():
    class Fragile(nn.Module):
        """sqrt of a negative input gives nan for garbage rows."""

        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 2)

        def forward(self, x):
            return self.fc(torch.sqrt(x)).pow(2).sum(1)

    torch.manual_seed(0)
    model = Fragile()
    x = torch.rand(4, 3)
    garbage = x.clone()
    garbage[2:] = -1.0  # nan after sqrt
    mask = torch.tensor([1.0, 1.0, 0.0, 0.0])
    clean, _ = clipped_sum(model, (x[:2],), 1.0)
    padded, engine = clipped_sum(model, (garbage,), 1.0, mask=mask)
    for name in clean:
        assert torch.isfinite(padded[name]).all()
        torch.testing.assert_close(padded[name], clean[name])
    assert engine.last_norms[2:].eq(0).all()


def test_a_dense_per_sample_gradient_is_formed_once_for_its_norm_and_its_sum():
    """A tied embedding's per-sample gradient (the head's (B, V, d) plus the embedding's rows, an
    index_add of token ids) is formed once, and both its norm and its clipped sum read it: a CUDA
    index_add of repeated ids adds in no fixed order, so two formings could round apart, and the
    sum would then carry a gradient whose norm is not the one its factor was computed from."""
    model, batch = tiny_llama(tie_embeddings=True), token_batch(B=4)
    gm = lf.compile(model, config=lf.DPConfig(1.0, 0.0)).lower(*batch).gm
    formed = [n for n in gm.graph.nodes if n.target is torch.ops.aten.index_add.default
              and n.meta["val"].dim() == 2 and n.meta["val"].shape[0] % 4 == 0 and n.meta["val"].shape[0] > 4]
    assert formed
    for node in formed:
        seen, todo = set(), [node]
        while todo:
            for user in todo.pop().users:
                if user not in seen:
                    seen.add(user)
                    todo.append(user)
        reads = {u.target for u in seen}
        assert torch.ops.aten.linalg_vector_norm.default in reads and torch.ops.aten.einsum.default in reads, node.name


def test_embedding_norm_from_token_ids_matches_dense():
    """Repeated tokens within a sample: the sparse-row norm must add rows before squaring."""
    model = tiny_llama()
    ids = torch.tensor([[5, 5, 5, 7, 5, 9, 7, 5], [1, 2, 3, 4, 5, 6, 7, 8]])
    ours, engine = clipped_sum(model, (ids, ids), 1e6)
    ref = vmap_per_sample_grads(model, (ids, ids))
    dense_norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in ref.values()))
    assert engine.last_norms.dtype == torch.float64
    torch.testing.assert_close(engine.last_norms, dense_norms.double(), atol=1e-5, rtol=1e-5)


class Features(nn.Module):
    """A per-token linear layer whose per-sample loss can be made non-finite by its input."""

    def __init__(self, d_in=6, d_out=4):
        super().__init__()
        self.fc = nn.Linear(d_in, d_out)

    def forward(self, x):
        return self.fc(x).pow(2).sum((1, 2))


@pytest.mark.parametrize("how", ["inf feature", "fp16 overflow"])
def test_nonfinite_real_sample_contributes_zero_and_is_counted(how):
    torch.manual_seed(0)
    x = torch.randn(4, 3, 6)
    config = {}
    if how == "inf feature":
        x[1, 2, 0] = float("inf")
    else:  # finite input whose square overflows fp16's 65504
        x[1] = 300.0
        x = x.half()
        config = {"compute_dtype": torch.float16}
    kept = torch.tensor([1.0, 0.0, 1.0, 1.0])
    model = Features()
    # The overflow is in the fp16 per-sample gradient itself, which ghost norm never forms
    # (tests/passes/test_ghost_norm.py): materialise it.
    engine = lf.compile(model, config=lf.DPConfig(1.0, 0.0, **config), disable_passes=("ghost_norm",))
    without, _ = clipped_sum(model, (x,), 1.0, mask=kept, engine=engine)
    with pytest.warns(RuntimeWarning, match="1 real sample.*NOT covered by ε"):
        poisoned, engine = clipped_sum(model, (x,), 1.0, engine=engine)
    assert not torch.isfinite(engine.last_norms[1]) and engine.nonfinite_samples == 1
    for name in without:  # the other samples' clipped sum is unchanged, bit for bit
        assert torch.equal(poisoned[name], without[name]), name
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for name, p in model.named_parameters():
        p.grad = poisoned[name]
    opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_clipped_contribution_of_an_8m_entry_parameter_stays_within_c():
    """Norms summed in float64: one sample's clipped contribution, measured in float64, ≤ C(1+1e-6)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 32768, bias=False))
    assert model[0].weight.numel() >= 8_000_000

    class Loss(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = model

        def forward(self, x):
            return self.net(x).sum((1, 2))

    x = torch.randn(1, 64, 256) * 10 + 3  # large, same-signed sums: fp32 rounding shows
    C = 1e-3
    grads, engine = clipped_sum(Loss(), (x,), C)
    norm = float(torch.linalg.vector_norm(grads["net.0.weight"].double()))
    assert float(engine.last_norms[0]) > 1e6 * C  # clipping is active, by far
    assert norm <= C * (1 + 1e-6), norm / C - 1
    assert norm >= C * (1 - 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("packed", [False, True])
def test_a_clip_factor_below_fp32s_smallest_normal_number_gives_no_contribution(packed, dtype):
    """A per-sample gradient of norm ~1e40·C (finite in fp32: entries near 3e38) has a float64
    factor below 2**-126, which fp32 holds only as a subnormal, rounded with an error of up to
    2**-150 / factor (5e-4 of it here): that sample contributes 0 instead, the other its own.
    In float64 its entries (1e42) lie beyond fp32's range: scaled before the cast to fp32, never
    inf (inf times its factor 0 would be nan in every coordinate of the sum)."""

    class Outer(nn.Module):  # Σ_t v_t · W x_t with W = 0: the loss 0, the gradient Σ_t v_t x_tᵀ
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(256, 256, bias=False)
            nn.init.zeros_(self.fc.weight)

        def forward(self, x, v, *units):
            per_token = (self.fc(x) * v).sum(-1)
            return (per_token * (units[0] >= 0)).sum(1) if units else per_token.sum(1)

    x = torch.ones(2, 1, 256, dtype=dtype)
    v = torch.full((2, 1, 256), 3.0e38 if dtype == torch.float32 else 1e42, dtype=dtype)
    v[1] = 1e-3  # an ordinary sample: its gradient's norm 0.256, below C
    model = Outer().to(dtype)
    config = lf.DPConfig(1.0, 0.0, compute_dtype=dtype)
    if packed:  # the two samples as two units, a row each
        engine = lf.compile(model, config=config, packed_units=2)
        engine.accumulate(x, v, torch.tensor([[0], [1]]))
    else:
        engine = lf.compile(model, config=config)
        engine.accumulate(x, v)
    assert 1e40 < float(engine.last_norms[0]) < float("inf")
    engine.finalize(logical(2, 1.0))
    torch.testing.assert_close(model.fc.weight.grad, v[1, 0, :, None] * x[1, 0, None, :], rtol=1e-6, atol=0)


class TokenProducts(nn.Module):
    """One Linear(16, 16) whose per-token output gradient is an input: sample b's gradient is
    Σ_t v_bt x_btᵀ, so tokens can be made to cancel exactly. T=4 is ghost norm's range."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16, bias=False)

    def forward(self, x, v):
        return (self.fc(x) * v).sum((1, 2))


def cancelling_samples(dtype):
    """(scale, x, v) batches of 4 samples whose sample 0's tokens cancel: its per-token products
    have size ~scale² while its per-sample gradient is 0 (or ~1 for the random pairs), and the
    other three samples are ordinary."""
    g = torch.Generator().manual_seed(0)
    a, b, v = (torch.randn(16, generator=g) for _ in range(3))
    top = 2 ** 100 if dtype != torch.float16 else 2 ** 6  # fp16's largest finite is 65504
    for scale in [s for s in (2 ** 20, 2 ** 40, 2 ** 100) if s <= top] + [1e4, 1e5][: 2 if top > 2 ** 6 else 0]:
        x = torch.randn(4, 4, 16, generator=g)
        w = torch.randn(4, 4, 16, generator=g)
        if scale >= 2 ** 20:  # exact cancellation: v (a + b - a - b)ᵀ · scale
            x[0] = torch.stack([a, b, -a, -b]) * math.sqrt(scale)
            w[0] = v * math.sqrt(scale)
        else:  # random features of size `scale`, two tokens cancelling, two ordinary
            x[0, :2] = torch.randn(16, generator=g) * scale
            w[0, 0] = torch.randn(16, generator=g) * scale
            w[0, 1] = -w[0, 0]
        yield scale, x.to(dtype), w.to(dtype)
    if dtype == torch.float16:
        x, w = torch.randn(4, 4, 16, generator=g), torch.randn(4, 4, 16, generator=g)
        x[0] = torch.stack([a, b, -a, -b]) * 200.0
        w[0] = v * 200.0
        yield 200.0 ** 2, x.half(), w.half()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("clipping", ["flat", "per_layer", "automatic"])
def test_cancelling_tokens_stay_within_c_under_ghost_norm_and_book_keeping(clipping, dtype):
    """A sample whose token outer products cancel (per-sample gradient ~0, per-token products up
    to 2**200) once left the book-keeping matmul's fp32 residue in the sum, unclipped (6.6e4·C at
    2**40). Alone and among three ordinary samples (removed by its mask), its contribution,
    measured in float64, stays within C·(1+1e-6)."""
    C = 1.0
    model = TokenProducts()
    engine = lf.compile(model, config=lf.DPConfig(C, 0.0, clipping=clipping, compute_dtype=dtype))
    for scale, x, w in cancelling_samples(dtype):
        assert engine.lower(x, w).norm_methods["fc.weight"].startswith("ghost")
        alone, _ = clipped_sum(model, (x, w), C, clipping, torch.tensor([1.0, 0, 0, 0]), engine)
        assert flat_norm(alone) <= C * (1 + 1e-6), (scale, flat_norm(alone))
        together, _ = clipped_sum(model, (x, w), C, clipping, torch.ones(4), engine)
        without, _ = clipped_sum(model, (x, w), C, clipping, torch.tensor([0.0, 1, 1, 1]), engine)
        difference = {n: together[n].double() - without[n].double() for n in together}
        assert flat_norm(difference) <= C * (1 + 1e-6), (scale, flat_norm(difference))
    assert engine.captures == 1
