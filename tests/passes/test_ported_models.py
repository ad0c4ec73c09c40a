"""Models ported from Opacus that once were refused: PackedSequence RNNs, a positional table read
as ``pos[arange(T)]`` (alone and tied), a custom ``autograd.Function`` whose backward sums a
parameter's gradient over the batch, ``diag(param)``; and EmbeddingBag bags built from
``x[mask]``, refused by name. Each against a float64 per-sample loop (each sample alone)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from opacus.layers import DPGRU, DPLSTM, DPRNN
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import longshield_fx as lf

from oracles import per_sample_loop


def _assert_exact(model: nn.Module, batch: tuple, samples: list[tuple]):
    ours = lf.compile(model).per_sample_grads(*batch)
    ref = per_sample_loop(model, samples)
    assert set(ours) == set(ref)
    for name, r in ref.items():
        torch.testing.assert_close(ours[name].double(), r, atol=1e-5, rtol=1e-4, msg=name)


class PackedRNN(nn.Module):
    """An Opacus user's model: it packs the padded batch itself, and its loss reads every step's
    output and the last states."""

    def __init__(self, rnn: nn.Module, batch_first: bool, enforce_sorted: bool):
        super().__init__()
        self.rnn, self.batch_first, self.enforce_sorted = rnn, batch_first, enforce_sorted

    def forward(self, x, lengths):  # x: (B, T, D)
        x = x if self.batch_first else x.transpose(0, 1)
        packed = pack_padded_sequence(x, lengths, batch_first=self.batch_first, enforce_sorted=self.enforce_sorted)
        out, h = self.rnn(packed)
        h = h[0] if isinstance(h, tuple) else h
        out, _ = pad_packed_sequence(out, batch_first=True)
        return out.abs().flatten(1).sum(1) + h.transpose(0, 1).pow(2).flatten(1).sum(1)


# (layer, batch_first, lengths, enforce_sorted): every layer kind, bidirectional and two layers deep
PACKED = [
    (lambda bf: nn.RNN(4, 5, num_layers=2, bidirectional=True, batch_first=bf), True, [4, 3, 1], True),
    (lambda bf: nn.GRU(4, 5, num_layers=2, bidirectional=True, batch_first=bf), False, [4, 3, 1], False),
    (lambda bf: nn.LSTM(4, 5, num_layers=2, bidirectional=True, batch_first=bf, proj_size=3), True, [2, 4, 1], False),
    (lambda bf: DPRNN(4, 5, num_layers=2, bidirectional=True, batch_first=bf), False, [2, 4, 1], False),
    (lambda bf: DPGRU(4, 5, num_layers=2, bidirectional=True, batch_first=bf), False, [4, 2, 2], True),
    (lambda bf: DPLSTM(4, 5, num_layers=2, bidirectional=True, batch_first=bf), True, [1, 3, 4], False),
]


@pytest.mark.parametrize("layer, batch_first, lengths, enforce_sorted", PACKED,
                         ids=["RNN-bf-sorted-enforced", "GRU-tf-sorted", "LSTMproj-bf-unsorted", "DPRNN-tf-unsorted",
                              "DPGRU-tf-sorted-enforced", "DPLSTM-bf-unsorted"])
def test_packed_sequence_rnn_exact_against_each_sample_packed_alone(layer, batch_first, lengths, enforce_sorted):
    torch.manual_seed(0)
    model = PackedRNN(layer(batch_first), batch_first, enforce_sorted)
    lengths = torch.tensor(lengths)
    x = torch.randn(3, 4, 4)
    samples = [(x[i:i + 1, :lengths[i]], lengths[i:i + 1]) for i in range(3)]
    _assert_exact(model, (x, lengths), samples)


def test_pad_packed_sequence_pads_to_total_length_with_the_padding_value():
    class Padded(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.GRU(2, 3, batch_first=True)

        def forward(self, x, lengths):
            out, _ = self.rnn(pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False))
            out, _ = pad_packed_sequence(out, batch_first=True, padding_value=2.0, total_length=5)
            assert out.shape[1] == 5
            return (out - 2.0).pow(2).flatten(1).sum(1)  # the padding adds 0

    torch.manual_seed(1)
    x, lengths = torch.randn(2, 3, 2), torch.tensor([1, 3])
    _assert_exact(Padded(), (x, lengths), [(x[i:i + 1, :lengths[i]], lengths[i:i + 1]) for i in range(2)])


class PositionTable(nn.Module):
    def __init__(self, tied: bool):
        super().__init__()
        self.emb = nn.Embedding(8, 4)
        self.head = nn.Linear(4, 8, bias=False)
        if tied:
            self.head.weight = self.emb.weight
        self.pos = nn.Parameter(torch.randn(6, 4))

    def forward(self, ids):
        T = ids.shape[1]
        h = self.emb(ids) + self.pos[torch.arange(T)] + self.emb.weight[torch.arange(T)]
        return self.head(h).pow(2).flatten(1).sum(1)


@pytest.mark.parametrize("tied", [False, True])
def test_a_table_indexed_by_arange_is_exact(tied):
    torch.manual_seed(0)
    ids = torch.randint(0, 8, (3, 5))
    _assert_exact(PositionTable(tied), (ids,), [(ids[i:i + 1],) for i in range(3)])


class _ScaleSummingItsGrad(torch.autograd.Function):
    """``x * w``, the backward summing w's gradient over the batch itself."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * w, (g * x).sum(0)


class CustomFunctionModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))
        self.lin = nn.Linear(4, 2)

    def forward(self, x):
        return self.lin(_ScaleSummingItsGrad.apply(x, self.w)).pow(2).sum(1)


class DiagModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.d = nn.Parameter(torch.randn(4))
        self.W = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return (x @ torch.diag(self.d) + x * torch.diagonal(self.W)).pow(2).sum(1)


@pytest.mark.parametrize("model", [CustomFunctionModel, DiagModel])
def test_custom_function_summing_over_the_batch_and_diag_are_exact(model):
    torch.manual_seed(0)
    x = torch.randn(3, 4)
    _assert_exact(model(), (x,), [(x[i:i + 1],) for i in range(3)])


def test_embedding_bag_over_masked_flat_ids_is_refused_naming_the_mask_and_the_way_out():
    class MaskedBags(nn.Module):
        def __init__(self):
            super().__init__()
            self.bag = nn.EmbeddingBag(10, 3, mode="sum")

        def forward(self, x):  # x: (B, n) ids, -1 = no id
            mask = x >= 0
            lengths = mask.sum(1)
            return self.bag(x[mask], lengths.cumsum(0) - lengths).sum(1)

    x = torch.tensor([[1, 2, -1], [3, -1, -1], [4, 5, 6]])
    with pytest.raises(lf.UnsupportedModelError, match=r"x\[mask\].*padding_idx"):
        lf.compile(MaskedBags()).per_sample_grads(x)


class ShapeMean(nn.Module):
    """A "mean" loss written into the model: each sample's loss divided by ``x.shape[0]`` (or, the
    refused form, by the number of non-zero rows, which the other samples decide)."""

    def __init__(self, by: str | None):
        super().__init__()
        self.lin, self.by = nn.Linear(3, 2), by

    def forward(self, x):
        per = self.lin(x).pow(2).sum(1)
        if self.by == "shape":
            return per / x.shape[0]
        if self.by == "count":
            return per / (x.abs().sum(1) > 0).sum()
        return per


def test_a_loss_divided_by_the_batch_shape_is_scaled_by_the_physical_size():
    torch.manual_seed(0)
    divided, plain = ShapeMean("shape"), ShapeMean(None)
    plain.load_state_dict(divided.state_dict())
    for B in (3, 4):  # the divisor is the physical size, whatever the rows hold (docs/concepts.md)
        x = torch.randn(B, 3)
        x[-1] = 0  # a padding-like row still counts in x.shape[0]
        ours, ref = lf.compile(divided).per_sample_grads(x), lf.compile(plain).per_sample_grads(x)
        for name in ref:
            torch.testing.assert_close(ours[name] * B, ref[name], msg=name)
    with pytest.raises(lf.UnsupportedModelError, match="mixes samples"):
        lf.compile(ShapeMean("count")).per_sample_grads(torch.randn(3, 3))
