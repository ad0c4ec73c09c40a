"""overlap: waits sink behind compute, collectives keep their order, the verifier catches bad schedules."""
import pytest
import torch

from longshield_fx.passes.overlap import (COLLECTIVES, OverlapLimits, ScheduleError, schedule,
                                          verify_schedule)

from test_shard_grads import build, fake_world

c10d = torch.ops._c10d_functional


@pytest.fixture(scope="module")
def engines():
    with fake_world(2):
        return build(2), build(2)


def graph(engines):
    return engines[0].graph_module


def test_each_reduce_scatter_is_waited_after_a_data_gradient_matmul(engines):
    nodes = list(graph(engines).graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    scatters = [n for n in nodes if n.target == c10d.reduce_scatter_tensor.default]
    assert scatters
    hidden = 0
    for rs in scatters:
        wait = next(u for u in rs.users if u.target == c10d.wait_tensor.default)
        between = nodes[index[rs] + 1:index[wait]]
        hidden += any(n.target == torch.ops.aten.mm.default for n in between)
    # All but the reduce-scatters of the first layer's weights (nothing left to compute) hide.
    assert hidden >= len(scatters) - 4


def test_collectives_keep_their_order_and_the_schedule_is_deterministic(engines):
    a, b = engines
    order_a = [n.name for n in a.graph_module.graph.nodes if n.target in COLLECTIVES]
    order_b = [n.name for n in b.graph_module.graph.nodes if n.target in COLLECTIVES]
    assert order_a == order_b
    verify_schedule(list(a.graph_module.graph.nodes), other_ranks=[list(b.graph_module.graph.nodes)])


def test_in_flight_cap_is_respected(engines):
    gm = graph(engines)
    limits = OverlapLimits(max_in_flight=2)
    order = schedule(gm.graph, limits)
    verify_schedule(order, limits)
    with pytest.raises(ScheduleError, match="in flight"):
        verify_schedule(list(gm.graph.nodes), OverlapLimits(max_in_flight=2))


def test_verifier_rejects_wait_before_issue(engines):
    order = list(graph(engines).graph.nodes)
    wait = next(n for n in order if n.target == c10d.wait_tensor.default)
    broken = [n for n in order if n is not wait]
    broken.insert(broken.index(wait.args[0]), wait)
    with pytest.raises(ScheduleError, match="comes before its collective"):
        verify_schedule(broken)


def test_verifier_rejects_ranks_issuing_in_different_orders(engines):
    order = list(graph(engines).graph.nodes)
    collectives = [i for i, n in enumerate(order) if n.target in COLLECTIVES]
    first = collectives[0]
    other = next(i for i in collectives if str(order[i].args[0].meta["val"].shape) !=
                 str(order[first].args[0].meta["val"].shape) or order[i].target != order[first].target)
    swapped = list(order)
    swapped[first], swapped[other] = swapped[other], swapped[first]
    with pytest.raises(ScheduleError, match="different order"):
        verify_schedule(order, other_ranks=[swapped])
