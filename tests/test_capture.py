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
    """Real 8B shapes, no real memory: what the planner builds on (time is printed, not asserted).
    Two of its 32 layers: each layer is the same graph, and the planner's tests (tests/tools/
    test_plan.py) capture all 32."""
    start = time.time()
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = lf.CausalLMLoss(Llama.from_name("llama3.1-8b", n_layers=2))
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


def _longcat_experts(zero_experts: int):
    import transformers
    from transformers.models.longcat_flash.modeling_longcat_flash import LongcatFlashExperts
    cfg = transformers.LongcatFlashConfig(hidden_size=6, expert_ffn_hidden_size=5, n_routed_experts=3,
                                          zero_expert_num=zero_experts)
    torch.manual_seed(0)
    experts = LongcatFlashExperts(cfg).double()
    for p in experts.parameters():
        torch.nn.init.normal_(p)
    return experts


@pytest.mark.parametrize("zero_experts", [0, 2])
def test_longcat_flash_fixed_shape_experts_equal_the_eager_loop(zero_experts):
    """The capture's stand-in for LongCat-Flash's eager expert loop: same output and gradients
    (zero experts pass their input through; experts no token chose get exactly zero)."""
    from longshield_fx._fixed_shape_forwards import fixed_shape_experts
    experts = _longcat_experts(zero_experts)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 6, generator=g, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 2 + zero_experts, (7, 2), generator=g)
    ids[ids >= 2] += 1  # routed expert 2 is never chosen; 3, 4 are the zero experts
    ids[0] = torch.tensor([0, 1])
    weights = torch.rand(7, 2, generator=g, dtype=torch.float64, requires_grad=True)

    def run():
        out = experts(x, ids, weights)
        grads = torch.autograd.grad(out.pow(2).sum(), [x, weights, *experts.parameters()])
        return out, grads

    eager, eager_grads = run()
    with fixed_shape_experts(experts):
        assert "forward" in vars(experts)
        fixed, fixed_grads = run()
    assert "forward" not in vars(experts)
    torch.testing.assert_close(fixed, eager, rtol=1e-12, atol=1e-12)
    for a, b in zip(fixed_grads, eager_grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert fixed_grads[3][2].abs().sum() == 0 and fixed_grads[2][2:].abs().sum() == 0  # expert 2, zero experts


def test_jetmoe_fixed_shape_experts_equal_the_sort_and_group():
    """The capture's stand-in for JetMoE's sort-and-group experts (MLP experts, and the attention
    experts' map / reduce): same outputs and gradients, an expert no token chose included."""
    import transformers
    from longshield_fx._fixed_shape_forwards import fixed_shape_experts
    from transformers.models.jetmoe.modeling_jetmoe import JetMoeMoA, JetMoeMoE
    cfg = transformers.JetMoeConfig(hidden_size=6, intermediate_size=5, num_local_experts=4, num_experts_per_tok=2,
                                    kv_channels=2, num_key_value_heads=2)
    torch.manual_seed(0)
    experts = torch.nn.ModuleList([JetMoeMoE(cfg), JetMoeMoA(cfg)]).double()
    for p in experts.parameters():
        torch.nn.init.normal_(p)
    with torch.no_grad():  # expert 3 never wins: its router row is far below the others
        for moe in experts:
            moe.router.layer.weight[3] = -100.0
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(2, 5, 6, generator=g, dtype=torch.float64) + 3.0).requires_grad_()
    scores = torch.randn(2, 5, 2, 4, generator=g, dtype=torch.float64)  # stands in for attention

    def run():
        mlp = experts[0](x)
        queries, _, topology = experts[1].map(x)
        attention = experts[1].reduce(queries * scores, topology)
        grads = torch.autograd.grad(mlp.pow(2).sum() + attention.pow(2).sum(), [x, *experts.parameters()])
        return (mlp, queries, attention), grads

    eager, eager_grads = run()
    with fixed_shape_experts(experts):
        assert "forward" in vars(experts[0]) and {"map", "reduce"} <= set(vars(experts[1]))
        fixed, fixed_grads = run()
    assert not {"forward", "map", "reduce"} & (set(vars(experts[0])) | set(vars(experts[1])))
    for a, b in zip(fixed + fixed_grads, eager + eager_grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    unused = [g for (name, _), g in zip(experts.named_parameters(), fixed_grads[1:]) if "_linear" in name]
    assert all(g[3].abs().sum() == 0 for g in unused)


def test_xmod_language_adapters_without_moving_rows_equal_the_eager_masking():
    """The capture's stand-in for X-MOD's language adapters (rows gathered by a boolean mask over
    the batch, written back): same output and gradients, each row through its own language's."""
    import transformers
    from longshield_fx._fixed_shape_forwards import fixed_shape_experts
    from transformers.models.xmod.modeling_xmod import XmodOutput
    cfg = transformers.XmodConfig(hidden_size=8, intermediate_size=12, languages=["en_XX", "de_DE", "fr_XX"],
                                  hidden_dropout_prob=0.0)
    torch.manual_seed(0)
    output = XmodOutput(cfg).double()
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(4, 3, 12, generator=g, dtype=torch.float64, requires_grad=True)
    residual = torch.randn(4, 3, 8, generator=g, dtype=torch.float64)
    lang_ids = torch.tensor([2.0, 0.0, 2.0, 0.0])  # no row of language 1

    def run():
        out = output(hidden, residual, lang_ids)
        return out, torch.autograd.grad(out.pow(2).sum(), [hidden, *output.parameters()])

    eager, eager_grads = run()
    with fixed_shape_experts(output):
        fixed, fixed_grads = run()
    assert "lang_adapter" not in vars(output)
    torch.testing.assert_close(fixed, eager, rtol=1e-12, atol=1e-12)
    for a, b in zip(fixed_grads, eager_grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_only_transformers_output_collector_side_effect_is_silenced():
    """Every HF forward sets and restores transformers' output collector (a module global): dynamo's
    side-effect warning naming only it is dropped; one naming anything else still reaches the user."""
    import warnings

    import transformers

    from longshield_fx._torch import _only_output_collector

    ours = ("While compiling, we found certain side effects happened in the model.forward. Here are the list of "
            "potential sources you can double check: [\"G['__import_transformers_dot_utils_dot_output_capturing']"
            "._active_collector\"]")
    assert _only_output_collector(ours)
    assert not _only_output_collector(ours.replace('_active_collector"]', '_active_collector", "G[\'counter\']"]'))
    assert not _only_output_collector("some other warning")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1)
    model = lf.CausalLMLoss(transformers.AutoModelForCausalLM.from_config(cfg))
    ids = torch.randint(0, 64, (2, 8))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lf.compile(model).per_sample_grads(ids, ids)
    assert not [w for w in caught if "side effects" in str(w.message)], [str(w.message) for w in caught]


def test_a_graph_break_is_refused_naming_the_call_that_broke_it_and_a_way_out():
    class Branchy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 2)

        def forward(self, x):
            y = self.lin(x)
            if y.sum() > 0:  # data-dependent control flow
                y = y * 2
            return y.sum(1)

    with pytest.raises(lf.UnsupportedModelError) as caught:
        capture(Branchy(), (torch.randn(2, 3),))
    message = str(caught.value)
    assert "cannot be traced into one graph" in message and "Way out" in message
    assert "Data-dependent branching" in message and "if y.sum() > 0" in message and "test_capture.py" in message
