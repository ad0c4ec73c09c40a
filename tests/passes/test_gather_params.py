"""gather_params (and overlap's prefetch of its gathers) on a fake world of dp=2 x cp=2, ZeRO-3
over all four ranks (and hybrid over cp); the tiny Llama with 3 layers and a vocabulary of
250, so its embedding and LM head shards are uneven (63 rows, the last rank's padded) and
"one block ahead" differs from "every block at once". Values: one real (gloo) rank here,
four in tests/runtime/test_parallel.py."""
import contextlib
import math
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import longshield_fx as lf
from longshield_fx._torch import c10d
from longshield_fx.passes._graph import is_backward, region_of
from longshield_fx.passes.gather_params import _derived
from longshield_fx.passes.overlap import collective_signature, verify_schedule

from oracles import logical, tiny_llama, token_batch

GATHER = c10d.all_gather_into_tensor.default
N = 4
MODEL = dict(vocab_size=250, n_layers=3)
LAYOUTS = {"zero3": dict(fsdp=("dp", "cp")), "hybrid": dict(fsdp=("cp",)),
           "zero3-block": dict(fsdp=("dp", "cp"), checkpoint="block"),
           "zero3-kept": dict(fsdp=("dp", "cp"), reshard_after_forward=False),
           "zero3-kept-block": dict(fsdp=("dp", "cp"), checkpoint="block", reshard_after_forward=False)}


@pytest.fixture(scope="module")
def graph_of(cp_graph, fake_world):
    """``graph_of(layout, rank=0)``: the training graph of the tiny Llama (``MODEL``) lowered
    on rank ``rank``'s view of the fake dp=2 x cp=2 world, for a ``LAYOUTS`` entry; memoised.
    ``cp_graph`` (shared with other files) where it can build the layout."""
    kept = {}

    def build(layout, rank=0):
        kw = dict(LAYOUTS[layout])
        if kw.pop("reshard_after_forward", True):
            return cp_graph(2, dp=2, rank=rank, **kw, **MODEL)
        if (layout, rank) not in kept:
            with fake_world(2, 2, rank=rank) as mesh:
                engine = lf.compile(tiny_llama(**MODEL), mesh, config=lf.DPConfig(1.0, 1.0),
                                    reshard_after_forward=False, **kw)
                ids = torch.zeros(2, 32, dtype=torch.long)
                lowered = engine.lower(ids, ids)
            kept[layout, rank] = SimpleNamespace(engine=engine, lowered=lowered, gm=lowered.gm)
        return kept[layout, rank]

    return build


@pytest.fixture(scope="module")
def plain(graph_of):
    return graph_of("zero3")


@pytest.fixture(scope="module")
def block(graph_of):
    return graph_of("zero3-block")


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
        assert users and all(u.target == GATHER and u.args[1:] == (N, plain.engine.sharding.group_name)
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


def test_each_blocks_gathers_are_issued_one_block_ahead_no_earlier(plain):
    """Per phase, with blocks in the order they compute (layers.0, 1, 2 forward; 2, 1, 0
    backward): block k+1's gathers are issued after block k-1's first use and before block k's
    first use, i.e. while block k-1 computes, neither late nor hoisted to the top."""
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
    for phase in ("forward", "backward"):
        blocks = sorted((b for p, b in first_use if p == phase), key=lambda b: first_use[phase, b])
        expected = ["layers.0", "layers.1", "layers.2"]
        assert blocks == (expected if phase == "forward" else expected[::-1]), phase
        for k in range(len(blocks) - 1):
            done, current, ahead = blocks[k - 1] if k else None, blocks[k], blocks[k + 1]
            assert issued[phase, current] < issued[phase, ahead] < first_use[phase, current], (phase, ahead)
            if done is not None:  # not hoisted: block k+1 travels while block k-1 computes
                assert first_use[phase, done] < issued[phase, ahead], (phase, ahead)


@pytest.mark.parametrize("layout", ["zero3", "hybrid", "zero3-block", "zero3-kept"])
def test_every_rank_issues_the_same_collectives_gathers_included(graph_of, layout):
    """The graphs of the other ranks differ (sequence slices, which rank contributes a replicated
    sum) but issue the same collectives in the same order: ZeRO-3, hybrid (the other dp
    replica's cp group under another name), block checkpointing (re-gathers recomputed with
    the block) and without resharding."""
    graphs = [graph_of(layout, rank) for rank in range(N)]
    kinds = {op for op, *_ in collective_signature(graphs[0].gm.graph.nodes)}
    assert str(GATHER) in kinds
    targets = [[n.target for n in g.gm.graph.nodes] for g in graphs[:2]]
    assert targets[0] != targets[1]  # cp rank 1's graph is not rank 0's
    verify_schedule(list(graphs[0].gm.graph.nodes), other_ranks=[list(g.gm.graph.nodes) for g in graphs[1:]])


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
        fsdp_group = engine.sharding.group_name
    gathers = [n for n in gm.graph.nodes if n.target == GATHER and n.args[2] == fsdp_group]  # not the token rows'
    assert gathers and {g.meta["val"].dtype for g in gathers} == {torch.bfloat16}
    assert {g.args[0].meta["val"].dtype for g in gathers} == {torch.bfloat16}  # cast before the gather
    assert masters == {torch.float32}


# --- reshard_after_forward=False: the backward reads the forward's gather ------------------------

@pytest.mark.parametrize("layout", ["zero3-kept", "zero3-kept-block"])
def test_without_resharding_each_parameter_is_gathered_once_and_the_backward_reads_it(graph_of, layout):
    """One gather per parameter, in the forward; the backward reads it (or the forward's views
    of it) for every parameter it needs. Under block checkpointing the gather is kept, not
    recomputed with the block: only the views of it are."""
    shared = graph_of(layout)
    read_by_backward = 0
    for name, (ph, users) in param_gathers(shared).items():
        assert len(users) == 1, name
        (gather,) = users
        assert not is_backward(gather) and not gather.meta.get("recomputed"), name
        read_by_backward += any(is_backward(u) for u in readers(gather))
    # as with resharding, every matrix and norm weight is needed by the backward, the embedding's not
    assert read_by_backward == len(param_gathers(shared)) - 2


def test_reshard_after_forward_is_refused_without_sharded_states(tiny):
    with pytest.raises(ValueError, match="reshard_after_forward=False .* pass fsdp="):
        lf.compile(tiny, config=lf.DPConfig(1.0, 1.0), reshard_after_forward=False)
    with pytest.raises(TypeError, match="True or False"):
        lf.compile(tiny, config=lf.DPConfig(1.0, 1.0), reshard_after_forward="no")


@contextlib.contextmanager
def one_rank_world():
    """A real gloo world of one rank, mesh ("cp",) of size 1: the sharded graph runs (its
    gathers and reduce-scatters move one shard), so its numbers can be compared here."""
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("cp",))
    finally:
        dist.destroy_process_group()


def test_both_settings_give_identical_per_sample_grads_and_clipped_sums(hook_calls):
    """The same step with reshard_after_forward True and False (and False under block
    checkpointing) on one real rank: bit-identical per-sample gradients and clipped sums,
    which equal the unsharded engine's; without resharding, one gather per parameter.
    No hook is registered on the way (compile, accumulate, finalize, per_sample_grads)."""
    batch = token_batch(vocab=MODEL["vocab_size"])
    clean = lf.DPConfig(max_grad_norm=0.05, noise_multiplier=0.0)  # small: samples are clipped
    runs = {}
    with one_rank_world() as mesh:
        for name, kw in {"resharded": {}, "kept": dict(reshard_after_forward=False),
                         "kept-block": dict(reshard_after_forward=False, checkpoint="block")}.items():
            model = tiny_llama(**MODEL)
            engine = lf.compile(model, mesh, config=clean, fsdp=("cp",), **kw)
            per_sample = engine.per_sample_grads(*batch)
            engine.accumulate(*batch)
            engine.finalize(logical(3))  # E[B] = 1: .grad is the clipped sum
            gathers = [n for n in engine.lower(*batch).gm.graph.nodes if n.target == GATHER]
            runs[name] = per_sample, {n: p.grad.full_tensor() for n, p in model.named_parameters()}, gathers
    params = len(runs["kept"][1])
    assert len(runs["kept"][2]) == len(runs["kept-block"][2]) == params  # one gather each
    assert len(runs["resharded"][2]) == 2 * params - 2  # a second one for the backward's
    for name in ("kept", "kept-block"):
        for got, want in zip(runs[name][:2], runs["resharded"][:2]):
            assert got.keys() == want.keys()
            for key in want:
                assert torch.equal(got[key], want[key]), (name, key)
    model = tiny_llama(**MODEL)
    unsharded = lf.compile(model, config=clean)
    unsharded.accumulate(*batch)
    unsharded.finalize(logical(3))
    for key, p in model.named_parameters():
        torch.testing.assert_close(runs["resharded"][1][key], p.grad, rtol=1e-5, atol=1e-7)
        assert bool(p.grad.abs().sum() > 0), key  # nothing compared vacuously
    assert hook_calls == []


def test_whole_parameters_evaluate_the_model_and_give_the_shards_back():
    """``Sharding.whole_parameters`` (the CLI's evaluation under --fsdp): inside, the model
    holds plain whole tensors and its eager loss is the unsharded model's; on exit the very
    DTensor shards are back, so the engine steps on without recapturing and the optimizer
    still updates the model's parameters."""
    batch = token_batch(vocab=MODEL["vocab_size"])
    reference = tiny_llama(**MODEL)
    with one_rank_world() as mesh:
        model = tiny_llama(**MODEL)
        engine = lf.compile(model, mesh, config=lf.DPConfig(max_grad_norm=1.0, noise_multiplier=0.0), fsdp=("cp",))
        shards = dict(model.named_parameters())
        engine.accumulate(*batch)
        with engine.sharding.whole_parameters(model), torch.no_grad():
            inside = dict(model.named_parameters(remove_duplicate=False))
            assert not any(isinstance(p, DTensor) for p in inside.values())
            assert all(torch.equal(inside[k], shards[k].full_tensor()) for k in shards)
            torch.testing.assert_close(model(*batch), reference(*batch), rtol=0, atol=0)
        assert all(p is shards[k] for k, p in model.named_parameters())
        engine.finalize(logical(3))
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        opt.step()
        engine.accumulate(*batch)
        assert engine.captures == 1
        moved = max(float((p.full_tensor() - q).detach().abs().max()) for p, q in zip(model.parameters(), reference.parameters()))
        assert moved > 0


# --- no hooks on the sharded path --------------------------------------------------------------

def hooks_held(model) -> list:
    """Hooks held by the model's modules, its parameters and globally (counts)."""
    import torch.nn.modules.module as M
    held = []
    for m in model.modules():
        held += [len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks),
                 len(m._backward_pre_hooks)]
    for p in model.parameters():
        held += [len(p._backward_hooks or {}), len(getattr(p, "_post_accumulate_grad_hooks", None) or {})]
    held += [len(M._global_forward_hooks), len(M._global_forward_pre_hooks), len(M._global_backward_hooks),
             len(M._global_backward_pre_hooks)]
    return held


@pytest.mark.parametrize("layout", ["zero3", "zero3-kept"])
def test_no_hooks_while_compiling_and_lowering_sharded(fake_world, hook_calls, layout):
    """compile(fsdp=...) turns the parameters into DTensor shards and lowers both graphs
    without registering a hook anywhere."""
    kw = dict(LAYOUTS[layout])
    with fake_world(2, 2) as mesh:
        model = tiny_llama(**MODEL)
        assert not any(hooks_held(model))
        engine = lf.compile(model, mesh, config=lf.DPConfig(1.0, 1.0), **kw)
        ids = torch.zeros(2, 32, dtype=torch.long)
        engine.lower(ids, ids)
        engine.lower(ids, ids, graph="per_sample")
        assert all(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())
    assert hook_calls == []
    assert not any(hooks_held(model))
