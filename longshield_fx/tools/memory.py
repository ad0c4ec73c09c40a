"""Liveness-based memory estimate of a scheduled graph, from fake-tensor metadata.

Walks the graph in execution order. Each node that allocates (everything but views and
tuple unpacking) adds its output's bytes; a storage is freed after the last use of any
node that aliases it (fx frees a value after its last use, so this is what running the
graph does). Graph inputs (parameters, batch) are the caller's and are reported apart.
No real memory is touched: it works on graphs captured at 8B shapes.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

aten = torch.ops.aten
_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.t.default, aten.transpose.int, aten.permute.default,
          aten.expand.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
          aten.slice.Tensor, aten.select.int, aten.alias.default, aten.detach.default, aten.as_strided.default,
          aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int, aten.chunk.default,
          aten.movedim.int, aten.diagonal.default, aten.narrow.default}


@dataclass
class MemoryEstimate:
    peak_bytes: int                  # live intermediate tensors at the peak (inputs excluded)
    peak_node: str                   # the node at which the peak occurs
    input_bytes: int                 # parameters, buffers and batch tensors
    live_at_peak: list = field(default_factory=list)  # (node name, bytes), largest first
    timeline: list = field(default_factory=list)      # live bytes after each node

    def format(self, top: int = 10) -> str:
        lines = [f"peak {self.peak_bytes / 2**20:.1f} MiB of intermediates at {self.peak_node} "
                 f"(+ {self.input_bytes / 2**20:.1f} MiB of inputs)", "largest tensors live at the peak:"]
        for name, nbytes in self.live_at_peak[:top]:
            lines.append(f"  {nbytes / 2**20:10.2f} MiB  {name}")
        return "\n".join(lines)


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    return 0


def estimate_memory(gm: fx.GraphModule) -> MemoryEstimate:
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    owner: dict[fx.Node, fx.Node] = {}
    for n in nodes:
        if n.op == "call_function" and n.target in _VIEWS:
            owner[n] = owner[n.args[0]]
        elif n.op == "call_function" and n.target is operator.getitem and n.args[0] in owner \
                and owner[n.args[0]] is not n.args[0]:
            owner[n] = owner[n.args[0]]  # an element of a tuple of views
        else:
            owner[n] = n
    last_use: dict[fx.Node, int] = {}
    for n in nodes:
        for user in n.users:
            o = owner[n]
            last_use[o] = max(last_use.get(o, index[o]), index[user])
    end = len(nodes)
    outputs: list[fx.Node] = []
    fx.node.map_arg(gm.graph.output_node().args, outputs.append)
    for out in outputs:
        last_use[owner[out]] = end  # returned: alive past the graph
    frees: dict[int, list[fx.Node]] = {}
    for o, i in last_use.items():
        frees.setdefault(i, []).append(o)
    input_bytes = sum(_nbytes(n.meta.get("val")) for n in nodes if n.op == "placeholder")
    live: dict[fx.Node, int] = {}
    total = peak = 0
    peak_node, peak_live, timeline = "", [], []
    for i, n in enumerate(nodes):
        if n.op == "call_function" and owner[n] is n and not isinstance(n.meta.get("val"), (tuple, list)):
            size = _nbytes(n.meta.get("val"))
            if size:
                live[n] = size
                total += size
        timeline.append(total)
        if total > peak:
            peak, peak_node = total, n.name
            peak_live = sorted(((m.name, b) for m, b in live.items()), key=lambda x: -x[1])
        for o in frees.get(i, []):
            total -= live.pop(o, 0)
        if n.op == "call_function" and not n.users and n in live:  # dead value: freed at once
            total -= live.pop(n)
    return MemoryEstimate(peak, peak_node, input_bytes, peak_live, timeline)
