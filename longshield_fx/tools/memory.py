"""Liveness-based memory estimate of a scheduled graph, from fake-tensor metadata.

Walks the graph in execution order. Each node that allocates adds its output's bytes; a
storage is freed after the last use of any node that aliases it (fx frees a value after its
last use, so this is what running the graph does). Graph inputs (parameters, batch) are the
caller's and are reported apart. No real memory is touched: it works on graphs captured at
8B shapes. ``tests/tools/test_memory.py`` checks the estimate against the peak measured in a
fresh process.

Which nodes allocate is not a hand-kept list of view ops. A node ALIASES an input (and
allocates nothing) when:

- its op is a view by torch's own schema (``OpOverload.is_view``: the ``Tensor(a) self ->
  Tensor(a)`` alias annotation), or
- its fake output shares a storage with an input's fake value (``untyped_storage()``
  identity; this is how the aot-autograd trace records ``aten._unsafe_view``, a view that the
  schema does not annotate), or
- it is ``wait_tensor``, which returns the collective's output buffer itself, or
- it is ``getitem`` of a tuple whose element aliases the tuple op's input (``split``).

A node's ``meta["workspace_bytes"]`` (set by the pass that made it) is scratch memory the op
holds only while it runs, beyond its inputs and outputs (``longshield::lm_head_loss``'s chunk of
logits); it counts at that node.

Storage identity alone does not serve: passes replace a node's inputs and keep the fake
values downstream (``context_parallel`` swaps attention for ring attention under an unchanged
``transpose``), and the checkpoint pass's recomputed copies share their originals' values; the
schema is what the op does whatever the metadata. (torch's inductor memory estimator tracks
aliasing by storage too; it is private API, skips CPU tensors and relies on that identity.)
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from .._torch import c10d


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


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []


def _aliased_input(node: fx.Node) -> fx.Node | None:
    """The input whose storage ``node``'s output aliases, or None if it allocates."""
    if node.op != "call_function":
        return None
    target = node.target
    if target is operator.getitem:
        return node.args[0] if _aliased_input(node.args[0]) is not None else None
    ins = node.all_input_nodes
    if not ins:
        return None
    if getattr(target, "is_view", False) or target == c10d.wait_tensor.default:
        return node.args[0] if isinstance(node.args[0], fx.Node) else ins[0]
    out = node.meta.get("val")
    if isinstance(out, torch.Tensor):
        storage = out.untyped_storage()
        for a in ins:
            if any(t.untyped_storage() is storage for t in _tensors(a.meta.get("val"))):
                return a
    return None


def owners(gm: fx.GraphModule) -> dict[fx.Node, fx.Node]:
    """node -> the node whose allocation its output lives in (itself when it allocates)."""
    owner: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:
        src = _aliased_input(n)
        owner[n] = n if src is None else owner[src]
    return owner


def estimate_memory(gm: fx.GraphModule) -> MemoryEstimate:
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    owner = owners(gm)
    last_use: dict[fx.Node, int] = {}
    for n in nodes:
        o = owner[n]
        for user in n.users:
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
        if n.op == "call_function" and owner[n] is n and isinstance(n.meta.get("val"), torch.Tensor):
            size = _nbytes(n.meta["val"])
            if size:
                live[n] = size
                total += size
        # An op's scratch memory (a custom op's chunk of logits) is live only while it runs.
        scratch = n.meta.get("workspace_bytes", 0)
        timeline.append(total + scratch)
        if total + scratch > peak:
            peak, peak_node = total + scratch, n.name
            peak_live = sorted(((m.name, b) for m, b in live.items()), key=lambda x: -x[1])
            if scratch:
                peak_live.append((f"{n.name} (workspace)", scratch))
                peak_live.sort(key=lambda x: -x[1])
        for o in frees.get(i, []):
            total -= live.pop(o, 0)
        if n.op == "call_function" and not n.users and n in live:  # dead value: freed at once
            total -= live.pop(n)
    return MemoryEstimate(peak, peak_node, input_bytes, peak_live, timeline)
