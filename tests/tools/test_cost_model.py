"""The cost model's FLOPs: torch.utils.flop_counter's formulas, run on a graph's fake values,
plus the attention kernels it has no formula for (CPU flash, ring attention), causal halved."""
from __future__ import annotations

import torch
from torch import fx

from longshield_fx._torch import FakeTensorMode
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

from longshield_fx.tools.cost_model import (HARDWARE, SequenceLayout, attention_time, ring_time,  # noqa: E402
                                            search_attention, simulate)

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


def test_attention_sizes_are_the_papers():
    """Size(q) = Size(out) = B·S·D/sp per all-to-all; Size(kv) = max(Hkv, hp)/H · 2·B·S·D/sp per
    ring hop: with hp = H/2 = 16 > Hkv = 8 the K/V heads are replicated to 16."""
    nvlink = HARDWARE["H100-NVLink"]
    T, hp, cp = 65536, 16, 1
    cost = attention_time(nvlink, SequenceLayout(hp, cp), seq_len=T, **LLAMA_8B)
    D, e, sp = 32 * 128, 2, hp * cp
    size_q, size_kv = T * D / sp * e, 16 / 32 * 2 * T * D / sp * e
    a2a = lambda size: nvlink.latency + size * (hp - 1) / hp / nvlink.link_bw  # noqa: E731
    assert abs(cost.all_to_all - 2 * (2 * a2a(size_q) + 2 * a2a(size_kv / 2))) < 1e-12


def test_search_ranks_every_allowed_layout():
    costs = search_attention(IB, 8, seq_len=8192, **LLAMA_8B)
    layouts = {(c.layout.hp, c.layout.cp, c.layout.w, c.layout.head_first) for c in costs}
    assert {hp for hp, *_ in layouts} == {1, 2, 4, 8}  # H=32, Hkv=8: every divisor of 8
    assert (1, 8, 8, True) in layouts and (2, 4, 2, False) in layouts and (8, 1, 1, True) in layouts
    assert [c.total for c in costs] == sorted(c.total for c in costs)
    ring = next(c for c in costs if c.layout.hp == 1 and c.layout.w == 8)
    assert costs[0].total < ring.total  # at 8k a single ring over the two nodes exposes its hops


def test_simulate_counts_all_to_alls_and_ring_hops(cp_graph):
    """The graph's all-to-alls move (hp-1)/hp of their input; the ring ops take ring_time."""
    gm = cp_graph(2, hp=2, T=32, B=2).gm
    slow = HARDWARE["H100-IB"]
    tl = simulate(gm, slow, SequenceLayout(2, 2))
    a2a = [n for n in gm.graph.nodes if n.target == torch.ops._c10d_functional.all_to_all_single.default]
    durations = {name: d for _, d, name in tl.collectives}
    for n in a2a:
        size = n.args[0].meta["val"].numel() * 4
        assert abs(durations[n.name] - (slow.latency + size / 2 / slow.link_bw)) < 1e-15
    ring = {name: d for _, d, name in tl.compute if name.startswith("ring_attention_default")}
    assert len(ring) == 2 and all(d > slow.latency for d in ring.values())  # one hop over IB each
