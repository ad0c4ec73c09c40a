"""``compile(..., inductor=True)``: the rewritten train graph through inductor gives the plain
graph's norms, clipped sums and loss within float rounding, on packed documents (the custom ops
of the document attention, the per-unit products and the LM head called from compiled code),
with a unit whose gradient is not finite kept apart as in the plain graph."""
import dataclasses

import pytest
import torch

import longshield_fx as lf
from longshield_fx.models.llama import Llama
from longshield_fx.packing import pack_documents

from oracles import PACKED_CFG as CFG, PACKED_C as C, PACKED_ROWS as ROWS, PACKED_T as T, PACKED_U as U
from oracles import packed_units


def test_the_packed_step_through_inductor_equals_the_plain_graph():
    torch.manual_seed(0)
    lm = Llama(dataclasses.replace(CFG, n_layers=1))  # one block: inductor's compile is most of the test
    config = lf.DPConfig(max_grad_norm=C, noise_multiplier=0.0, insecure_seed=0)
    plain = lf.compile(lf.PackedCausalLMLoss(lm), config=config, packed_units=U)
    fused = lf.compile(lf.PackedCausalLMLoss(lm), config=config, packed_units=U, inductor=True)
    (pb, *_), _ = pack_documents(packed_units(), seq_len=T, rows=ROWS, unit_slots=U)
    V = CFG.vocab_size
    clean = torch.where(pb.input_ids == V - 1, V - 2, pb.input_ids)
    dirty = torch.where(pb.units == 0, V - 1, clean)  # unit 0 reads an embedding row that overflows
    results = []
    for engine in (plain, fused):
        for ids in (clean, dirty):
            with torch.no_grad():
                lm.tok_embeddings.weight[V - 1] = 3e38 if ids is dirty else 0.5
            loss = engine.accumulate(ids, pb.labels, pb.position_ids, pb.units)
            results.append((engine.last_norms.clone(), {n: s.clone() for n, s in engine._accum.items()}, loss))
            engine._accum = None
    for (n0, s0, l0), (n1, s1, l1) in zip(results[:2], results[2:]):
        finite = torch.isfinite(n0)
        assert torch.equal(finite, torch.isfinite(n1))
        torch.testing.assert_close(n1[finite], n0[finite], rtol=1e-5, atol=0)
        scale = max(float(v.abs().max()) for v in s0.values())
        assert max(float((s1[n] - s0[n]).abs().max()) for n in s0) <= 1e-5 * scale
        if bool(finite.all()):
            torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6)
    assert bool(torch.isfinite(results[0][0]).all()) and not bool(torch.isfinite(results[1][0][0]))
    assert all(bool(torch.isfinite(s).all()) for s in results[3][1].values())  # unit 0 added nothing
    assert fused.captures == 1 and len(fused._compiled) == 1


class _PerSampleMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))

    def forward(self, x, y):
        return torch.nn.functional.cross_entropy(self.net(x), y, reduction="none")


def test_an_unpacked_step_through_inductor_equals_the_plain_graph():
    """A graph not yet run when it is compiled (its module still lazily recompiled) compiles too."""
    torch.manual_seed(0)
    model = _PerSampleMLP()
    config = lf.DPConfig(max_grad_norm=0.5, noise_multiplier=0.0, insecure_seed=0)
    g = torch.Generator().manual_seed(1)
    x, y, mask = torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g), torch.tensor([1., 1., 1., 0.])
    out = []
    for inductor in (False, True):
        engine = lf.compile(model, config=config, inductor=inductor)
        loss = engine.accumulate(x, y, mask=mask)
        out.append((loss, engine.last_norms.clone(), engine._accum))
    (l0, n0, s0), (l1, n1, s1) = out
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(n1, n0, rtol=1e-5, atol=0)
    for n in s0:
        torch.testing.assert_close(s1[n], s0[n], rtol=1e-5, atol=1e-6)


def test_inductor_with_a_mesh_is_refused_naming_the_way_out():
    with pytest.raises(ValueError, match="inductor=True runs on one process.*inductor=False"):
        lf.compile(lf.PackedCausalLMLoss(Llama(CFG)), object(), packed_units=U, inductor=True)
