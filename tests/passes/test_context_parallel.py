"""The ``context_parallel`` pass on the attention kernels of every device, and its refusals.

CUDA kernels cannot run here, so their graphs are made by swapping the CPU flash attention
nodes of a captured graph for the nodes of the kernels SDPA picks on CUDA (memory-efficient for
fp32, flash for fp16/bf16), with shapes from fake tensors. The ring rewrite must produce the same
collectives as from the CPU graph (pinned in test_shard_grads.py; both read the shared
``cp_graph(2)``).
"""
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

def _all_to_alls(gm) -> list[tuple]:
    c10d = torch.ops._c10d_functional
    return [tuple(n.args[0].meta["val"].shape) for n in gm.graph.nodes if n.target == c10d.all_to_all_single.default]


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["hkv2-moved", "hkv1-replicated"])
def test_2d_attention_collectives_follow_the_paper_formulas(cp_graph, kv_heads):
    """hp=2 x cp=2 on the tiny Llama (H=4, fp32): per layer, four all-to-alls forward (q, k, v,
    out) and four backward (grad out, dq, dk, dv), each sending (hp-1)/hp of its input; ring
    hops carry K/V chunks of max(Hkv, hp)/H x 2SD/d_sp values (LoongTrain section 4.5), the
    K/V heads replicated to hp when Hkv < hp."""
    hp, cp, T, B = 2, 2, 32, 2
    shared = cp_graph(cp, hp=hp, T=T, B=B, n_kv_heads=kv_heads)
    cfg = shared.engine.model.lm.cfg
    H, D, layers, sp = cfg.n_heads, cfg.dim, cfg.n_layers, hp * cp
    hd = D // H
    kv_hat = max(kv_heads, hp)  # K/V heads after replication
    q_in, kv_in = (B, H, T // sp, hd), (B, kv_hat, T // sp, hd)  # what each all-to-all is given, per rank
    as_sent = lambda s: (hp, s[0], s[1] // hp, *s[2:])  # the (hp, B, heads/hp, L, D) buffer exchanged
    out_in = (B, H // hp, T // cp, hd)  # the ring's output, heads back for the sequence
    assert sorted(_all_to_alls(shared.gm)) == sorted(
        [as_sent(q_in), as_sent(kv_in), as_sent(kv_in), (hp, B, H // hp, T // sp, hd)] * layers  # forward
        + [as_sent(q_in), (hp, *out_in[:2], T // sp, hd), (hp, B, kv_hat // hp, T // sp, hd),
           (hp, B, kv_hat // hp, T // sp, hd)] * layers)  # backward: grad out; dq, dk, dv
    fp32 = 4
    size_q = B * fp32 * T * D // sp  # Size(q) = Size(out), in fp32, for B sequences
    size_kv = B * kv_hat * 2 * fp32 * T * D // (H * sp)  # Size(kv): K and V after replication
    moved = shared.engine.communication_bytes()
    assert moved["all_to_all"] == layers * 2 * (2 * size_q + size_kv) * (hp - 1) // hp
    # forward hops, backward hops and the backward's fp32 dK/dV accumulators (cp hops)
    assert moved["ring_attention"] == layers * ((cp - 1) * size_kv * 2 + cp * size_kv)
    ring = [n for n in shared.gm.graph.nodes if n.target == torch.ops.longshield.ring_attention.default]
    assert len(ring) == layers and all(tuple(n.args[1].meta["val"].shape) == (B, kv_hat // hp, T // cp, hd)
                                       for n in ring)


def test_2d_attention_golden_collectives(cp_graph, describe_collectives):
    assert_expected_inline(describe_collectives(cp_graph(2, hp=2, n_kv_heads=1).gm), """\
all_to_all_single [(2, 2, 2, 8, 16)] -> [(2, 2, 2, 8, 16)] x8
all_to_all_single [(2, 2, 1, 8, 16)] -> [(2, 2, 1, 8, 16)] x8
ring_attention [(2, 2, 16, 16), (2, 1, 16, 16), (2, 1, 16, 16)] -> [(2, 2, 16, 16), (2, 2, 16)] x2
lm_head_loss [(2, 8, 64), (256, 64), (2, 8), (2, 8)] -> [(2, 8), (2, 8, 64), (2, 256, 64)] x1
reduce_scatter_tensor [(256, 2, 64)] -> [(64, 2, 64)] x2
all_reduce [(2, 64)] -> [(2, 64)] x5
reduce_scatter_tensor [(192, 2, 64)] -> [(48, 2, 64)] x6
reduce_scatter_tensor [(64, 2, 64)] -> [(16, 2, 64)] x4
ring_attention_backward [(2, 2, 16, 16), (2, 2, 16, 16), (2, 1, 16, 16), (2, 1, 16, 16), (2, 2, 16, 16), (2, 2, 16)] -> [(2, 2, 16, 16), (2, 1, 16, 16), (2, 1, 16, 16)] x2
reduce_scatter_tensor [(64, 2, 16)] -> [(16, 2, 16)] x4
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
