"""overlap: waits sink behind compute, collectives keep their order, the verifier catches bad schedules."""
import pytest
import torch

import longshield_fx as lf
from longshield_fx._torch import COLLECTIVES, c10d
from longshield_fx.passes.overlap import OverlapLimits, ScheduleError, schedule, verify_schedule

from oracles import tiny_llama


@pytest.fixture(scope="module")
def engines(cp_graph):
    """Two captures of the same cp=2 step: the shared one and a fresh one (as two ranks would)."""
    return cp_graph(2), cp_graph(2, fresh=True)


def graph(engines):
    return engines[0].gm


def test_each_reduce_scatter_is_waited_after_a_data_gradient_matmul(engines):
    """Every reduce-scatter that has a matmul left to run after it is in flight across one;
    only those issued after the last matmul (the embedding's) cannot be."""
    nodes = list(graph(engines).graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    mms = [index[n] for n in nodes if n.target == torch.ops.aten.mm.default]
    scatters = [n for n in nodes if n.target == c10d.reduce_scatter_tensor.default]
    hidden, hideable = [], []
    for rs in scatters:
        wait = next(u for u in rs.users if u.target == c10d.wait_tensor.default)
        if any(index[rs] < i < index[wait] for i in mms):
            hidden.append(rs.name)
        if any(i > index[rs] for i in mms):
            hideable.append(rs.name)
    assert hideable, "no reduce-scatter before the last matmul: nothing to check"
    assert hidden == hideable


def test_collectives_keep_their_order_and_the_schedule_is_deterministic(engines):
    a, b = engines
    order_a = [n.name for n in a.gm.graph.nodes if n.target in COLLECTIVES]
    order_b = [n.name for n in b.gm.graph.nodes if n.target in COLLECTIVES]
    assert order_a == order_b
    verify_schedule(list(a.gm.graph.nodes), other_ranks=[list(b.gm.graph.nodes)])


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


def test_a_pass_is_disabled_by_name(fake_world):
    """``disable_passes`` leaves a pass out of every graph that has it; an unknown name is refused."""
    with fake_world(2) as mesh:
        engine = lf.compile(tiny_llama(), mesh, config=lf.DPConfig(1.0, 1.0), disable_passes=("overlap",))
        with pytest.raises(ValueError, match=r"\['reorder'\] not in this pipeline"):
            lf.compile(tiny_llama(), mesh, config=lf.DPConfig(1.0, 1.0), disable_passes=("reorder",))
    names = {graph: [p.__name__ for p in passes] for graph, passes in engine.pipelines.items()}
    assert names == {"train": ["batch_dims", "context_parallel", "chunked_loss", "per_sample", "shard_grads", "clip"],
                     "per_sample": ["batch_dims", "context_parallel", "chunked_loss", "per_sample"]}
    assert "overlap" not in repr(engine)


def test_checkpointing_recomputes_collectives_within_the_cap(cp_graph):
    """The checkpoint pass runs after overlap and issues the recomputed block's gathers again,
    each waited at once; overlap scheduled the rest one slot under the cap for them, so the
    final graph keeps it (ZeRO-3 on dp=2 x cp=2, 3 layers: the cap is reached)."""
    nodes = list(cp_graph(2, dp=2, fsdp=("dp", "cp"), checkpoint="block", vocab_size=250, n_layers=3).gm.graph.nodes)
    wait = c10d.wait_tensor.default
    recomputed = [i for i, n in enumerate(nodes) if n.target in COLLECTIVES and n.meta.get("recomputed")]
    assert recomputed and all(nodes[i + 1].target == wait and nodes[i + 1].args[0] is nodes[i] for i in recomputed)
    outstanding, most = set(), 0
    for node in nodes:
        if node.target in COLLECTIVES:
            outstanding.add(node)
        elif node.target == wait:
            outstanding.discard(node.args[0])
        most = max(most, len(outstanding))
    assert most == OverlapLimits().max_in_flight
    verify_schedule(nodes)
