"""batch_dims: sample dimensions are tracked through views; sample-mixing ops and losses that depend
on a sample's row position in the batch are rejected."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import longshield_fx as lf
from longshield_fx.passes.batch_dims import BatchDim

from oracles import MLP, assert_matches_vmap, hf_llama, mlp_batch, tagged, tiny_llama, token_batch


def test_folded_batch_times_tokens_is_tracked():
    model, T = MLP(), 5
    nodes = tagged(model, mlp_batch(B=4, T=T))
    # nn.Linear flattens (B, T, d) to (B*T, d): the batch is folded with T rows per sample.
    assert nodes["view"].meta["batch_dim"] == BatchDim(0, T)
    assert nodes["view_1"].meta["batch_dim"] == BatchDim(0, 1)  # back to (B, T, hidden)
    assert nodes["primals_1"].meta["batch_dim"] is None  # a weight
    # The weight-gradient mm reduces over the batch in the backward: tagged None, one per linear layer.
    weight_grads = [n for n in nodes.values() if n.target == torch.ops.aten.mm.default
                    and n.meta["partitioner_tag"] == "is_backward" and n.meta["batch_dim"] is None]
    assert len(weight_grads) == sum(isinstance(m, nn.Linear) for m in model.modules())


def test_batchnorm_is_rejected_naming_the_op_and_module():
    class WithBatchNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 6)
            self.bn = nn.BatchNorm1d(6)

        def forward(self, x):
            return self.bn(self.fc(x)).pow(2).sum(1)

    with pytest.raises(lf.UnsupportedModelError) as e:
        lf.compile(WithBatchNorm()).per_sample_grads(torch.randn(8, 4))
    msg = str(e.value)
    assert "batch_norm" in msg and "bn (BatchNorm1d)" in msg and "mixes samples" in msg


class Normed(nn.Module):
    def __init__(self, layer, norm):
        super().__init__()
        self.layer, self.norm = layer, norm
        with torch.no_grad():
            norm.weight.normal_()
            norm.bias.normal_()

    def forward(self, x):
        return self.norm(self.layer(x)).pow(2).flatten(1).sum(1)


class EvalBatchNorm(Normed):
    """A layer and batch norm in eval mode (running statistics): per channel, never over the batch."""

    def __init__(self, layer, bn):
        super().__init__(layer, bn)
        with torch.no_grad():
            bn.running_mean.normal_()
            bn.running_var.uniform_(0.5, 2.0)


@pytest.mark.parametrize("make, shape", [
    (lambda: EvalBatchNorm(nn.Linear(4, 6), nn.BatchNorm1d(6)), (5, 4)),
    (lambda: EvalBatchNorm(nn.Conv1d(4, 6, 3), nn.BatchNorm1d(6)), (3, 4, 7)),
    (lambda: EvalBatchNorm(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3)), (2, 2, 5, 5)),
])
def test_batchnorm_in_eval_mode_uses_running_statistics_and_is_exact(make, shape):
    torch.manual_seed(0)
    model = make().eval()
    assert_matches_vmap(model, (torch.randn(*shape),))


@pytest.mark.parametrize("B", [1, 2, 3, 4])
def test_group_norm_is_exact_at_every_batch_size_even_with_as_many_channels(B):
    """GroupNorm(1, C) with C = B once read as a weight varying along the batch; its backward had no rule."""
    torch.manual_seed(B)
    for model, shape in [(Normed(nn.Conv2d(2, B, 3), nn.GroupNorm(1, B)), (B, 2, 5, 5)),
                         (Normed(nn.Conv1d(4, 6, 3), nn.GroupNorm(3, 6)), (B, 4, 7)),
                         (Normed(nn.Linear(5, 12), nn.GroupNorm(2, 12)), (B, 5))]:
        assert_matches_vmap(model, (torch.randn(*shape),))


def test_in_batch_pairs_loss_is_rejected():
    class Contrastive(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 6)

        def forward(self, x):
            z = self.fc(x)
            sim = z @ z.t()  # (B, B): each row compares a sample with every other one
            return F.cross_entropy(sim, torch.arange(x.shape[0]), reduction="none")

    with pytest.raises(lf.UnsupportedModelError) as e:
        lf.compile(Contrastive()).per_sample_grads(torch.randn(8, 4))
    assert "aten.mm" in str(e.value) and "mixes samples" in str(e.value)


def test_mean_over_batch_is_rejected():
    class Centered(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 6)

        def forward(self, x):
            z = self.fc(x)
            return (z - z.mean(0)).pow(2).sum(1)

    with pytest.raises(lf.UnsupportedModelError, match="aten.mean.dim.*reduces over the batch"):
        lf.compile(Centered()).per_sample_grads(torch.randn(8, 4))


class _CentredGradient(torch.autograd.Function):
    """Identity forward; its backward centres the gradient over the batch."""

    @staticmethod
    def forward(ctx, h):
        return h.clone()

    @staticmethod
    def backward(ctx, g):
        return g - g.mean(0, keepdim=True)


@pytest.mark.parametrize("how", ["normalising hook", "custom backward", "elementwise hook"])
def test_a_backward_that_mixes_samples_is_rejected(how):
    """A tensor hook or a custom autograd.Function whose backward normalises or centres the
    gradient over the whole batch makes each sample's gradient depend on the others: refused,
    where the weight gradients' own reductions over the batch are not; a hook acting on each
    element alone is exact against each sample alone."""

    class Hooked(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1, self.l2 = nn.Linear(4, 4), nn.Linear(4, 3)

        def forward(self, x):
            h = self.l1(x)
            if how == "custom backward":
                h = _CentredGradient.apply(h)
            elif h.requires_grad:
                h.register_hook((lambda g: g / g.norm()) if how == "normalising hook" else (lambda g: g.clamp(-0.5, 0.5)))
            return self.l2(h).pow(2).sum((1, 2))

    model, x = Hooked(), torch.randn(3, 5, 4, generator=torch.Generator().manual_seed(0))
    if how == "elementwise hook":
        ours = lf.compile(model).per_sample_grads(x)
        for n, p in model.named_parameters():
            alone = torch.stack([torch.autograd.grad(model(x[i:i + 1]).sum(), p)[0] for i in range(3)])
            torch.testing.assert_close(ours[n], alone, rtol=1e-5, atol=1e-6)
        return
    with pytest.raises(lf.UnsupportedModelError, match="mixes samples: it combines per-sample gradients with .*"
                                                       "reduction over the batch .* in the backward"):
        lf.compile(model).per_sample_grads(x)


def test_non_per_sample_loss_is_rejected():
    class MeanLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 1)

        def forward(self, x):
            return self.fc(x).mean().reshape(1).expand(x.shape[0])

    with pytest.raises(lf.UnsupportedModelError, match="mixes samples"):
        lf.compile(MeanLoss()).per_sample_grads(torch.randn(8, 4))


def test_loss_of_wrong_shape_is_rejected():
    class ScalarLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 1)

        def forward(self, x):
            return self.fc(x).pow(2).sum(1).sum().reshape(1)

    with pytest.raises(lf.UnsupportedModelError, match=r"per-sample losses of shape \(8,\), got \(1,\)"):
        lf.compile(ScalarLoss()).per_sample_grads(torch.randn(8, 4))


# --- row position: a loss may not depend on which row the sampler put a sample in ---------------


class Weighted(nn.Module):
    """Per-sample squared activations, passed through ``fn(z)`` in submodule ``rows``."""

    class Rows(nn.Module):
        def __init__(self, fn):
            super().__init__()
            self.fn = fn

        def forward(self, z):
            return self.fn(z)

    def __init__(self, fn):
        super().__init__()
        self.fc = nn.Linear(4, 6)
        self.rows = Weighted.Rows(fn)

    def forward(self, x):
        return self.rows(self.fc(x))


def refusal(fn, B=4):
    with pytest.raises(lf.UnsupportedModelError) as e:
        lf.compile(Weighted(fn)).per_sample_grads(torch.randn(B, 4))
    msg = str(e.value)
    assert "row position" in msg and "rows (Rows)" in msg, msg
    return msg


def test_loss_weighted_by_row_position_is_rejected():
    # The privacy finding: removing one record shifts the others to new rows and new weights.
    msg = refusal(lambda z: z.pow(2).sum(1) * torch.arange(z.shape[0]).float())
    assert "op aten.mul.Tensor" in msg and "made by aten.arange.default" in msg


def test_loss_weighted_by_a_running_count_over_the_batch_is_rejected():
    # ones(B) is uniform, but its cumsum over the batch is 1..B: a row position in disguise.
    msg = refusal(lambda z: z.pow(2).sum(1) * torch.ones(z.shape[0]).cumsum(0))
    assert "op aten.mul.Tensor" in msg and "made by aten.cumsum.default" in msg


def test_padding_along_the_batch_is_a_row_position():
    msg = refusal(lambda z: z.pow(2).sum(1) * F.pad(torch.ones(z.shape[0] - 1), (0, 1)))  # the last row is 0
    assert "op aten.mul.Tensor" in msg and "made by aten.constant_pad_nd.default" in msg


def test_per_row_constant_tensor_is_rejected():
    msg = refusal(lambda z: z.pow(2).sum(1) * torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert "op aten.mul.Tensor" in msg and "tensor constant" in msg


def test_targets_by_row_position_are_rejected():
    msg = refusal(lambda z: F.cross_entropy(z, torch.arange(z.shape[0]) % 6, reduction="none"))
    assert "op aten.nll_loss_forward.default" in msg and "made by aten.arange.default" in msg


@pytest.mark.parametrize("op, fn", [
    ("aten.index.Tensor", lambda z: z[torch.tensor([1, 0, 3, 2])]),
    ("aten.index_select.default", lambda z: z.index_select(0, torch.tensor([1, 0, 3, 2]))),
    ("aten.flip.default", lambda z: z.flip(0)),
    ("aten.roll.default", lambda z: z.roll(1, 0)),
], ids=["index", "index_select", "flip", "roll"])
def test_rows_moved_along_the_batch_are_rejected(op, fn):
    msg = refusal(lambda z: fn(z).pow(2).sum(1))
    assert f"op {op}" in msg and "moves rows along the batch dimension" in msg


def test_windows_within_a_sample_are_exact_and_windows_across_the_batch_are_refused():
    """unfold (BLT's byte n-gram hashes take windows of each row): windows over a sample's own
    entries keep samples apart, forward and backward; windows along the batch mix them."""
    assert_matches_vmap(Weighted(lambda z: z.unfold(1, 3, 2).pow(2).sum((1, 2))), (torch.randn(4, 4),))
    with pytest.raises(lf.UnsupportedModelError, match=r"op aten\.unfold\.default .*windows along the batch"):
        lf.compile(Weighted(lambda z: z.unfold(0, 2, 2).reshape(4, -1).pow(2).sum(1))).per_sample_grads(
            torch.randn(4, 4))


def test_per_sample_weights_folded_with_tokens_must_be_constant_per_sample():
    class TokenWeighted(nn.Module):
        def __init__(self, weights):
            super().__init__()
            self.fc = nn.Linear(6, 3)
            self.weights = weights

        def forward(self, x, y):
            B, T = y.shape
            token_loss = F.cross_entropy(self.fc(x).view(B * T, 3), y.view(B * T), reduction="none")
            return (token_loss * self.weights(B, T)).view(B, T).sum(1)

    x, y = mlp_batch(B=4, T=5)
    # Rows of (B*T,) are (sample, token): a weight per token position is the same in every
    # sample's block of T rows and is accepted; a weight per sample row is not.
    assert_matches_vmap(TokenWeighted(lambda B, T: torch.arange(T).float().repeat(B)), (x, y))
    with pytest.raises(lf.UnsupportedModelError, match=r"op aten\.mul\.Tensor .*row position.*made by "
                       r"aten\.arange\.default"):
        lf.compile(TokenWeighted(lambda B, T: torch.arange(B).float()[:, None].expand(B, T).reshape(-1))
                   ).per_sample_grads(x, y)


@pytest.mark.parametrize("fn", [
    lambda z: z.pow(2).sum(1) * 2.0,  # a scalar
    lambda z: z.pow(2).sum(1) * torch.ones(z.shape[0]),  # full size, but the same in every row
    lambda z: (z * torch.linspace(0.0, 1.0, 6)).pow(2).sum(1),  # (6,): varies along features only
    lambda z: (z * torch.arange(6.0)[None].expand(z.shape[0], 6)).pow(2).sum(1),  # (1, 6) expanded over B
    lambda z: z.flip(1).roll(2, 1).pow(2).sum(1),  # moves entries within each sample
    # CUDA's memory-efficient attention pads its (B, 1, T, T) mask to 16 columns and slices it.
    lambda z: (z * F.pad(torch.arange(6.0)[None].expand(z.shape[0], 6), (0, 10))[:, :6]).pow(2).sum(1),
], ids=["scalar", "ones_B", "per_feature", "expanded_over_B", "flip_roll_features", "padded_mask"])
def test_constants_uniform_over_the_batch_are_accepted(fn):
    assert_matches_vmap(Weighted(fn), (torch.randn(4, 4),))


def test_position_embedding_by_arange_over_tokens_is_accepted():
    class PosEmb(nn.Module):
        def __init__(self, vocab=16, T=8, d=6):
            super().__init__()
            self.tok = nn.Embedding(vocab, d)
            self.pos = nn.Embedding(T, d)
            self.out = nn.Linear(d, vocab)

        def forward(self, ids, mask):
            positions = torch.arange(ids.shape[1])  # (T,): the same for every sample
            h = self.tok(ids) + self.pos(positions)
            logits = self.out(h).transpose(1, 2)
            return (F.cross_entropy(logits, ids, reduction="none") * mask).sum(1)  # mask: an input

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 16, (3, 8), generator=g)
    mask = (torch.arange(8) < torch.tensor([[8], [5], [2]])).float()  # padding mask, per sample
    assert_matches_vmap(PosEmb(), (ids, mask))


@pytest.mark.parametrize("make, vocab", [(tiny_llama, 256), (hf_llama, 128)], ids=["tiny_llama", "hf_llama"])
def test_llama_positions_and_causal_masks_are_accepted(make, vocab):
    nodes = tagged(make(), token_batch(B=3, vocab=vocab))  # RoPE from arange(T) positions: accepted
    # HF builds its causal mask as (B, 1, T, T) by indexing with arange(B); its rows are all
    # equal, so attention may read it with per-sample q, k, v. The reference Llama has no mask.
    masks = [x for n in nodes.values() if n.op == "call_function" and "scaled_dot_product" in str(n.target)
             for x in n.all_input_nodes if x.meta.get("batch_dim") is None and x.meta["val"].dim() == 4]
    assert bool(masks) == (make is hf_llama)
    assert all(m.meta["val"].shape[0] == 3 and 0 not in m.meta["varies"] for m in masks)


class Apply(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fc = nn.Linear(4, 6)
        self.fn = fn

    def forward(self, x):
        return self.fn(self.fc(x)).pow(2).flatten(1).sum(1)


@pytest.mark.parametrize("fn, op", [
    (lambda z: torch.logcumsumexp(z, dim=1), "logcumsumexp"),                                  # along features
    (lambda z: torch.select_scatter(z.unsqueeze(1).repeat(1, 3, 1), z, 1, 0), "select_scatter"),  # one slot per row
    (lambda z: torch.cummax(z, dim=1).values, "cummax"),
], ids=["logcumsumexp", "select_scatter", "cummax"])
def test_ops_without_a_hand_rule_follow_dtensor_sharding_propagation(fn, op):
    from longshield_fx.passes.batch_dims import _rule_for, dtensor_rule
    model = Apply(fn)
    batch = (torch.randn(3, 4),)
    decided = {n.target for n in tagged(model, batch).values()
               if n.op == "call_function" and n.meta.get("batch_dim") is not None
               and _rule_for(n.target) is dtensor_rule}
    assert op in {target._opname for target in decided}
    assert_matches_vmap(model, batch)


def test_an_op_dtensor_can_only_run_on_the_whole_batch_is_refused():
    # First the same op along features (accepted): DTensor's cached propagation keys on tensor
    # arguments only, and would then answer "accepted" for the batch dim too.
    lf.compile(Apply(lambda z: torch.logcumsumexp(z, dim=1))).per_sample_grads(torch.randn(3, 4))
    with pytest.raises(lf.UnsupportedModelError, match="logcumsumexp.*mixes samples: DTensor's sharding rules"):
        lf.compile(Apply(lambda z: torch.logcumsumexp(z, dim=0))).per_sample_grads(torch.randn(3, 4))


class Pool(nn.Module):
    """Per-sample rows picked by advanced indexing, with the batch indexed by arange(B)."""

    def __init__(self, pick):
        super().__init__()
        self.fc = nn.Linear(4, 6)
        self.pick = pick

    def forward(self, x, last):
        h = self.fc(x)  # (B, T, 6)
        return self.pick(h, last).pow(2).flatten(1).sum(1)


@pytest.mark.parametrize("pick", [
    lambda h, last: h[torch.arange(h.shape[0]), last],                      # last-token pooling
    lambda h, last: h[torch.arange(h.shape[0])[:, None], last[:, None] - torch.arange(2)],
    lambda h, last: h[:, torch.tensor([0, 2])],                              # the same tokens of every row
], ids=["last_token", "window", "shared_index"])
def test_indexing_that_keeps_each_sample_in_its_row_is_exact(pick):
    torch.manual_seed(0)
    model, batch = Pool(pick), (torch.randn(3, 5, 4), torch.tensor([4, 2, 3]))
    assert_matches_vmap(model, batch)


def test_indexing_the_batch_with_a_per_row_constant_is_refused():
    model = Pool(lambda h, last: h[torch.arange(h.shape[0]), torch.tensor([0, 1, 2])])
    with pytest.raises(lf.UnsupportedModelError, match="row position"):
        lf.compile(model).per_sample_grads(torch.randn(3, 5, 4), torch.tensor([4, 2, 3]))


class TimeMajor(nn.Module):
    """XLNet's (T, B) layout: linear layers on T*B rows tiled in T blocks of B. ``offsets(B, T)``
    is a (T, B, 8) constant folded with the batch to (T*B, 8), put through a linear layer on
    those rows and split back to (T, B, 8) before it meets the per-sample data."""

    def __init__(self, offsets):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(6, 8)
        self.pos = nn.Linear(8, 8)
        self.out = nn.Linear(8, 5, bias=False)
        self.offsets = offsets

    def forward(self, x, y):  # x (B, T, 6), y (B,)
        B, T = x.shape[:2]
        h = self.inp(x.transpose(0, 1))  # (T, B, 8)
        r = self.pos(self.offsets(B, T).reshape(T * B, 8)).view(T, B, 8)
        return self.out(torch.tanh(h * r.sin())).pow(2).sum((0, 2)) * y


class WideTimeMajor(nn.Module):
    """(T, B) layout wide enough that the second layer's norm is a ghost norm (2T(p+d) <= p*d)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(6, 64)
        self.b = nn.Linear(64, 64)

    def forward(self, x, y):
        return self.b(torch.tanh(self.a(x.transpose(0, 1)))).pow(2).sum((0, 2)) * y


def time_major_batch(B=3, T=7):
    g = torch.Generator().manual_seed(1)
    return torch.randn(B, T, 6, generator=g), torch.rand(B, generator=g) + 0.5


def test_time_major_rows_and_positions_folded_with_the_batch_give_exact_per_sample_and_clipped_grads():
    """Positions expanded over B, folded into T*B rows and split back, depend only on the T digit
    of the row index: every sample sees the same values, so they are no row position; the
    weight gradients over (T, B) rows regroup each sample's T rows exactly."""
    from oracles import assert_exact_with_clipped_sum

    positions = TimeMajor(lambda B, T: torch.arange(T, dtype=torch.float)[:, None, None].expand(T, B, 8))
    assert_exact_with_clipped_sum(positions, time_major_batch())


def test_time_major_weight_gradients_are_exact_through_the_ghost_norm():
    """The ghost norm of a (T, B) layer pairs each sample's T rows of activations and gradients,
    not T*B consecutive rows: its clipped sum must equal the per-sample oracle's."""
    from oracles import assert_exact_with_clipped_sum

    model, batch = WideTimeMajor(), time_major_batch()
    assert_exact_with_clipped_sum(model, batch)
    assert lf.compile(model, config=lf.DPConfig(0.5, 0.0)).lower(*batch).norm_methods["b.weight"].startswith("ghost")


def test_per_row_constant_folded_with_the_batch_in_time_major_layout_is_refused():
    """arange(B) laid out as (T, B) differs along the B digit of the folded T*B rows: after the
    fold and the split it still gives sample i the value i, a row position."""
    model = TimeMajor(lambda B, T: torch.arange(B, dtype=torch.float)[None, :, None].expand(T, B, 8))
    with pytest.raises(lf.UnsupportedModelError) as e:
        lf.compile(model).per_sample_grads(*time_major_batch())
    msg = str(e.value)
    assert "op aten.mul.Tensor" in msg and "row position" in msg and "made by aten.arange.default" in msg, msg


class Sections(nn.Module):
    """Per-sample activations times a (B, T, 6) constant ``build(B, T)`` written piece by piece
    (``c[..., a:b] = ...``, functionalized to slice_scatter / select_scatter)."""

    def __init__(self, build):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(6, 6)
        self.build = build

    def forward(self, x, y):
        return (torch.tanh(self.fc(x)) * self.build(*x.shape[:2])).pow(2).sum((1, 2)) * y


def _mrope_sections(B, T):
    c = torch.zeros(B, T, 6)
    c[..., :3] = torch.arange(T, dtype=torch.float)[:, None].expand(B, T, 3).cos()  # slice_scatter
    c[..., 4] = torch.arange(T, dtype=torch.float).sin()  # select_scatter
    return c


def _per_row_section(B, T):
    c = torch.ones(B, T, 6)
    c[..., :3] = torch.arange(B, dtype=torch.float)[:, None, None].expand(B, T, 3)
    return c


def _first_row_set(B, T):
    c = torch.ones(B, T, 6)
    c[0] = 2.0 * torch.ones(T, 6)  # select_scatter along the batch
    return c


def _first_rows_sliced(B, T):
    c = torch.ones(B, T, 6)
    c[:1] = 2.0  # slice_scatter along the batch
    return c


def test_feature_sections_written_by_slice_and_select_scatter_are_uniform_over_the_batch():
    """M-RoPE-style sections: per-position values written into feature slices of a batch-uniform
    tensor vary along the features only, so every sample sees the same constant: accepted, exact."""
    from oracles import assert_exact_with_clipped_sum

    model, batch = Sections(_mrope_sections), (torch.randn(3, 5, 6), torch.rand(3) + 0.5)
    code = lf.compile(model).lower(*batch, graph="per_sample").gm.code
    assert "aten.slice_scatter" in code and "aten.select_scatter" in code
    assert_exact_with_clipped_sum(model, batch)


@pytest.mark.parametrize("build, scatter, origin", [
    (_per_row_section, "slice_scatter", "aten.arange.default"),  # a per-row source keeps its variation
    (_first_row_set, "select_scatter", "aten.select_scatter.default"),  # one row replaced: rows differ
    (_first_rows_sliced, "slice_scatter", "aten.slice_scatter.default"),
], ids=["per_row_source", "select_scatter_row", "slice_scatter_rows"])
def test_scatter_that_varies_the_batch_rows_is_refused(build, scatter, origin):
    """A constant whose batch rows differ, whether from its source or from writing only some rows,
    gives each sample a value by its row position: refused, naming the op and where it came from."""
    with pytest.raises(lf.UnsupportedModelError) as e:
        lf.compile(Sections(build)).per_sample_grads(torch.randn(3, 5, 6), torch.rand(3) + 0.5)
    msg = str(e.value)
    assert "op aten.mul.Tensor" in msg and "row position" in msg, msg
    assert f"combines per-sample data with {scatter}" in msg and f"made by {origin}" in msg, msg
