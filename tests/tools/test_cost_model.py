"""The cost model's FLOPs: torch.utils.flop_counter's formulas, run on a graph's fake values,
plus the attention kernels it has no formula for (CPU flash, ring attention), causal halved."""
from __future__ import annotations

import pytest
import torch
from torch import fx

import longshield_fx as lf
from longshield_fx._torch import COLLECTIVES, FakeTensorMode
from longshield_fx.tools.cost_model import node_flops

aten = torch.ops.aten


def _graph(shapes: dict, calls: list) -> fx.GraphModule:
    """A graph of ``calls`` (name, op, args naming earlier values) on fake placeholders."""
    mode = FakeTensorMode()
    g = fx.Graph()
    env = {}
    for name, shape in shapes.items():
        env[name] = g.placeholder(name)
        env[name].meta["val"] = mode.from_tensor(torch.empty(shape))
    for name, op, args in calls:
        env[name] = g.call_function(op, tuple(fx.node.map_aggregate(args, lambda a: env.get(a, a)
                                                                     if isinstance(a, str) else a)))
        env[name].name = name
    g.output(env[calls[-1][0]])
    return fx.GraphModule(torch.nn.Module(), g)


def test_flops_per_node():
    B, H, L, D, cp = 1, 2, 16, 8, 2
    gm = _graph({"a": (4, 8), "b": (8, 16), "w": (2,), "x": (2, 4, 8), "q": (B, H, L, D), "k": (B, H, L, D),
                 "v": (B, H, L, D)}, [
        ("mm", aten.mm.default, ["a", "b"]),
        ("clipped_sum", aten.einsum.default, ["b,b...->...", ["w", "x"]]),  # runs as bmm
        ("relu", aten.relu.default, ["mm"]),
        ("causal", aten._scaled_dot_product_flash_attention_for_cpu.default, ["q", "k", "v", 0.0, True]),
        ("full", aten._scaled_dot_product_flash_attention_for_cpu.default, ["q", "k", "v", 0.0, False]),
        ("ring", torch.ops.longshield.ring_attention.default, ["q", "k", "v", 0.125, "group", cp]),
    ])
    flops = {n.name: f for n, f in node_flops(gm).items()}
    attention = 2 * (2 * B * H * L * D * L)  # q @ k^T and p @ v
    assert flops == {"mm": 2 * 4 * 8 * 16, "clipped_sum": 2 * 2 * 4 * 8, "relu": 0,
                     "causal": attention // 2, "full": attention,
                     "ring": 2 * (2 * B * H * L * D * L * cp) // 2}  # local queries x all cp K/V blocks, causal


# --- 2D attention and the double ring (LoongTrain section 4.5) -------------------------------------

from longshield_fx.tools.cost_model import (HARDWARE, Hardware, SequenceLayout, attention_time,  # noqa: E402
                                            graph_layout, ring_time, search_attention, simulate)

IB = HARDWARE["2x4-H100-IB"]
LLAMA_8B = dict(batch=1, heads=32, kv_heads=8, head_dim=128)


def test_placement_decides_which_groups_leave_the_node():
    """2 nodes x 4 GPUs, hp=2 x cp=4: head-first keeps each hp pair in a node (rank = c*hp + h),
    context-first each cp ring (rank = h*cp + c)."""
    head_first, context_first = SequenceLayout(2, 4, 0, True), SequenceLayout(2, 4, 0, False)
    assert head_first.hp_ranks() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert context_first.hp_ranks() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert all(IB.link(g) == (IB.link_bw, IB.latency) for g in head_first.hp_ranks())
    assert all(IB.link(g) == (IB.inter_bw, IB.inter_latency) for g in context_first.hp_ranks())
    inner, outer = SequenceLayout(1, 8, 4).ring_hops()
    assert all(a // 4 == b // 4 for a, b in inner) and all(a // 4 != b // 4 for a, b in outer)


def test_ring_time_follows_the_double_ring_schedule():
    """cp=8 with hops slower than a block: one ring pays 7 slow hops (a hop crosses the nodes,
    every step waits for it); w=4 pays 3 fast inner hops per inner ring plus one slow outer hop,
    which overlaps a whole inner ring."""
    block, hop = 1e-4, 50e6  # 0.1 ms of compute; 50 MB: 1 ms over IB, 0.11 ms over NVLink
    slow, fast = IB.inter_latency + hop / IB.inter_bw, IB.latency + hop / IB.link_bw
    assert ring_time(IB, SequenceLayout(1, 8), block, hop) == 7 * slow + block
    inner_ring = 3 * max(block, fast) + block
    assert ring_time(IB, SequenceLayout(1, 8, 4), block, hop) == max(inner_ring, slow) + inner_ring
    assert ring_time(IB, SequenceLayout(1, 8, 4), block, hop) < ring_time(IB, SequenceLayout(1, 8), block, hop) / 3
    assert ring_time(IB, SequenceLayout(1, 1), block, hop) == block


# Compute so fast that every ring step waits for its hop: ring times then measure the hop sizes.
FREE_COMPUTE = Hardware("free-compute NVLink", 1e30, 3.35e12, 450e9, 10e-6)


@pytest.mark.parametrize("hp, cp", [(16, 1), (16, 4), (4, 16), (32, 2)])
def test_attention_sizes_are_the_papers(hp, cp):
    """LoongTrain section 4.5 for Llama-3.1-8B (H=32, Hkv=8), T=64k, sp = hp x cp = 16 or 64:
    Size(q) = Size(out) = B·S·D/sp per all-to-all, Size(kv) = max(Hkv, hp)/H · 2·B·S·D/sp per
    ring hop (4.5.3: a KV chunk of (max(Hkv, hp)/hp, S/cp, D/H) for K and V): at hp = 16 and
    32 > Hkv the K/V heads are replicated to hp, at hp = 4 only the 8 real heads move. With
    free compute each of the cp-1 forward hops takes its full transfer; a backward hop also
    carries the fp32 dK/dV accumulators (3 x Size(kv) in bf16)."""
    T, H, D, e = 65536, 32, 32 * 128, 2
    sp = hp * cp
    cost = attention_time(FREE_COMPUTE, SequenceLayout(hp, cp), seq_len=T, **LLAMA_8B)
    kv_hat = max(8, hp)
    size_q, size_kv = T * D / sp * e, kv_hat / H * 2 * T * D / sp * e
    kv_chunk = 2 * (kv_hat // hp) * (T // cp) * (D // H) * e  # the paper's chunk shape, K and V
    assert kv_chunk == size_kv
    lat, bw = FREE_COMPUTE.latency, FREE_COMPUTE.link_bw
    a2a = lambda size: (lat + size * (hp - 1) / hp / bw) if hp > 1 else 0.0  # noqa: E731
    assert cost.all_to_all == pytest.approx(2 * (2 * a2a(size_q) + 2 * a2a(size_kv / 2)), rel=1e-12)
    block = 2 * T ** 2 * D / sp / cp / FREE_COMPUTE.flops  # 4.5.2: alpha S^2 D / (d_cp d_sp), forward
    forward = (cp - 1) * (lat + size_kv / bw) + block
    backward = (cp - 1) * (lat + 3 * size_kv / bw) + 2.5 * block
    assert cost.ring == pytest.approx(forward + backward, rel=1e-12)


def test_replication_to_hp_equals_mha_volume_at_hp_equal_h():
    """4.5.3, GQA vs. MHA: at hp = H the K/V heads are replicated to H, so GQA's P2P and
    all-to-all traffic equal MHA's; below it GQA's are smaller."""
    def cost(hp, cp, kv_heads):
        return attention_time(FREE_COMPUTE, SequenceLayout(hp, cp), seq_len=65536, **{**LLAMA_8B, "kv_heads": kv_heads})

    assert cost(32, 2, 8) == cost(32, 2, 32)
    assert cost(4, 16, 8).ring < cost(4, 16, 32).ring and cost(4, 16, 8).all_to_all < cost(4, 16, 32).all_to_all


def test_search_ranks_every_allowed_layout():
    costs = search_attention(IB, 8, seq_len=8192, **LLAMA_8B)
    layouts = {(c.layout.hp, c.layout.cp, c.layout.w, c.layout.head_first) for c in costs}
    assert {hp for hp, *_ in layouts} == {1, 2, 4, 8}  # H=32, Hkv=8: every divisor of 8
    assert (1, 8, 8, True) in layouts and (2, 4, 2, False) in layouts and (8, 1, 1, True) in layouts
    assert [c.total for c in costs] == sorted(c.total for c in costs)
    ring = next(c for c in costs if c.layout.hp == 1 and c.layout.w == 8)
    assert costs[0].total < ring.total  # at 8k a single ring over the two nodes exposes its hops


def test_simulate_counts_all_to_alls_and_ring_hops(cp_graph):
    """hp=2 x cp=2 (tiny Llama, H=4, Hkv=2, fp32, B=2, T=32) on one InfiniBand link: each of the
    16 all-to-alls moves (hp-1)/hp of its input; each ring op takes its two blocks of causal
    attention compute (2·B·S²·D/sp FLOPs forward, 2.5x backward, over cp blocks) with one hop
    between them: K and V, plus the fp32 dK/dV accumulators in the backward."""
    gm = cp_graph(2, hp=2, T=32, B=2, n_kv_heads=2).gm
    hp, cp, B, T, D = 2, 2, 2, 32, 64
    slow = HARDWARE["H100-IB"]
    tl = simulate(gm, slow, SequenceLayout(hp, cp))
    c10d = torch.ops._c10d_functional
    a2a = [n for n in gm.graph.nodes if n.target == c10d.all_to_all_single.default]
    collectives = [n for n in gm.graph.nodes if n.target in COLLECTIVES]
    assert len(a2a) == 16 and len(tl.collectives) == len(collectives)
    durations = {name: d for _, d, name in tl.collectives}
    for n in a2a:
        size = n.args[0].meta["val"].numel() * 4
        assert durations[n.name] == pytest.approx(slow.latency + size * (hp - 1) / hp / slow.link_bw, rel=1e-12)
    assert tl.comm == pytest.approx(sum(durations.values()), rel=1e-12)
    ring = {name: d for _, d, name in tl.compute if name.startswith("ring_attention")}
    assert len(ring) == 4  # 2 layers, forward and backward
    block = 2 * B * T ** 2 * D / (hp * cp) / cp / slow.flops
    kv = 2 * B * (2 // hp) * (T // cp) * (D // 4) * 4  # K and V: (B, Hkv/hp, T/cp, head dim), fp32
    for name, d in ring.items():
        backward = "backward" in name
        hop = slow.latency + (2 * kv if backward else kv) / slow.link_bw  # fp32 dK/dV: as many bytes as K/V
        scale = 2.5 if backward else 1.0
        assert d == pytest.approx(scale * block + max(scale * block, hop), rel=1e-12), name


def test_simulate_reads_hp_and_the_inner_ring_off_the_graph(cp_graph, fake_world):
    """simulate(gm, hw) with no layout simulates the layout the graph was built for: hp from its
    all-to-alls, the double ring's w from the ring ops (not one ring of cp, which on nodes of 2
    GPUs would put every ring step behind an inter-node hop)."""
    from oracles import tiny_llama

    two_per_node = Hardware("2-GPU nodes", 989e12 * 0.5, 3.35e12, 450e9, 10e-6, 2, 50e9, 20e-6)
    ids = torch.zeros(2, 32, dtype=torch.long)
    with fake_world(4) as mesh:
        double = lf.compile(tiny_llama(), mesh, config=lf.DPConfig(1.0, 1.0), inner_ring=2).lower(ids, ids).gm
    two_d = cp_graph(2, hp=2, T=32, B=2, n_kv_heads=2).gm
    for gm, layout, one_ring in ((double, SequenceLayout(1, 4, 2), SequenceLayout(1, 4)),
                                 (two_d, SequenceLayout(2, 2), SequenceLayout(1, 2))):
        assert graph_layout(gm) == layout
        assert simulate(gm, two_per_node).total == simulate(gm, two_per_node, layout).total
        assert simulate(gm, two_per_node, one_ring).total != simulate(gm, two_per_node, layout).total
