"""batch_dims: sample dimensions are tracked through views; sample-mixing ops are rejected."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import longshield_fx as lf
from longshield_fx.capture import capture
from longshield_fx.passes import PassContext
from longshield_fx.passes.batch_dims import BatchDim, batch_dims

from oracles import MLP, mlp_batch


def tagged(model, batch):
    captured = capture(model, batch)
    gm = batch_dims(captured.gm, PassContext(captured, batch[0].shape[0]))
    return {n.name: n for n in gm.graph.nodes}


def test_folded_batch_times_tokens_is_tracked():
    nodes = tagged(MLP(), mlp_batch(B=4, T=5))
    # nn.Linear flattens (B, T, d) to (B*T, d): the batch is folded with 5 rows per sample.
    assert nodes["view"].meta["batch_dim"] == BatchDim(0, 5)
    assert nodes["view_1"].meta["batch_dim"] == BatchDim(0, 1)  # back to (B, T, hidden)
    assert nodes["primals_1"].meta["batch_dim"] is None  # a weight
    # The weight-gradient mm reduces over the batch in the backward: tagged None.
    weight_grads = [n for n in nodes.values() if n.target == torch.ops.aten.mm.default
                    and n.meta["partitioner_tag"] == "is_backward" and n.meta["batch_dim"] is None]
    assert len(weight_grads) == 2


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

    with pytest.raises((lf.UnsupportedModelError, ValueError), match=r"per-sample losses of shape \(8,\)|mixes samples"):
        lf.compile(ScalarLoss()).per_sample_grads(torch.randn(8, 4))
