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
