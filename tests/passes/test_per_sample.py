"""Per-sample gradients against torch.func, and the rewritten graph of a 1-layer MLP."""
import pytest
import torch
import torch.nn as nn
from expecttest import assert_expected_inline

import longshield_fx as lf
from longshield_fx.capture import capture
from longshield_fx.passes import PassContext, lower, pipeline
from longshield_fx.passes._context import PER_SAMPLE_GRAD

from oracles import (MLP, assert_matches_vmap, hf_gpt2, hf_llama, mlp_batch, tiny_llama, token_batch,
                     vmap_per_sample_grads)


def test_mlp_with_biases():
    assert_matches_vmap(MLP(), mlp_batch())


def test_reference_llama_gqa(tiny_per_sample):
    model = tiny_per_sample.model
    assert model.lm.layers[0].attention.wk.weight.shape[0] < model.lm.layers[0].attention.wq.weight.shape[0]
    assert_matches_vmap(model, tiny_per_sample.batch, tiny_per_sample.ours, tiny_per_sample.ref)


@pytest.fixture(scope="module")
def tied():
    """The tiny Llama with tied embeddings on a (4, 16) batch and its per-sample gradients (one capture)."""
    model, batch = tiny_llama(tie_embeddings=True), token_batch(B=4)
    return model, batch, lf.compile(model).per_sample_grads(*batch)


def test_reference_llama_tied_embeddings(tied):
    model, batch, ours = tied
    assert_matches_vmap(model, batch, ours)


def test_hf_llama():
    assert_matches_vmap(hf_llama(), token_batch(vocab=128))


def test_hf_gpt2_layernorm_bias_positions_tied():
    model = hf_gpt2()
    names = {n for n, _ in model.named_parameters()}
    assert "lm.transformer.wpe.weight" in names and "lm.lm_head.weight" not in names  # tied
    assert_matches_vmap(model, token_batch(vocab=128))


def test_hf_opt_positions_shared_by_samples_but_laid_out_per_row():
    """OPT computes position ids as cumsum of an all-ones mask: (B, T) ids that hold no sample's
    data, which the embedding rule must pair row by row with the (B, T) gradient rows."""
    import transformers
    torch.manual_seed(0)
    cfg = transformers.OPTConfig(num_hidden_layers=2, hidden_size=32, ffn_dim=64, num_attention_heads=2,
                                 vocab_size=128, max_position_embeddings=64, word_embed_proj_dim=32, dropout=0.0,
                                 attention_dropout=0.0, attn_implementation="sdpa")
    model = lf.CausalLMLoss(transformers.OPTForCausalLM(cfg))
    ours = assert_matches_vmap(model, token_batch(vocab=128))
    assert ours["lm.model.decoder.embed_positions.weight"].abs().sum() > 0


def test_frozen_parameters_get_no_per_sample_work(tiny, tokens):
    model = tiny
    model.lm.tok_embeddings.requires_grad_(False)
    model.lm.layers[0].requires_grad_(False)
    ours = assert_matches_vmap(model, tokens)
    assert not any(n.startswith("lm.layers.0.") for n in ours)
    assert "lm.tok_embeddings.weight" not in ours


def test_padding_idx_embedding_rows_get_nothing():
    class Emb(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4, padding_idx=0)

        def forward(self, ids):
            return self.emb(ids).pow(2).sum((1, 2))

    ids = torch.tensor([[0, 1, 2, 0], [3, 3, 0, 9]])
    ours = assert_matches_vmap(Emb(), (ids,))
    assert ours["emb.weight"][:, 0].abs().sum() == 0


def test_sum_over_batch_equals_original_gradient(tied):
    model, batch, ours = tied
    grads = torch.autograd.grad(model(*batch).sum(), list(model.parameters()))  # leaves .grad alone
    for (name, _), g in zip(model.named_parameters(), grads):
        torch.testing.assert_close(ours[name].sum(0), g, atol=1e-5, rtol=1e-4, msg=name)


def test_batch_of_one():
    assert_matches_vmap(tiny_llama(), token_batch(B=1))


def test_embedding_gradient_is_sparse_rows_in_the_graph(tiny_per_sample):
    """No (B, V, H) tensor for the embedding: the per-sample form is token ids + rows."""
    lowered = tiny_per_sample.lowered
    B, T = tiny_per_sample.batch[0].shape
    dim = tiny_per_sample.model.lm.tok_embeddings.weight.shape[1]
    assert lowered.passes == ["batch_dims", "chunked_loss", "per_sample"]
    emb = lowered.ctx.param_meta("lm.tok_embeddings.weight")[PER_SAMPLE_GRAD]
    assert emb.dense is None and len(emb.rows) == 1
    ids, values = emb.rows[0]
    assert tuple(ids.meta["val"].shape) == (B, T) and tuple(values.meta["val"].shape) == (B, T, dim)
    assert lowered.rules["lm.tok_embeddings.weight"] == "embedding"
    assert lowered.rules["lm.layers.0.attention.wq.weight"] == "linear"
    assert lowered.rules["lm.layers.0.attention_norm.weight"] == "sum"


class OneLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        return self.fc(x).pow(2).sum((1, 2))


def test_golden_graph_one_layer_mlp():
    torch.manual_seed(0)
    model = OneLayer()
    batch = (torch.randn(4, 5, 3),)
    passes = pipeline(training=False)
    assert [p.__name__ for p in passes] == ["batch_dims", "chunked_loss", "per_sample"]
    gm = lower(PassContext(capture(model, batch), 4), passes).gm
    code = "\n".join(line.split("#")[0].rstrip() for line in gm.code.strip().splitlines() if line.strip())
    assert_expected_inline(code, """\
def forward(self, primals_1, primals_2, primals_3, tangents_1):
    view = torch.ops.aten.view.default(primals_3, [20, 3])
    t = torch.ops.aten.t.default(primals_1);  primals_1 = None
    addmm = torch.ops.aten.addmm.default(primals_2, view, t);  primals_2 = view = t = None
    view_1 = torch.ops.aten.view.default(addmm, [4, 5, 2]);  addmm = None
    pow_1 = torch.ops.aten.pow.Tensor_Scalar(view_1, 2)
    sum_1 = torch.ops.aten.sum.dim_IntList(pow_1, [1, 2]);  pow_1 = None
    unsqueeze = torch.ops.aten.unsqueeze.default(tangents_1, 1);  tangents_1 = None
    unsqueeze_1 = torch.ops.aten.unsqueeze.default(unsqueeze, 2);  unsqueeze = None
    expand = torch.ops.aten.expand.default(unsqueeze_1, [4, 5, 2]);  unsqueeze_1 = None
    pow_2 = torch.ops.aten.pow.Tensor_Scalar(view_1, 1.0);  view_1 = None
    mul = torch.ops.aten.mul.Scalar(pow_2, 2.0);  pow_2 = None
    mul_1 = torch.ops.aten.mul.Tensor(expand, mul);  expand = mul = None
    einsum_default = torch.ops.aten.einsum.default('btm,btn->bmn', [mul_1, primals_3]);  primals_3 = None
    sum_dim_int_list = torch.ops.aten.sum.dim_IntList(mul_1, [1]);  mul_1 = None
    view_default_1 = torch.ops.aten.view.default(sum_dim_int_list, [4, 2]);  sum_dim_int_list = None
    return (sum_1, einsum_default, view_default_1)""")
    ours = lf.compile(model).per_sample_grads(*batch)
    ref = vmap_per_sample_grads(model, batch)
    torch.testing.assert_close(ours["fc.weight"], ref["fc.weight"])


class Conv(nn.Module):
    def __init__(self, kernel_size):
        super().__init__()
        self.conv = nn.Conv1d(3, 4, kernel_size, bias=False)

    def forward(self, x):
        return self.conv(x).pow(2).sum((1, 2))


class CumulativeWeights(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 3))

    def forward(self, x):
        return (x @ self.w.cumsum(0)).pow(2).sum((1, 2))


def test_unknown_gradient_pattern_names_parameter_op_and_way_out():
    # The matmul keeps samples apart (batch_dims accepts it), but the weight gradient then
    # passes through cumsum's backward, which no per-sample rule knows.
    with pytest.raises(lf.UnsupportedModelError) as e:
        lf.compile(CumulativeWeights()).per_sample_grads(torch.randn(2, 5, 4))
    msg = str(e.value)
    assert "'w'" in msg and "no per-sample rule for" in msg
    assert "freeze" in msg and "per_sample_rule" in msg


def test_registered_rule_is_used():
    """A user rule (here for a kernel-size-1 convolution, a linear map over channels) replaces
    the built-in one."""
    import importlib

    from longshield_fx.passes.per_sample import PerSampleGrad

    ps_module = importlib.import_module("longshield_fx.passes.per_sample")  # the module, not the pass

    aten = torch.ops.aten
    key = (aten.convolution_backward.default, 1)
    built_in = ps_module._RULES[key]

    @lf.per_sample_rule(key, name="conv1x1")
    def conv1x1(rw, node):
        grad_out, x = node.args[0].args[:2]  # (B, Cout, L), (B, Cin, L)
        w = rw.call(aten.einsum.default, "bol,bil->boi", [grad_out, x])
        return PerSampleGrad(tuple(node.meta["val"].shape), rw.call(aten.unsqueeze.default, w, 3))

    try:
        model = Conv(1)
        batch = (torch.randn(3, 3, 8),)
        engine = lf.compile(model)
        ours = engine.per_sample_grads(*batch)
        torch.testing.assert_close(ours["conv.weight"], vmap_per_sample_grads(model, batch)["conv.weight"])
        assert "conv1x1" in repr(engine)
    finally:
        ps_module._RULES[key] = built_in


class ConvNet(torch.nn.Module):
    """conv -> activation with a trainable slope -> conv; per-sample loss summed over positions."""

    def __init__(self, dims, **conv):
        super().__init__()
        Conv = torch.nn.Conv1d if dims == 1 else torch.nn.Conv2d
        self.conv1 = Conv(4, 6, kernel_size=3, **conv)
        self.conv2 = Conv(6, 2, kernel_size=2, bias=False)
        self.alpha = torch.nn.Parameter(torch.tensor(0.3))

    def forward(self, x, y):
        h = self.conv1(x)
        h = torch.nn.functional.softplus(self.alpha) * h + torch.nn.functional.silu(h)
        return ((self.conv2(h).flatten(1) - y) ** 2).sum(1)


@pytest.mark.parametrize("dims, conv", [
    (1, {}),
    (1, {"stride": 2, "padding": 1, "dilation": 2, "groups": 2}),
    (2, {"stride": (2, 1), "padding": 1}),
    (2, {"dilation": 2, "groups": 2, "padding": "same"}),
])
def test_conv_weights_bias_and_a_parameter_inside_an_activation(dims, conv):
    torch.manual_seed(0)
    model = ConvNet(dims, **conv)
    shape = (3, 4, 17) if dims == 1 else (3, 4, 9, 8)
    batch = (torch.randn(shape), torch.randn(3, 1))
    assert_matches_vmap(model, batch)
    rules = lf.compile(model).lower(*batch, graph="per_sample").rules
    assert rules["conv1.weight"] == "conv" and rules["alpha"] == "activation+sum"


class GroupedAndJoined(nn.Module):
    """A grouped linear (one bmm over groups, tokens folded with the batch) whose weight is
    joined from pieces (cat, stack, slice), as DeepSeek-V4's hyper-connections and grouped
    output projection do."""

    def __init__(self, groups=3, d=4):
        super().__init__()
        self.head = nn.Parameter(torch.randn(1, d, d))
        self.rest = nn.Parameter(torch.randn(groups - 1, d, d))
        self.scale = nn.Parameter(torch.randn(2))

    def forward(self, x):  # x (B, T, groups, d)
        B, T, G, d = x.shape
        w = torch.cat([self.head, self.rest]) * torch.stack([self.scale[0], self.scale[1:].sum()]).sum()
        h = torch.bmm(x.reshape(B * T, G, d).transpose(0, 1), w)  # (G, B*T, d)
        return h.transpose(0, 1).reshape(B, T, G * d).pow(2).sum((1, 2))


def test_grouped_linear_and_weights_joined_from_pieces():
    torch.manual_seed(0)
    model = GroupedAndJoined()
    batch = (torch.randn(3, 5, 3, 4),)
    assert_matches_vmap(model, batch)
    assert lf.compile(model).lower(*batch, graph="per_sample").rules["rest"] == "grouped_linear"


class DelayedStart(nn.Module):
    """ZAYA's delayed value: a linear layer applied to a (B, 1, 6) row ``start(x)`` that holds no
    sample, its output put in front of each sample's own (shifted) outputs of the same layer."""

    def __init__(self, start):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(6, 4)
        self.start = start

    def forward(self, x, y):  # x (B, T, 6), y (B,)
        v = torch.cat([self.lin(self.start(x)), self.lin(x)[:, :-1]], dim=1)
        return torch.tanh(v).pow(2).sum((1, 2)) * y


def delayed_batch(B=3):
    g = torch.Generator().manual_seed(1)
    return torch.randn(B, 7, 6, generator=g), torch.rand(B, generator=g) + 0.5


def test_constant_operand_paired_row_by_row_with_per_sample_data_is_exact():
    """The weight gradient of lin pairs the constant's row b with sample b's gradient row: a
    nonzero constant (the same in every row) makes that pairing matter, and it must be exact."""
    from oracles import assert_exact_with_clipped_sum

    assert_exact_with_clipped_sum(DelayedStart(lambda x: x.new_ones(x.shape[0], 1, 6) * 0.5), delayed_batch())


def test_constant_operand_that_differs_per_batch_row_is_refused():
    """A start row of arange(B) gives sample i the value i: its loss depends on its row position."""
    model = DelayedStart(lambda x: torch.arange(x.shape[0], dtype=x.dtype).view(-1, 1, 1).expand(-1, 1, 6))
    with pytest.raises(lf.UnsupportedModelError) as e:
        lf.compile(model).per_sample_grads(*delayed_batch())
    msg = str(e.value)
    assert "op aten.cat.default" in msg and "row position" in msg, msg


class SharedPositions(nn.Module):
    """A position table read as ``pos[ids]`` with ``ids = f(arange(T)).repeat(B, 1)``: the same
    ids in every sample, laid out one row per sample; its gradient is an index_put with them."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.pos = nn.Parameter(torch.randn(16, 6))
        self.proj = nn.Parameter(torch.randn(6, 6))

    def forward(self, x, y):  # x (B, T, 6), y (B,)
        B, T = x.shape[:2]
        ids = (torch.arange(T) * 2 % 16).unsqueeze(0).repeat(B, 1)
        return torch.tanh((x + self.pos[ids]) @ self.proj).pow(2).sum((1, 2)) * y


def test_index_put_with_shared_ids_laid_out_per_row_is_exact():
    """Each sample's rows of the position gradient go to the ids in its own row of the (B, T) id
    tensor; the ids are the same in every row (no row position), so per-sample grads and the
    clipped sum are exact."""
    from oracles import assert_exact_with_clipped_sum

    assert_exact_with_clipped_sum(SharedPositions(), delayed_batch())
