"""The ``context_parallel`` pass on the attention kernels of every device, and its refusals.

CUDA kernels cannot run here, so their graphs are made by swapping the CPU flash attention
nodes of a captured graph for the nodes of the kernels SDPA picks on CUDA (memory-efficient for
fp32, flash for fp16/bf16), with shapes from fake tensors. The ring rewrite must produce the same
collectives as from the CPU graph (pinned in test_shard_grads.py; both read the shared
``cp_graph(2)``).
"""
import collections
import math
import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import longshield_fx as lf
import longshield_fx.runtime.engine as engine_module
from expecttest import assert_expected_inline
from longshield_fx.passes._context import PER_SAMPLE_GRAD
from longshield_fx.passes._graph import GraphBuilder
from longshield_fx.runtime import traces

from oracles import tiny_llama

aten = torch.ops.aten
CPU_FLASH = aten._scaled_dot_product_flash_attention_for_cpu.default
CPU_FLASH_BWD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default

# The CUDA kernels SDPA picks: (forward, backward, forward args, number of forward outputs,
# backward args given the forward's outputs).
CUDA_KERNELS = {
    "efficient (fp32)": (
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_efficient_attention_backward.default,
        lambda q, k, v, dropout, causal: (q, k, v, None, True, dropout, causal), 4,
        lambda go, q, k, v, out, outs, dropout, causal: (
            go, q, k, v, None, out, outs[1], outs[2], outs[3], dropout, [True, True, True, False], causal)),
    "flash (fp16/bf16)": (
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_flash_attention_backward.default,
        lambda q, k, v, dropout, causal: (q, k, v, dropout, causal, False), 9,
        lambda go, q, k, v, out, outs, dropout, causal: (
            go, q, k, v, out, *outs[1:6], dropout, causal, outs[6], outs[7])),
}


def swap_attention(captured, kernel):
    """Replace each CPU flash attention and its backward by the nodes of a CUDA kernel."""
    fwd_op, bwd_op, fwd_args, n_outputs, bwd_args = CUDA_KERNELS[kernel]
    graph = captured.gm.graph
    b = GraphBuilder(graph, captured.fake_mode)
    for fwd in list(graph.find_nodes(op="call_function", target=CPU_FLASH)):
        q, k, v, dropout, causal = (list(fwd.args) + [0.0, False])[:5]
        assert "attn_mask" not in fwd.kwargs  # the reference Llama uses is_causal
        scale = fwd.kwargs.get("scale")
        with graph.inserting_before(fwd):
            new_fwd = b(fwd_op, *fwd_args(q, k, v, dropout, causal), scale=scale)
            outs = [b(operator.getitem, new_fwd, i) for i in range(n_outputs)]
        for node in (new_fwd, *outs):
            node.meta.update({key: fwd.meta[key] for key in ("nn_module_stack", "partitioner_tag") if key in fwd.meta})
        old = {u.args[1]: u for u in fwd.users}
        old[0].replace_all_uses_with(outs[0])
        old[1].replace_all_uses_with(outs[1])
        for node in (*old.values(), fwd):
            graph.erase_node(node)
        for bwd in list(graph.find_nodes(op="call_function", target=CPU_FLASH_BWD)):
            if tuple(bwd.args[1:4]) != (q, k, v):
                continue
            with graph.inserting_before(bwd):
                # bwd.args[4] is out (read through a detach).
                new_bwd = b(bwd_op, *bwd_args(bwd.args[0], q, k, v, bwd.args[4], outs, dropout, causal), scale=scale)
                for user in list(bwd.users):
                    user.replace_all_uses_with(b(operator.getitem, new_bwd, user.args[1]))
                    graph.erase_node(user)
            graph.erase_node(bwd)
    captured.gm.recompile()
    return captured


def capture_with_cuda_attention(monkeypatch, kernel) -> list:
    """From now on the engine's captures use a CUDA attention kernel; returns swap counts."""
    fwd_op, bwd_op = CUDA_KERNELS[kernel][:2]
    real_capture = engine_module.capture
    swapped = []

    def capture_then_swap(*args, **kwargs):
        captured = swap_attention(real_capture(*args, **kwargs), kernel)
        targets = [n.target for n in captured.gm.graph.nodes]
        assert CPU_FLASH not in targets and CPU_FLASH_BWD not in targets
        swapped.append((targets.count(fwd_op), targets.count(bwd_op)))
        return captured

    monkeypatch.setattr(engine_module, "capture", capture_then_swap)
    monkeypatch.setattr(traces, "_TRACES", collections.OrderedDict())  # traces of this capture stay here
    return swapped


@pytest.mark.parametrize("kernel", list(CUDA_KERNELS))
def test_cuda_attention_becomes_the_same_ring_as_cpu_flash(monkeypatch, cp_graph, describe_collectives, kernel):
    cpu = describe_collectives(cp_graph(2).gm)
    swapped = capture_with_cuda_attention(monkeypatch, kernel)
    shared = cp_graph(2, fresh=True)  # captured through the swap: not the shared graph
    n_layers = len(shared.engine.model.lm.layers)
    assert swapped == [(n_layers, n_layers)]  # each layer's attention and its backward, before the passes ran
    assert not any("attention" in str(n.target) and "ring" not in str(n.target) for n in shared.gm.graph.nodes)
    assert "ring_attention" in cpu
    assert describe_collectives(shared.gm) == cpu


@pytest.mark.parametrize("kernel", list(CUDA_KERNELS))
def test_cuda_attention_keeps_samples_apart_in_one_process(monkeypatch, kernel):
    fwd_op = CUDA_KERNELS[kernel][0]
    capture_with_cuda_attention(monkeypatch, kernel)
    engine = lf.compile(tiny_llama(), config=lf.DPConfig(1.0, 1.0))
    ids = torch.zeros(2, 16, dtype=torch.long)
    lowered = engine.lower(ids, ids)
    attention = list(lowered.gm.graph.find_nodes(op="call_function", target=fwd_op))
    assert len(attention) == len(engine.model.lm.layers)
    for node in attention:
        tags = {u.args[1]: u.meta["batch_dim"] for u in node.users}
        assert tags[0] == tags[1] == node.args[0].meta["batch_dim"] is not None  # out, lse
        assert all(tag is None for i, tag in tags.items() if i > 1)  # RNG state, sizes
    params = [n for n, _ in engine.model.named_parameters()]
    assert all(PER_SAMPLE_GRAD in lowered.ctx.param_meta(n) for n in params)
    assert set(lowered.rules) == set(params) and "?" not in lowered.rules.values()


class HandWrittenAttentionLM(nn.Module):
    """Causal attention as matmul + softmax: under cp it would attend within the local shard."""

    def __init__(self, dim=16):
        super().__init__()
        self.embed = nn.Embedding(256, dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.head = nn.Linear(dim, 256, bias=False)

    def forward(self, ids, position_ids=None):
        q, k, v = self.qkv(self.embed(ids)).chunk(3, dim=-1)
        T = ids.shape[1]
        future = torch.ones(T, T, dtype=torch.bool, device=ids.device).triu(1)
        scores = (q @ k.transpose(1, 2)).masked_fill(future, float("-inf"))
        return self.head(F.softmax(scores, dim=-1) @ v)


def test_hand_written_attention_is_refused_under_context_parallelism(fake_world):
    ids = torch.zeros(2, 16, dtype=torch.long)
    one = lf.compile(lf.CausalLMLoss(HandWrittenAttentionLM()), config=lf.DPConfig(1.0, 1.0))
    one.lower(ids, ids)  # fine in one process
    with fake_world(2) as mesh:
        engine = lf.compile(lf.CausalLMLoss(HandWrittenAttentionLM()), mesh, config=lf.DPConfig(1.0, 1.0))
        with pytest.raises(lf.UnsupportedModelError, match=r"softmax over the \(sharded\) sequence.*sdpa"):
            engine.lower(ids, ids)


# --- 2D attention (hp x cp) -------------------------------------------------------------------------

A2A = torch.ops._c10d_functional.all_to_all_single.default
RING = torch.ops.longshield.ring_attention.default
RING_BWD = torch.ops.longshield.ring_attention_backward.default
# The reshapes around an all-to-all (``_HeadAllToAll``): walked through to find it.
_RESHAPES = {aten.view.default, aten.permute.default, aten.clone.default, aten.transpose.int, aten.sum.dim_IntList,
             aten.unsqueeze.default, aten.expand.default, torch.ops._c10d_functional.wait_tensor.default,
             operator.getitem}


def _all_to_all_before(node):
    """The one all-to-all whose result reaches ``node`` through reshapes only."""
    found, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n.target == A2A:
            found.add(n)
        elif n is node or n.target in _RESHAPES:
            todo += n.all_input_nodes
    assert len(found) == 1, (node, found)
    return found.pop()


def _all_to_all_after(node):
    """The one all-to-all that ``node``'s value reaches through reshapes only."""
    found, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n.target == A2A:
            found.add(n)
        elif n is node or n.target in _RESHAPES:
            todo += list(n.users)
    assert len(found) == 1, (node, found)
    return found.pop()


def _getitem(node, i):
    return next(u for u in node.users if u.target is operator.getitem and u.args[1] == i)


def attention_layers(gm) -> list[dict]:
    """Per attention layer (forward graph order): its ring ops and each all-to-all by what it
    carries, found by walking from the ring ops' inputs and outputs."""
    backward_of = {n.args[1]: n for n in gm.graph.find_nodes(op="call_function", target=RING_BWD)}
    layers = []
    for ring in gm.graph.find_nodes(op="call_function", target=RING):
        bwd = backward_of[ring.args[0]]  # the ring backward reads the same q
        q, k, v = (_all_to_all_before(a) for a in ring.args[:3])
        layers.append({
            "ring": ring, "ring_backward": bwd,
            "forward": {"q": q, "k": k, "v": v, "out": _all_to_all_after(_getitem(ring, 0))},
            "backward": {"grad_out": _all_to_all_before(bwd.args[0]),
                         **{name: _all_to_all_after(_getitem(bwd, i)) for i, name in enumerate(("dq", "dk", "dv"))}},
        })
    return layers


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["hkv2-moved", "hkv1-replicated"])
def test_2d_attention_collectives_follow_the_paper_formulas_per_layer(cp_graph, kv_heads):
    """hp=2 x cp=2 on the tiny Llama (H=4, fp32), layer by layer: four all-to-alls forward (q,
    k, v, out) and four backward (grad out, dq, dk, dv), each on the hp group and sending
    (hp-1)/hp of its input, Size(q) = Size(out) = B·S·D/sp and Size(k) = Size(v) = Size(kv)/2;
    ring ops on the cp group whose K/V chunks are max(Hkv, hp)/H x 2SD/d_sp values (LoongTrain
    section 4.5), the K/V heads replicated to hp when Hkv < hp, hopping cp-1 times (the
    backward also carries the fp32 dK/dV accumulators cp times)."""
    from longshield_fx.cli.inspect import collective_bytes  # the engine's own per-node count

    hp, cp, T, B = 2, 2, 32, 2
    shared = cp_graph(cp, hp=hp, T=T, B=B, n_kv_heads=kv_heads)
    engine, gm = shared.engine, shared.gm
    cfg = engine.model.lm.cfg
    H, D, sp = cfg.n_heads, cfg.dim, hp * cp
    hd = D // H
    kv_hat = max(kv_heads, hp)  # K/V heads after replication
    fp32 = 4
    size_q = B * T * D // sp * fp32  # Size(q) = Size(out), B sequences, fp32
    size_kv = B * kv_hat * 2 * T * D // (H * sp) * fp32  # Size(kv): K and V after replication
    # what each all-to-all exchanges: (hp, B, heads / hp, T / sp, head dim), row j to hp rank j
    heads_moved = {"q": H, "k": kv_hat, "v": kv_hat, "out": H, "grad_out": H, "dq": H, "dk": kv_hat, "dv": kv_hat}
    size_of = {"q": size_q, "out": size_q, "grad_out": size_q, "dq": size_q,
               "k": size_kv // 2, "v": size_kv // 2, "dk": size_kv // 2, "dv": size_kv // 2}
    hp_group, cp_group = engine.parallel.hp_group_name, engine.parallel.cp_group_name
    assert hp_group != cp_group

    layers = attention_layers(gm)
    assert len(layers) == cfg.n_layers
    seen = set()
    for layer in layers:
        a2as = {**layer["forward"], **layer["backward"]}
        assert len(set(a2as.values())) == 8
        seen.update(a2as.values())
        assert all(n.meta["partitioner_tag"] == "is_forward" for n in layer["forward"].values())
        assert all(n.meta["partitioner_tag"] == "is_backward" for n in layer["backward"].values())
        for kind, node in a2as.items():
            assert tuple(node.args[0].meta["val"].shape) == (hp, B, heads_moved[kind] // hp, T // sp, hd), kind
            assert node.args[1:] == ([1] * hp, [1] * hp, hp_group), kind  # even splits over the hp group
            assert collective_bytes(engine, node) == size_of[kind] * (hp - 1) // hp, kind
        ring, ring_backward = layer["ring"], layer["ring_backward"]
        assert ring.args[4] == ring_backward.args[7] == cp_group
        kv_chunk = (B, kv_hat // hp, T // cp, hd)  # LoongTrain's (max(Hkv, hp)/hp, S/cp, D/H), B sequences
        assert tuple(ring.args[1].meta["val"].shape) == tuple(ring.args[2].meta["val"].shape) == kv_chunk
        assert 2 * math.prod(kv_chunk) * fp32 == size_kv  # = max(Hkv, hp)/H x 2SD/d_sp values per P2P
        assert collective_bytes(engine, ring) == (cp - 1) * size_kv
        assert collective_bytes(engine, ring_backward) == (cp - 1) * size_kv + cp * size_kv  # + fp32 dK, dV
    all_a2a = set(gm.graph.find_nodes(op="call_function", target=A2A))
    assert seen == all_a2a  # every all-to-all belongs to one layer's eight
    moved = engine.communication_bytes()  # and the totals add up
    assert moved["all_to_all"] == cfg.n_layers * 2 * (2 * size_q + size_kv) * (hp - 1) // hp
    assert moved["ring_attention"] == cfg.n_layers * ((cp - 1) * size_kv * 2 + cp * size_kv)


def test_2d_attention_golden_collectives_kv_heads_moved(cp_graph, describe_collectives):
    """Hkv=2 = hp: each hp rank's all-to-alls move one real K/V head (no replica)."""
    assert_expected_inline(describe_collectives(cp_graph(2, hp=2, n_kv_heads=2).gm), """\
all_to_all_single [(2, 2, 2, 8, 16)] -> [(2, 2, 2, 8, 16)] x8
all_to_all_single [(2, 2, 1, 8, 16)] -> [(2, 2, 1, 8, 16)] x8
ring_attention [(2, 2, 16, 16), (2, 1, 16, 16), (2, 1, 16, 16)] -> [(2, 2, 16, 16), (2, 2, 16)] x2
lm_head_loss [(2, 8, 64), (256, 64), (2, 8), (2, 8)] -> [(2, 8), (2, 8, 64), (2, 256, 64)] x1
reduce_scatter_tensor [(256, 2, 64)] -> [(64, 2, 64)] x1
all_reduce [(2, 64)] -> [(2, 64)] x5
reduce_scatter_tensor [(64, 2, 192)] -> [(16, 2, 192)] x2
reduce_scatter_tensor [(192, 2, 64)] -> [(48, 2, 64)] x4
reduce_scatter_tensor [(64, 2, 64)] -> [(16, 2, 64)] x4
ring_attention_backward [(2, 2, 16, 16), (2, 2, 16, 16), (2, 1, 16, 16), (2, 1, 16, 16), (2, 2, 16, 16), (2, 2, 16)] -> [(2, 2, 16, 16), (2, 1, 16, 16), (2, 1, 16, 16)] x2
reduce_scatter_tensor [(32, 2, 64)] -> [(8, 2, 64)] x4
all_gather_into_tensor [(8, 2)] -> [(32, 2)] x1
all_gather_into_tensor [(8, 2, 64)] -> [(32, 2, 64)] x1
all_reduce [(2,)] -> [(2,)] x1""")


def test_2d_attention_golden_collectives_kv_heads_replicated(cp_graph, describe_collectives):
    """Hkv=1 < hp=2: the one K/V head is replicated to two before its all-to-all."""
    assert_expected_inline(describe_collectives(cp_graph(2, hp=2, n_kv_heads=1).gm), """\
all_to_all_single [(2, 2, 2, 8, 16)] -> [(2, 2, 2, 8, 16)] x8
all_to_all_single [(2, 2, 1, 8, 16)] -> [(2, 2, 1, 8, 16)] x8
ring_attention [(2, 2, 16, 16), (2, 1, 16, 16), (2, 1, 16, 16)] -> [(2, 2, 16, 16), (2, 2, 16)] x2
lm_head_loss [(2, 8, 64), (256, 64), (2, 8), (2, 8)] -> [(2, 8), (2, 8, 64), (2, 256, 64)] x1
reduce_scatter_tensor [(256, 2, 64)] -> [(64, 2, 64)] x1
all_reduce [(2, 64)] -> [(2, 64)] x5
reduce_scatter_tensor [(64, 2, 192)] -> [(16, 2, 192)] x2
reduce_scatter_tensor [(192, 2, 64)] -> [(48, 2, 64)] x4
reduce_scatter_tensor [(64, 2, 64)] -> [(16, 2, 64)] x4
ring_attention_backward [(2, 2, 16, 16), (2, 2, 16, 16), (2, 1, 16, 16), (2, 1, 16, 16), (2, 2, 16, 16), (2, 2, 16)] -> [(2, 2, 16, 16), (2, 1, 16, 16), (2, 1, 16, 16)] x2
reduce_scatter_tensor [(16, 2, 64)] -> [(4, 2, 64)] x4
all_gather_into_tensor [(8, 2)] -> [(32, 2)] x1
all_gather_into_tensor [(8, 2, 64)] -> [(32, 2, 64)] x1
all_reduce [(2,)] -> [(2,)] x1""")


@pytest.mark.parametrize("heads, kv_heads, hp, message", [
    (4, 2, 8, "4 attention heads .* cannot be split over hp=8"),
    (6, 3, 2, "3 K/V heads .* can be neither split over hp=2 nor replicated"),
])
def test_2d_attention_refuses_head_counts_hp_does_not_split(fake_world, heads, kv_heads, hp, message):
    with fake_world(1, hp=hp) as mesh:
        engine = lf.compile(tiny_llama(n_heads=heads, n_kv_heads=kv_heads, dim=12 * heads // 2), mesh,
                            config=lf.DPConfig(1.0, 1.0))
        ids = torch.zeros(2, 4 * hp, dtype=torch.long)
        with pytest.raises(lf.UnsupportedModelError, match=message):
            engine.lower(ids, ids)


def test_double_ring_is_an_argument_of_the_ring_ops_and_adds_the_outer_accumulator_hops(fake_world):
    """compile(inner_ring=2) at cp=4: every ring op gets inner=2 (one ring: 0); the K/V hops are
    the same cp-1, the backward's fp32 dK/dV accumulators make cp/w = 2 more hops per layer."""
    ids = torch.zeros(2, 32, dtype=torch.long)
    moved, inner = {}, {}
    with fake_world(4) as mesh:
        for w in (None, 2):
            engine = lf.compile(tiny_llama(), mesh, config=lf.DPConfig(1.0, 1.0), inner_ring=w)
            gm = engine.lower(ids, ids).gm
            ring_ops = [n for n in gm.graph.nodes if str(n.target).startswith("longshield.ring_attention")]
            inner[w] = {n.args[-1] for n in ring_ops}
            moved[w] = engine.communication_bytes()["ring_attention"]
            kv = next(n for n in ring_ops if n.target == torch.ops.longshield.ring_attention.default).args[1]
        with pytest.raises(ValueError, match="inner_ring=3 must divide cp=4"):
            lf.compile(tiny_llama(), mesh, config=lf.DPConfig(1.0, 1.0), inner_ring=3)
    assert inner == {None: {0}, 2: {2}}
    accumulators = 2 * 4 * kv.meta["val"].numel()  # fp32 dK and dV of one rank's shard
    layers = 2
    assert moved[2] - moved[None] == layers * 2 * accumulators
