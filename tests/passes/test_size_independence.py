"""No verdict of ``batch_dims`` hinges on a size coincidence.

Each model below runs at B = 1, 2, 3, 4 with its feature / channel / head size ``s`` equal to B
and different from it (5, which no B here equals): an accepted model is exact against a per-sample
autograd loop at every one of those shapes, a refused one is refused at every one, for the same
reason. A batch of one is where sizes coincide most (every size-1 dim could hold the batch).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import longshield_fx as lf


class Loss(nn.Module):
    """``layer`` on (B, ...) data (moved to (T, B, ...) when ``batch_second``), summed per sample
    against a fixed random target direction."""

    def __init__(self, layer: nn.Module, batch_second: bool = False, first: bool = False):
        super().__init__()
        self.layer, self.batch_second, self.first = layer, batch_second, first

    def forward(self, x, w):
        x = x.transpose(0, 1) if self.batch_second else x
        out = self.layer(x)
        out = out[0] if self.first else out
        out = out.transpose(0, 1) if self.batch_second else out
        return (out * w).flatten(1).sum(1)


class SequenceBias(nn.Module):
    """Opacus's SequenceBias: a learned vector appended to every sequence (``cat`` of ``repeat``)."""

    def __init__(self, s: int):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(s))

    def forward(self, x):
        return torch.cat([x, self.bias.repeat(x.shape[0], 1, 1)], 1)


class MHA(nn.Module):
    def __init__(self, s: int):
        super().__init__()
        self.attn = nn.MultiheadAttention(2 * s, s)

    def forward(self, x):
        return self.attn(x, x, x)[0]


class Centred(nn.Module):
    """Subtracts the batch mean: mixes samples."""

    def __init__(self, s: int):
        super().__init__()
        self.fc = nn.Linear(s, s)

    def forward(self, x):
        y = self.fc(x)
        return y - y.mean(0, keepdim=True)


def _eval(module: nn.Module) -> nn.Module:
    module.eval()
    with torch.no_grad():
        module.running_mean.normal_()
        module.running_var.uniform_(0.5, 2.0)
    return module


# name -> (build(s) -> model, input shape after B given s, refusal text or None)
MODELS = {
    "linear, batch second": (lambda s: Loss(nn.Linear(s, 3), batch_second=True), lambda s: (2, s), None),
    "multi-head attention, batch second": (lambda s: Loss(MHA(s), batch_second=True), lambda s: (3, 2 * s), None),
    "sequence bias": (lambda s: Loss(SequenceBias(s)), lambda s: (4, s), None),
    "group norm, one group": (lambda s: Loss(nn.GroupNorm(1, s)), lambda s: (s, 3), None),
    "instance norm": (lambda s: Loss(nn.InstanceNorm1d(s, affine=True)), lambda s: (s, 4), None),
    "batch norm, eval": (lambda s: Loss(_eval(nn.BatchNorm1d(s))), lambda s: (s, 3), None),
    "conv1d": (lambda s: Loss(nn.Conv1d(s, s, 2)), lambda s: (s, 4), None),
    "embedding bag, mean": (lambda s: Loss(nn.EmbeddingBag(7, s, mode="mean")), lambda s: (3,), None),
    "gru, batch first": (lambda s: Loss(nn.GRU(s, s, batch_first=True), first=True), lambda s: (3, s), None),
    "lstm, batch second": (lambda s: Loss(nn.LSTM(s, 2, num_layers=2, bidirectional=True), batch_second=True,
                                          first=True), lambda s: (3, s), None),
    "batch norm, training": (lambda s: Loss(nn.BatchNorm1d(s)), lambda s: (s, 3), "mixes samples"),
    "batch norm, no running statistics": (lambda s: Loss(nn.BatchNorm1d(s, track_running_stats=False)),
                                          lambda s: (s, 3), "mixes samples"),
    "minus the batch mean": (lambda s: Loss(Centred(s)), lambda s: (s,), "mixes samples"),
}


def _inputs(name: str, B: int, s: int):
    build, shape, _ = MODELS[name]
    torch.manual_seed(B * 10 + s)
    model = build(s)
    if "embedding" in name:
        x = torch.randint(0, 7, (B, *shape(s)))
    else:
        x = torch.randn(B, *shape(s))
    with torch.no_grad():
        out = model.layer(x.transpose(0, 1) if model.batch_second else x)
        out = out[0] if model.first else out
        out = out.transpose(0, 1) if model.batch_second else out
    return model, (x, torch.randn_like(out))


def _loop(model: nn.Module, batch: tuple) -> dict[str, torch.Tensor]:
    model = copy.deepcopy(model).double()
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    rows = []
    for i in range(batch[0].shape[0]):
        sample = tuple(t[i:i + 1].double() if t.is_floating_point() else t[i:i + 1] for t in batch)
        rows.append(torch.autograd.grad(model(*sample).sum(), list(params.values())))
    return {n: torch.stack([r[k] for r in rows]) for k, n in enumerate(params)}


def _verdict(name: str, B: int, s: int) -> str:
    model, batch = _inputs(name, B, s)
    try:
        ours = lf.compile(model).per_sample_grads(*batch)
    except lf.UnsupportedModelError as e:
        return f"refused: {e}"
    ref = _loop(model, batch)
    for n, r in ref.items():
        torch.testing.assert_close(ours[n].double(), r, atol=1e-5, rtol=1e-4, msg=f"{name}, B={B}, s={s}: {n}")
    return "exact"


@pytest.mark.parametrize("name", MODELS)
def test_the_verdict_is_the_same_at_every_batch_size_and_every_size_equal_to_it_or_not(name):
    refusal = MODELS[name][2]
    verdicts = {(B, s): _verdict(name, B, s) for B in (1, 2, 3, 4) for s in (B, 5)}
    for (B, s), v in verdicts.items():
        if refusal is None:
            assert v == "exact", (B, s, v)
        else:
            assert v.startswith("refused") and refusal in v, (B, s, v)


def test_a_batch_of_one_that_needs_the_two_sample_graph_trains_as_one_sample():
    """Linear on batch-second data at B = 1 runs the two-sample graph with the second row a masked
    copy: one real sample accumulated, its norm alone reported, the clipped sum that sample's."""
    from longshield_fx.data import LogicalBatch

    torch.manual_seed(0)
    model = Loss(nn.Linear(3, 2), batch_second=True)
    x, w = torch.randn(1, 4, 3), torch.randn(1, 4, 2)
    (ref,) = [_loop(model, (x, w))]
    norm = torch.sqrt(sum(g.pow(2).sum() for g in ref.values()))
    clip = 0.5 * float(norm)
    engine = lf.compile(model, config=lf.DPConfig(clip, 0.0))
    engine.accumulate(x, w)
    assert engine.lower(x, w).ctx.batch_size == 2 and engine.last_norms.shape == (1,)
    torch.testing.assert_close(engine.last_norms.double(), norm.reshape(1), rtol=1e-5, atol=1e-6)
    engine.finalize(LogicalBatch(size=1, indices=torch.arange(1), physical=[], sample_rate=1.0, expected_size=1.0))
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad.double(), ref[n][0] * clip / norm, rtol=1e-5, atol=1e-6)
