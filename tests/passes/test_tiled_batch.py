"""Tiled batch rows (``BatchDim.outer``): an MoE in the style of Llama 4 repeats the folded B*T
tokens once per expert, so each sample's rows recur in every expert's block. Tagged exactly,
such tensors give exact per-sample gradients; ops no rule proves safe on them are refused."""
import pytest
import torch
import torch.nn as nn

import longshield_fx as lf
from longshield_fx.passes.batch_dims import BatchDim

from oracles import assert_matches_vmap, tagged

E, D, H = 4, 6, 5


class RepeatedExperts(nn.Module):
    """Llama4TextMoe's routing: tokens (N, D) repeated to (E*N, D), scaled by their router
    scores, run through each expert as one bmm over (E, N, D), summed back over experts.
    ``then`` acts on the tiled (E*N, D) tensor before the experts; ``scaled`` gives it a weight."""

    def __init__(self, then=lambda rows, moe: rows, scaled=False):
        super().__init__()
        torch.manual_seed(0)
        self.router = nn.Linear(D, E, bias=False)
        self.gate_up = nn.Parameter(torch.randn(E, D, 2 * H) * 0.3)
        self.down = nn.Parameter(torch.randn(E, H, D) * 0.3)
        if scaled:
            self.scale = nn.Parameter(torch.rand(D) + 0.5)
        self.then = then

    def forward(self, x):
        B, T, _ = x.shape
        tokens = x.reshape(-1, D)
        scores = torch.sigmoid(self.router(tokens))  # (N, E)
        rows = tokens.repeat(E, 1) * scores.transpose(0, 1).reshape(-1, 1)
        rows = self.then(rows, self)
        gate, up = torch.bmm(rows.view(E, -1, D), self.gate_up).chunk(2, dim=-1)
        out = torch.bmm(up * nn.functional.silu(gate), self.down).view(-1, D)
        out = out.view(E, -1, D).sum(0).view(B, T, D)
        return out.pow(2).sum((1, 2))


def batch(B=3, T=5):
    return (torch.randn(B, T, D, generator=torch.Generator().manual_seed(1)),)


def test_tokens_repeated_per_expert_are_tagged_as_tiled_rows():
    nodes = tagged(RepeatedExperts(), batch(B=3, T=5))
    (repeat,) = [n for n in nodes.values() if n.target == torch.ops.aten.repeat.default]
    assert repeat.meta["batch_dim"] == BatchDim(0, inner=5, outer=E)
    # Viewed as (experts, tokens, D), the expert blocks get their own dim and the batch is untiled.
    experts = [n for n in repeat.users if n.target == torch.ops.aten.mul.Tensor][0]
    assert {u.meta["batch_dim"] for u in experts.users if u.target == torch.ops.aten.view.default} == {BatchDim(1, 5)}


@pytest.mark.parametrize("then, scaled", [
    (lambda rows, moe: rows, False),
    (lambda rows, moe: rows * moe.scale, True),  # a weight on the tiled rows: its gradient sums over the blocks
    (lambda rows, moe: rows.view(E, -1, D).transpose(0, 1).reshape(-1, D).view(-1, E, D).transpose(0, 1)
     .reshape(-1, D), False),  # expert-major -> token-major -> back: views through both layouts
], ids=["llama4", "weight_on_tiled_rows", "token_major_round_trip"])
def test_per_sample_grads_of_repeated_experts_are_exact(then, scaled):
    assert_matches_vmap(RepeatedExperts(then, scaled), batch())


@pytest.mark.parametrize("then, match", [
    # Rows of different samples grouped together: (E*N, D) seen as (N, E, D) with N = 15 and E = 4
    # splits every sample's block of 5 rows over two dims.
    (lambda rows, moe: rows * rows.view(-1, E, D).sum(1).repeat(E, 1), "mixes samples"),
    (lambda rows, moe: rows.cumsum(0), "tiled in blocks"),  # accumulates over every sample's rows
])
def test_ops_that_mix_tiled_rows_are_refused(then, match):
    with pytest.raises(lf.UnsupportedModelError, match=match):
        lf.compile(RepeatedExperts(then)).per_sample_grads(*batch())


class PerHeadWeights(nn.Module):
    """A weight (heads, rows, out, in) applied by matmul to per-sample (heads, B, in, T) data: one
    bmm over heads * B groups, so the batch is tiled in per-head blocks. ``rows=1`` broadcasts
    the weight over the batch; ``rows=B`` gives each batch row its own slice."""

    def __init__(self, rows):
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(2, rows, 5, 4))
        self.proj = nn.Parameter(torch.randn(8, 6))

    def forward(self, x, y):  # x (B, T, 6), y (B,)
        h = (x @ self.proj.t()).view(x.shape[0], x.shape[1], 2, 4).permute(2, 0, 3, 1)  # (H, B, 4, T)
        return (self.w @ h).pow(2).sum((0, 2, 3)) * y


class TiledLinear(RepeatedExperts):
    """A linear layer on the tiled (E*N, D) rows before the experts: addmm with a bias, mm without."""

    def __init__(self, bias):
        super().__init__(then=lambda rows, moe: moe.lin(rows))
        self.lin = nn.Linear(D, D, bias=bias)


def head_batch(B=3):
    g = torch.Generator().manual_seed(1)
    return torch.randn(B, 7, 6, generator=g), torch.rand(B, generator=g) + 0.5


def test_weight_broadcast_over_batch_in_tiled_bmm_gives_exact_per_sample_and_clipped_grads():
    """A per-head weight is the same for every batch row inside bmm's H*B groups: each sample's
    gradient is the sum over its own H groups, so the rule is exact and no row position leaks."""
    from oracles import assert_exact_with_clipped_sum

    assert_exact_with_clipped_sum(PerHeadWeights(rows=1), head_batch())


def test_weight_differing_per_batch_row_in_tiled_bmm_is_refused():
    """A weight with one slice per batch row gives sample i the slice at its row position:
    removing a record moves the others onto other weights, a privacy leak."""
    with pytest.raises(lf.UnsupportedModelError) as e:
        lf.compile(PerHeadWeights(rows=3)).per_sample_grads(*head_batch(B=3))
    assert "op aten.bmm.default" in str(e.value) and "row position" in str(e.value), str(e.value)


@pytest.mark.parametrize("bias", [True, False], ids=["addmm", "mm"])
def test_linear_on_tiled_rows_gives_exact_per_sample_grads_and_clipped_sums(bias):
    """nn.Linear on rows tiled E times: the weight gradient mm over E*N rows regroups each
    sample's rows from every block, so the per-sample gradient is exact."""
    from oracles import assert_exact_with_clipped_sum

    x = batch()[0]
    assert_exact_with_clipped_sum(_LossWeighted(TiledLinear(bias)), (x, torch.rand(x.shape[0]) + 0.5))


class _LossWeighted(nn.Module):
    """``model(x) * y``: a per-sample loss weight, the two-input form the clipped-sum check calls."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x, y):
        return self.model(x) * y
