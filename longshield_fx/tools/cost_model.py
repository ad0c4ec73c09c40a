"""A two-lane cost model of a scheduled graph: compute on one lane, collectives on another.

Per node, compute time is ``max(FLOPs / flops, bytes / mem_bw)``: FLOPs counted by
``torch.utils.flop_counter`` (its matmul and attention formulas; einsum runs as bmm; the CPU
flash kernel and ring attention, which it has no formula for, get its own sdpa formula here,
halved for causal masking), bytes read and written from fake-tensor metadata. A collective starts when issued and the communication lane is free and takes
``latency + volume / link_bw`` (ring algorithms: reduce-scatter and all-gather move
(n-1)/n of the buffer per rank, all-reduce twice that). A ``wait_tensor`` stalls compute
until its collective is done: those stalls are the EXPOSED communication.

Ring attention's own K/V exchange happens inside the op, each hop behind one block's
computation: the op's time is ``ring_time`` (LoongTrain section 4.5.3, with our schedule: per
outer step the inner ring takes (w-1) x max(block compute, inner hop) + one block, and the
outer hop, issued at the step's start, overlaps the whole inner ring). Head-parallel
all-to-alls (2D attention) are collectives moving (hp-1)/hp of their input. Which link a
ring hop or a collective uses comes from ``SequenceLayout`` (hp x cp ranks on the nodes of
``Hardware``): NVLink inside a node, the NIC between nodes. ``attention_time`` is the same
model in closed form per layer, which ``search_attention`` ranks (hp, cp, w, placement) by.

Hardware parameters (per rank):
- "H100-NVLink": 989 TFLOP/s dense BF16 (NVIDIA H100 SXM datasheet) at 50% achieved,
  3.35 TB/s HBM3 (datasheet), NVLink 4: 900 GB/s bidirectional = 450 GB/s per direction
  (datasheet), 10 µs collective latency (NCCL small-message latency, order of magnitude).
- "H100-IB": same GPU, 400 Gb/s NDR InfiniBand per GPU = 50 GB/s (ConnectX-7 datasheet),
  20 µs latency.
- "2x4-H100-IB": two nodes of 4 such GPUs: NVLink inside a node, InfiniBand (one NIC per GPU)
  between the nodes. "8x4-H100-IB": eight such nodes. A ``Hardware`` knows only the GPUs per
  node: the layout's rank count decides how many nodes a model spans, so the two entries are
  the same link model under the names of the clusters they are used for (8 and 32 GPUs).
- "CPU-gloo": this project's 2-core dev machine with one thread per rank, measured with
  ``benchmarks/overlap.py --calibrate`` on 2026-11-22: ~20 GFLOP/s fp32 matmul per rank,
  ~5 GB/s memory traffic, gloo over loopback TCP ~1 GB/s, ~100 µs per collective.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from .. import ops  # noqa: F401  (registers longshield::ring_attention, counted below)
from .._torch import COLLECTIVES, c10d
from ..passes._graph import is_head_all_to_all, nbytes, val
aten = torch.ops.aten


@dataclass(frozen=True)
class Hardware:
    name: str
    flops: float      # achieved matmul FLOP/s
    mem_bw: float     # bytes/s for memory-bound ops
    link_bw: float    # bytes/s per rank for collectives (inside a node)
    latency: float    # seconds per collective (inside a node)
    gpus_per_node: int = 0  # 0: every rank on the same link
    inter_bw: float = 0.0   # bytes/s per rank between nodes
    inter_latency: float = 0.0

    def link(self, ranks) -> tuple[float, float]:
        """(bandwidth, latency) of traffic among global ``ranks``: the NIC if they span nodes."""
        if self.gpus_per_node and len({r // self.gpus_per_node for r in ranks}) > 1:
            return self.inter_bw, self.inter_latency
        return self.link_bw, self.latency


HARDWARE = {
    "H100-NVLink": Hardware("H100-NVLink", 989e12 * 0.5, 3.35e12, 450e9, 10e-6),
    "H100-IB": Hardware("H100-IB", 989e12 * 0.5, 3.35e12, 50e9, 20e-6),
    "2x4-H100-IB": Hardware("2x4-H100-IB", 989e12 * 0.5, 3.35e12, 450e9, 10e-6, 4, 50e9, 20e-6),
    "8x4-H100-IB": Hardware("8x4-H100-IB", 989e12 * 0.5, 3.35e12, 450e9, 10e-6, 4, 50e9, 20e-6),
    "CPU-gloo": Hardware("CPU-gloo", 20e9, 5e9, 1e9, 100e-6),
}


@dataclass(frozen=True)
class SequenceLayout:
    """hp x cp sequence-parallel ranks (one dp replica, global ranks from 0), the cp ring made
    of inner rings of ``inner_ring`` ranks. Head-first placement makes hp the inner (adjacent)
    dim, the mesh ("cp", "hp"); context-first makes cp inner, ("hp", "cp")."""

    hp: int = 1
    cp: int = 1
    inner_ring: int = 0  # 0: one ring of cp
    head_first: bool = True

    @property
    def w(self) -> int:
        return self.inner_ring or self.cp

    def rank(self, c: int, h: int) -> int:
        return c * self.hp + h if self.head_first else h * self.cp + c

    def hp_ranks(self) -> list[list[int]]:
        return [[self.rank(c, h) for h in range(self.hp)] for c in range(self.cp)]

    def ring_hops(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(inner hops, outer hops) as global rank pairs, over every hp index."""
        w, n = self.w, self.cp // self.w
        inner, outer = [], []
        for h in range(self.hp):
            for c in range(self.cp):
                g, p = divmod(c, w)
                if w > 1:
                    inner.append((self.rank(c, h), self.rank(g * w + (p + 1) % w, h)))
                if n > 1:
                    outer.append((self.rank(c, h), self.rank(((g + 1) % n) * w + p, h)))
        return inner, outer

    def label(self) -> str:
        ring = f", double ring w={self.w}" if self.w != self.cp else ""
        place = (", head-first" if self.head_first else ", context-first") if 1 < self.hp < self.hp * self.cp else ""
        return f"hp={self.hp} cp={self.cp}{ring}{place}"


def _slowest(hw: Hardware, groups) -> tuple[float, float]:
    """A step waits for its slowest link: (bandwidth, latency) of the worst group."""
    links = [hw.link(g) for g in groups] or [(hw.link_bw, hw.latency)]
    return min(links, key=lambda link: (link[0], -link[1]))


def ring_time(hw: Hardware, layout: SequenceLayout, block_seconds: float, hop_bytes: float) -> float:
    """One ring attention op: cp blocks of ``block_seconds`` each, hops of ``hop_bytes``
    (inner ring hops behind one block each, the outer hop behind a whole inner ring)."""
    cp, w = layout.cp, layout.w
    if cp == 1:
        return block_seconds
    inner_hops, outer_hops = layout.ring_hops()
    inner_ring = block_seconds
    if w > 1:
        bw, lat = _slowest(hw, inner_hops)
        inner_ring += (w - 1) * max(block_seconds, lat + hop_bytes / bw)
    if cp // w == 1:
        return inner_ring
    bw, lat = _slowest(hw, outer_hops)
    return (cp // w - 1) * max(inner_ring, lat + hop_bytes / bw) + inner_ring


def all_to_all_time(hw: Hardware, layout: SequenceLayout, nbytes_in: float) -> float:
    if layout.hp == 1:
        return 0.0
    bw, lat = _slowest(hw, layout.hp_ranks())
    return lat + nbytes_in * (layout.hp - 1) / layout.hp / bw


@dataclass(frozen=True)
class AttentionCost:
    """Modelled seconds per attention layer (forward + backward) on one rank."""

    layout: SequenceLayout
    compute: float   # attention kernels alone
    ring: float      # the ring ops, hops included (exposed where a hop outlasts its block)
    all_to_all: float  # eight per layer, not overlapped (attention waits for them)

    @property
    def total(self) -> float:
        return self.ring + self.all_to_all


def attention_time(hw: Hardware, layout: SequenceLayout, *, batch: int, seq_len: int, heads: int, kv_heads: int,
                   head_dim: int, elem_bytes: int = 2) -> AttentionCost:
    """LoongTrain section 4.5 for one layer: Size(q) = Size(out) = B·S·D/sp, Size(kv) =
    max(Hkv, hp)/H · 2·B·S·D/sp (K and V, replicated up to hp heads), in ``elem_bytes``; causal
    attention FLOPs 2·B·S²·D/sp forward (torch's sdpa count, halved), 2.5x that backward; the
    backward's hops also carry the fp32 dK/dV accumulators."""
    sp, hp = layout.hp * layout.cp, layout.hp
    D = heads * head_dim
    kv_hat = max(kv_heads, hp) if hp > 1 else kv_heads
    size_q = batch * seq_len * D / sp * elem_bytes
    size_kv = batch * kv_hat / heads * 2 * seq_len * D / sp * elem_bytes
    forward_flops = 2 * batch * seq_len ** 2 * D / sp
    block = forward_flops / layout.cp / hw.flops
    ring = ring_time(hw, layout, block, size_kv) + ring_time(hw, layout, 2.5 * block, size_kv * (1 + 4 / elem_bytes))
    a2a = 2 * (2 * all_to_all_time(hw, layout, size_q) + 2 * all_to_all_time(hw, layout, size_kv / 2))
    return AttentionCost(layout, 3.5 * block * layout.cp, ring, a2a)


def search_attention(hw: Hardware, gpus: int, **shape) -> list[AttentionCost]:
    """Every (hp, cp, w, placement) of ``gpus`` sequence-parallel ranks that the head counts
    allow (hp divides H; hp divides or is a multiple of Hkv), fastest first."""
    heads, kv_heads = shape["heads"], shape["kv_heads"]
    costs = []
    for hp in (d for d in range(1, gpus + 1) if gpus % d == 0):
        if heads % hp or (kv_heads % hp and hp % kv_heads):
            continue
        cp = gpus // hp
        for w in (d for d in range(1, cp + 1) if cp % d == 0):
            for head_first in ((True, False) if 1 < hp < gpus else (True,)):
                layout = SequenceLayout(hp, cp, 0 if w == cp else w, head_first)
                costs.append(attention_time(hw, layout, **shape))
    # Ties (hops hidden either way) go to the simpler layout: fewer head groups, one ring.
    return sorted(costs, key=lambda c: (round(c.total, 12), c.layout.hp, -c.layout.w))


@dataclass
class Timeline:
    total: float = 0.0
    exposed_comm: float = 0.0
    comm: float = 0.0
    compute: list = field(default_factory=list)   # (start, duration, node name)
    collectives: list = field(default_factory=list)  # (start, duration, node name)


# --- FLOPs: torch.utils.flop_counter's formulas, plus the attention kernels it lacks -----------

def _causal(flops: int, is_causal: bool) -> int:
    return flops // 2 if is_causal else flops  # a causal kernel skips the masked half


def _cpu_flash(q, k, v, dropout_p=0.0, is_causal=False, *args, out_shape=None, **kwargs) -> int:
    return _causal(sdpa_flop_count(q, k, v), is_causal)


def _cpu_flash_backward(grad_out, q, k, v, out, lse, dropout_p=0.0, is_causal=False, *args, out_shape=None,
                        **kwargs) -> int:
    return _causal(sdpa_backward_flop_count(grad_out, q, k, v), is_causal)


def _ring_kv(shape, cp: int) -> tuple:
    B, H, L, D = shape
    return B, H, L * cp, D  # the local queries meet the K/V blocks of all cp ranks


def _ring(q, k, v, scale, group_name, cp, inner=0, *, out_shape=None) -> int:
    return _causal(sdpa_flop_count(q, _ring_kv(k, cp), _ring_kv(v, cp)), True)


def _ring_backward(grad_out, q, k, v, out, lse, scale, group_name, cp, inner=0, *, out_shape=None) -> int:
    return _causal(sdpa_backward_flop_count(grad_out, q, _ring_kv(k, cp), _ring_kv(v, cp)), True)


# torch's registry has mm/addmm/bmm/baddbmm and the CUDA attention kernels (einsum decomposes
# into bmm while it runs); it has no formula for the CPU flash kernel or our ring attention.
EXTRA_FORMULAS = {
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_backward,
    torch.ops.longshield.ring_attention: _ring,
    torch.ops.longshield.ring_attention_backward: _ring_backward,
}


def _fake_mode(gm: fx.GraphModule):
    for node in gm.graph.find_nodes(op="placeholder"):
        mode = getattr(node.meta.get("val"), "fake_mode", None)
        if mode is not None:
            return mode
    raise ValueError("cost model: the graph's placeholders carry no fake tensors (meta['val'])")


def node_flops(gm: fx.GraphModule) -> dict[fx.Node, int]:
    """FLOPs of every node, counted by ``torch.utils.flop_counter.FlopCounterMode`` while the
    node's op runs again on its inputs' fake values (nothing real is computed or allocated).
    Collectives and tuple unpacking count 0."""
    env = {}
    counts: dict[fx.Node, int] = {}
    counter = FlopCounterMode(display=False, custom_mapping=EXTRA_FORMULAS)
    with _fake_mode(gm), counter:
        for node in gm.graph.nodes:
            env[node] = node.meta.get("val")
            if node.op != "call_function" or node.target is operator.getitem or node.target in COLLECTIVES \
                    or node.target == c10d.wait_tensor.default:
                continue
            before = counter.get_total_flops()
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: env[a])
            try:
                out = node.target(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - name the node, keep the cause
                raise RuntimeError(f"cost model: cannot re-run {node.format_node()} on fake tensors: {e}") from e
            counts[node] = counter.get_total_flops() - before
            if env[node] is None:
                env[node] = out
    return counts


def compute_time(node: fx.Node, hw: Hardware, flops: int) -> float:
    if node.op != "call_function" or node.target is operator.getitem:
        return 0.0
    moved = nbytes(node) + sum(nbytes(a) for a in node.all_input_nodes)
    return max(flops / hw.flops, moved / hw.mem_bw)


def comm_time(node: fx.Node, hw: Hardware, link: tuple[float, float] | None = None) -> float:
    bw, latency = link or (hw.link_bw, hw.latency)
    volume = nbytes(node.args[0])
    if node.target == c10d.all_reduce.default:
        return latency + 2 * volume / bw  # (n-1)/n ~ 1/2 for small n; upper bound n -> inf
    if node.target == c10d.all_to_all_single.default:
        n = len(node.args[1]) if is_head_all_to_all(node) else None  # the shard exchange: all may leave
    elif node.target in (c10d.reduce_scatter_tensor.default, c10d.all_gather_into_tensor.default):
        n = node.args[2] if node.target == c10d.reduce_scatter_tensor.default else node.args[1]
    else:
        n = None
    factor = (n - 1) / n if n else 1.0
    if node.target == c10d.all_gather_into_tensor.default:
        volume *= n
    return latency + factor * volume / bw


def _ring_op_time(node: fx.Node, hw: Hardware, layout: SequenceLayout, flops: int) -> float:
    k = val(node.args[2] if node.target == torch.ops.longshield.ring_attention_backward.default else node.args[1])
    hop = 2 * k.numel() * k.element_size()  # K and V (``nbytes`` takes a node, k is its value)
    if node.target == torch.ops.longshield.ring_attention_backward.default:
        hop += 2 * 4 * k.numel()  # the fp32 dK/dV accumulators travel too
    return ring_time(hw, layout, flops / layout.cp / hw.flops, hop)


def graph_layout(gm: fx.GraphModule) -> SequenceLayout:
    """The sequence-parallel layout a graph was built for, read off its nodes: cp and the inner
    ring w from the ring ops' arguments, hp from the all-to-alls' split count; head-first
    (the mesh ("cp", "hp"), as ``fake_world`` and the CLI build it: the graph does not record
    the placement)."""
    ring_ops = (torch.ops.longshield.ring_attention.default, torch.ops.longshield.ring_attention_backward.default)
    cp, inner, hp = 1, 0, 1
    for n in gm.graph.nodes:
        if n.target in ring_ops:
            first = 8 if n.target == ring_ops[1] else 5  # cp, then the optional inner ring size
            cp = max(cp, n.args[first])
            inner = max(inner, n.args[first + 1] if len(n.args) > first + 1 else 0)
        elif is_head_all_to_all(n):
            hp = max(hp, len(n.args[1]))
    return SequenceLayout(hp, cp, inner)


def simulate(gm: fx.GraphModule, hw: Hardware, layout: SequenceLayout | None = None) -> Timeline:
    """Run the graph's node order on two lanes. ``layout``: where the sequence-parallel ranks
    sit (default: ``graph_layout(gm)``, read off the graph, head-first), which picks each
    collective's and ring hop's link; without ``hw.gpus_per_node`` every link is the same."""
    flops = node_flops(gm)
    ring_ops = (torch.ops.longshield.ring_attention.default, torch.ops.longshield.ring_attention_backward.default)
    if layout is None:
        layout = graph_layout(gm)
    sp = layout.hp * layout.cp
    tl = Timeline()
    now = comm_free = 0.0
    done: dict[fx.Node, float] = {}
    for node in gm.graph.nodes:
        if node.target in COLLECTIVES:
            start = max(now, comm_free)
            group = layout.hp_ranks() if is_head_all_to_all(node) else [list(range(sp))]
            dur = comm_time(node, hw, _slowest(hw, group))
            comm_free = done[node] = start + dur
            tl.comm += dur
            tl.collectives.append((start, dur, node.name))
        elif node.target == c10d.wait_tensor.default and node.args[0] in done:
            ready = done[node.args[0]]
            if ready > now:
                tl.exposed_comm += ready - now
                now = ready
        else:
            if node.target in ring_ops:
                dur = _ring_op_time(node, hw, layout, flops.get(node, 0))
            else:
                dur = compute_time(node, hw, flops.get(node, 0))
            if dur:
                tl.compute.append((now, dur, node.name))
                now += dur
    tl.total = max(now, comm_free)
    return tl


def draw_timeline(timeline: Timeline, path: str, title: str = "") -> None:
    """Compute and communication lanes to a PNG: comm bars under compute bars are hidden."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(14, 2.8))
    scale = 1e3
    ax.broken_barh([(s * scale, d * scale) for s, d, _ in timeline.compute], (10, 8), facecolors="tab:blue")
    ax.broken_barh([(s * scale, d * scale) for s, d, _ in timeline.collectives], (0, 8), facecolors="tab:orange",
                   edgecolors="black", linewidth=0.3)
    ax.set_yticks([4, 14], ["communication", "compute"])
    ax.set_xlabel("time (ms, cost model)")
    ax.set_title(title or f"total {timeline.total * scale:.2f} ms, exposed communication "
                          f"{timeline.exposed_comm * scale:.3f} ms")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
