"""The graph utilities the passes share (``longshield_fx.passes._graph``): their shortcuts give
exactly what the torch calls they stand in for give."""
import pytest
import torch
import torch.fx as fx

from longshield_fx._torch import FakeTensorMode
from longshield_fx.passes._graph import GraphBuilder, eliminate_dead_code

aten = torch.ops.aten


@pytest.mark.parametrize("equation, shapes", [
    ("btm,btn->bmn", [(2, 5, 3), (2, 5, 4)]),  # a per-sample linear gradient
    ("b,b...->...", [(2,), (2, 3, 4)]),        # clip's weighted sum
    ("bij->bji", [(2, 3, 4)]),                 # a permutation only
    ("bi,bi->b", [(2, 6), (2, 6)]),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_einsum_gets_the_value_the_fake_mode_gives_it(equation, shapes, dtype):
    fake_mode = FakeTensorMode()
    graph = fx.Graph()
    inputs = []
    for i, shape in enumerate(shapes):
        node = graph.placeholder(f"x{i}")
        with fake_mode:
            node.meta["val"] = torch.empty(shape, dtype=dtype)
        inputs.append(node)
    ours = GraphBuilder(graph, fake_mode)(aten.einsum.default, equation, inputs).meta["val"]
    with fake_mode:
        ref = aten.einsum.default(equation, [n.meta["val"] for n in inputs])
    assert (ours.shape, ours.stride(), ours.dtype, ours.device) == (ref.shape, ref.stride(), ref.dtype, ref.device)
    assert ours.fake_mode is fake_mode


def test_eliminate_dead_code_removes_what_torch_removes_and_keeps_impure_nodes():
    graph = fx.Graph()
    x, y = graph.placeholder("x"), graph.placeholder("y")
    graph.call_function(aten.mul.Tensor, (x, y))                   # dead, pure: goes
    graph.call_function(aten.add_.Tensor, (x, y))                  # dead, mutates x: stays
    graph.call_function(aten.rand.default, ([3],))                 # dead, random: stays
    dead_chain = graph.call_function(aten.neg.default, (y,))
    graph.call_function(aten.exp.default, (dead_chain,))           # dead with its input: both go
    graph.output(graph.call_function(aten.sub.Tensor, (x, y)))
    ours, ref = fx.Graph(), fx.Graph()
    ours.output(ours.graph_copy(graph, {}))
    ref.output(ref.graph_copy(graph, {}))
    eliminate_dead_code(ours)
    ref.eliminate_dead_code()
    kept = [n.target for n in ours.nodes]
    assert kept == [n.target for n in ref.nodes]
    assert kept == ["x", "y", aten.add_.Tensor, aten.rand.default, aten.sub.Tensor, "output"]
