"""gather_params (and overlap's prefetch of its gathers) on a fake world of dp=2 x cp=2, ZeRO-3
over all four ranks; the tiny Llama with a vocabulary of 250, so its embedding and LM head
shards are uneven (63 rows, the last rank's padded). Values: tests/runtime/test_parallel.py."""
import math

import pytest
import torch

from longshield_fx._torch import c10d
from longshield_fx.passes._graph import is_backward, region_of
from longshield_fx.passes.gather_params import _derived
from longshield_fx.passes.overlap import collective_signature, verify_schedule

GATHER = c10d.all_gather_into_tensor.default
N = 4


@pytest.fixture(scope="module")
def plain(cp_graph):
    return cp_graph(2, dp=2, fsdp=("dp", "cp"), vocab_size=250)


@pytest.fixture(scope="module")
def block(cp_graph):
    return cp_graph(2, dp=2, fsdp=("dp", "cp"), checkpoint="block", vocab_size=250)


def param_gathers(shared) -> dict:
    """parameter name -> its placeholder and the gathers reading it (graph order)."""
    captured = shared.lowered.captured
    out = {}
    for ph, (kind, name) in zip(captured.placeholders, captured.inputs):
        if kind == "param":
            out[name] = ph, [u for u in shared.gm.graph.nodes if u in ph.users]
    return out


def chain(gather) -> list:
    """A gather's nodes: the collective, its wait and the slice dropping padding, if any."""
    wait = next(iter(gather.users))
    users = list(wait.users)
    return [gather, wait, users[0]] if len(users) == 1 and users[0].target == torch.ops.aten.slice.Tensor else [gather, wait]


def readers(gather) -> list:
    """The nodes reading the gathered parameter or a forward view of it (not the chain)."""
    derived = _derived(chain(gather))
    return [u for d in derived for u in d.users if u not in derived]


def test_each_parameter_enters_as_its_padded_shard_and_is_only_gathered(plain):
    model = plain.engine.model
    for name, (ph, users) in param_gathers(plain).items():
        full = model.get_parameter(name).shape
        rows = math.ceil(full[0] / N)
        assert tuple(ph.meta["val"].shape) == (rows, *full[1:]), name
        assert users and all(u.target == GATHER and u.args[1:] == (N, plain.engine.sharding.group.group_name)
                             for u in users), name
        assert tuple(chain(users[0])[-1].meta["val"].shape) == tuple(full), name  # the padding rows are sliced off
    assert math.ceil(250 / N) * N != 250  # the vocabulary's shards are uneven


def test_one_gather_per_phase_and_no_forward_copy_lives_into_the_backward(plain):
    """Reshard after forward: the forward's gather, and everything the forward computes from
    it alone (transposes, views), is read by no backward node; the backward gathers again."""
    backward_gathers = 0
    for name, (ph, users) in param_gathers(plain).items():
        forward = [g for g in users if not is_backward(g)]
        backward = [g for g in users if is_backward(g)]
        assert len(forward) == 1 and len(backward) <= 1, name
        backward_gathers += len(backward)
        assert not any(is_backward(u) for u in readers(forward[0])), name
    # every matrix and norm weight is needed by the backward (the embedding's gradient is not)
    assert backward_gathers == len(param_gathers(plain)) - 2


def test_block_checkpointing_recomputes_each_blocks_gather_with_the_block(block):
    recomputed, own = [], []
    for name, (ph, users) in param_gathers(block).items():
        backward = [g for g in users if is_backward(g)]
        (recomputed if ".layers." in name else own).extend(g.meta.get("recomputed", False) for g in backward)
    assert recomputed and all(recomputed)  # the checkpoint pass re-gathers with the block
    assert own and not any(own)  # parameters outside blocks: gather_params' own backward gather


def test_each_blocks_gathers_are_issued_before_the_previous_blocks_compute(plain):
    nodes = list(plain.gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    issued, first_use = {}, {}
    for name, (ph, users) in param_gathers(plain).items():
        for g in users:
            phase = "backward" if is_backward(g) else "forward"
            reading = readers(g)
            block = next((region_of(r) for r in reading if region_of(r)), None)
            if block is None:
                continue
            key = (phase, block.rsplit(".", 2)[-2] + "." + block.rsplit(".", 1)[-1])  # "layers.1"
            issued[key] = min(issued.get(key, len(nodes)), index[g])
            first_use[key] = min(first_use.get(key, len(nodes)), min(index[r] for r in reading))
    for phase, ahead, behind in (("forward", "layers.1", "layers.0"), ("backward", "layers.0", "layers.1")):
        assert issued[phase, ahead] < first_use[phase, behind], phase  # prefetched one block ahead
        assert issued[phase, behind] < issued[phase, ahead], phase  # in order


def test_every_rank_issues_the_same_collectives_gathers_included(plain, cp_graph):
    """The graphs of the other ranks differ (sequence slices, which rank contributes a replicated
    sum) but issue the same collectives in the same order."""
    others = [cp_graph(2, dp=2, fsdp=("dp", "cp"), vocab_size=250, rank=r) for r in (1, 2, 3)]
    kinds = {op for op, *_ in collective_signature(plain.gm.graph.nodes)}
    assert str(GATHER) in kinds
    targets = [[n.target for n in g.gm.graph.nodes] for g in (plain, others[0])]
    assert targets[0] != targets[1]  # cp rank 1's graph is not rank 0's
    verify_schedule(list(plain.gm.graph.nodes), other_ranks=[list(o.gm.graph.nodes) for o in others])


def test_bf16_compute_gathers_bf16_while_the_shards_stay_fp32(fake_world):
    import longshield_fx as lf
    from oracles import tiny_llama

    with fake_world(2, 2) as mesh:
        model = tiny_llama()
        engine = lf.compile(model, mesh, fsdp=("dp", "cp"),
                            config=lf.DPConfig(1.0, 1.0, compute_dtype=torch.bfloat16))
        ids = torch.zeros(2, 32, dtype=torch.long)
        gm = engine.lower(ids, ids).gm
        masters = {p.to_local().dtype for p in model.parameters()}
    gathers = [n for n in gm.graph.nodes if n.target == GATHER]
    assert gathers and {g.meta["val"].dtype for g in gathers} == {torch.bfloat16}
    assert {g.args[0].meta["val"].dtype for g in gathers} == {torch.bfloat16}  # cast before the gather
    assert masters == {torch.float32}
