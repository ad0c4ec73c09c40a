"""capture: one joint graph, parameters as inputs, a grad node per trainable parameter."""
import time

import pytest
import torch

import longshield_fx as lf
from longshield_fx._torch import FakeTensorMode
from longshield_fx.capture import capture
from longshield_fx.models import Llama
from longshield_fx.passes import PassContext, lower, pipeline
from longshield_fx.passes._context import PER_SAMPLE_GRAD

from oracles import MLP, mlp_batch, tiny_llama, token_batch


def test_parameters_are_inputs_and_grads_are_mapped():
    model = MLP()
    captured = capture(model, mlp_batch())
    kinds = [k for k, _ in captured.inputs]
    assert kinds == ["param"] * len(list(model.parameters())) + ["input", "input", "cotangent"]
    assert captured.param_names == [n for n, _ in model.named_parameters()]
    for name, p in model.named_parameters():
        node = captured.grad_nodes[name]
        assert tuple(node.meta["val"].shape) == tuple(p.shape)
    outputs = captured.gm.graph.output_node().args[0]
    assert list(outputs[1:]) == [captured.grad_nodes[n] for n in captured.param_names]
    # The captured graph computes the loss and the gradient of its sum.
    x, y = mlp_batch()
    loss, *grads = captured.gm(*captured.gather_args(model, (x, y), torch.ones(4)))
    torch.testing.assert_close(loss, model(x, y))
    model(x, y).sum().backward()
    for g, (_, p) in zip(grads, model.named_parameters()):
        torch.testing.assert_close(g, p.grad)


def test_frozen_parameters_get_no_gradient():
    model = tiny_llama()
    model.lm.norm.weight.requires_grad_(False)
    captured = capture(model, token_batch())
    assert "lm.norm.weight" not in captured.param_names
    assert ("param", "lm.norm.weight") in captured.inputs


@pytest.mark.slow
def test_llama_8b_shapes_capture_on_fake_tensors():
    """Real 8B shapes, no real memory: what the planner builds on (time is printed, not asserted)."""
    start = time.time()
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = lf.CausalLMLoss(Llama.from_name("llama3.1-8b"))
        ids = torch.randint(0, 128256, (1, 4096))
    captured = capture(model, (ids, ids))
    lowered = lower(PassContext(captured, 1), pipeline(training=False))
    elapsed = time.time() - start
    names = [n for n, _ in model.named_parameters()]
    assert captured.param_names == names
    assert all(PER_SAMPLE_GRAD in lowered.ctx.param_meta(n) for n in names)
    wk = lowered.ctx.param_meta("lm.layers.0.attention.wk.weight")[PER_SAMPLE_GRAD]
    assert tuple(wk.dense.meta["val"].shape) == (1, *model.lm.layers[0].attention.wk.weight.shape)
    print(f"8B capture + batch_dims + per_sample on fake tensors: {elapsed:.1f}s")


class ReassignsItsBuffer(torch.nn.Module):
    """CTRL's positional table: a buffer the forward assigns to itself through a no-op ``to``."""

    def __init__(self, persistent):
        super().__init__()
        self.fc = torch.nn.Linear(3, 3)
        self.table = torch.nn.Buffer(torch.randn(5, 3), persistent=persistent)

    def forward(self, x):
        self.table = self.table.to(device=x.device, dtype=x.dtype)
        return (self.fc(x) + self.table).pow(2).sum((1, 2))


@pytest.mark.parametrize("persistent", [False, True])
def test_a_buffer_reassigned_to_itself_in_forward_is_captured(persistent):
    from oracles import assert_matches_vmap
    model = ReassignsItsBuffer(persistent)
    table, keys = model.table, set(model.state_dict())
    x = torch.randn(4, 5, 3, generator=torch.Generator().manual_seed(0))
    engine = lf.compile(model)
    assert_matches_vmap(model, (x,), ours=engine.per_sample_grads(x))
    engine.per_sample_grads(x)
    assert engine.captures == 1  # the capture's guards hold on the next step
    assert model.table is table and set(model.state_dict()) == keys  # the live module is untouched
