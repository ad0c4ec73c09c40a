"""A two-lane cost model of a scheduled graph: compute on one lane, collectives on another.

Per node, compute time is ``max(FLOPs / flops, bytes / mem_bw)`` (FLOPs for matmuls,
einsums and attention from their shapes; bytes read and written from fake-tensor
metadata). A collective starts when issued and the communication lane is free and takes
``latency + volume / link_bw`` (ring algorithms: reduce-scatter and all-gather move
(n-1)/n of the buffer per rank, all-reduce twice that). A ``wait_tensor`` stalls compute
until its collective is done: those stalls are the EXPOSED communication.

Ring attention's own K/V exchange happens inside the op, double-buffered behind its
block computations; the model counts the op as compute only.

Hardware parameters (per rank):
- "H100-NVLink": 989 TFLOP/s dense BF16 (NVIDIA H100 SXM datasheet) at 50% achieved,
  3.35 TB/s HBM3 (datasheet), NVLink 4: 900 GB/s bidirectional = 450 GB/s per direction
  (datasheet), 10 µs collective latency (NCCL small-message latency, order of magnitude).
- "H100-IB": same GPU, 400 Gb/s NDR InfiniBand per GPU = 50 GB/s (ConnectX-7 datasheet),
  20 µs latency.
- "CPU-gloo": this project's 2-core dev machine with one thread per rank, measured with
  ``benchmarks/overlap.py --calibrate`` on 2026-11-22: ~20 GFLOP/s fp32 matmul per rank,
  ~5 GB/s memory traffic, gloo over loopback TCP ~1 GB/s, ~100 µs per collective.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from .passes._graph import nbytes, val
from .passes.overlap import COLLECTIVES

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


@dataclass(frozen=True)
class Hardware:
    name: str
    flops: float      # achieved matmul FLOP/s
    mem_bw: float     # bytes/s for memory-bound ops
    link_bw: float    # bytes/s per rank for collectives
    latency: float    # seconds per collective


HARDWARE = {
    "H100-NVLink": Hardware("H100-NVLink", 989e12 * 0.5, 3.35e12, 450e9, 10e-6),
    "H100-IB": Hardware("H100-IB", 989e12 * 0.5, 3.35e12, 50e9, 20e-6),
    "CPU-gloo": Hardware("CPU-gloo", 20e9, 5e9, 1e9, 100e-6),
}


@dataclass
class Timeline:
    total: float = 0.0
    exposed_comm: float = 0.0
    comm: float = 0.0
    compute: list = field(default_factory=list)   # (start, duration, node name)
    collectives: list = field(default_factory=list)  # (start, duration, node name)


def flops(node: fx.Node) -> float:
    t = node.target
    if t in (aten.mm.default, aten.addmm.default, aten.bmm.default):
        a, b = (node.args[1], node.args[2]) if t == aten.addmm.default else node.args[:2]
        return 2.0 * val(a).numel() * val(b).shape[-1]
    if t == aten.einsum.default:
        sizes = {}
        for labels, x in zip(node.args[0].split("->")[0].split(","), node.args[1]):
            for label, size in zip(labels, val(x).shape):
                sizes[label] = size
        return 2.0 * math.prod(sizes.values())
    name = getattr(t, "__name__", "")
    if "attention" in name and node.args:
        q, k = val(node.args[0 if "backward" not in name else 1]), val(node.args[1 if "backward" not in name else 2])
        kv_len = k.shape[-2] * (node.args[-1] if "ring" in name else 1)  # ring: all cp blocks
        f = 4.0 * q.shape[0] * q.shape[1] * q.shape[2] * kv_len * q.shape[3] / 2  # causal: half
        return f * (2.5 if "backward" in name else 1.0)
    return 0.0


def compute_time(node: fx.Node, hw: Hardware) -> float:
    if node.op != "call_function" or node.target is operator.getitem:
        return 0.0
    moved = nbytes(node) + sum(nbytes(a) for a in node.all_input_nodes)
    return max(flops(node) / hw.flops, moved / hw.mem_bw)


def comm_time(node: fx.Node, hw: Hardware) -> float:
    volume = nbytes(node.args[0])
    n = node.args[2] if node.target in (c10d.reduce_scatter_tensor.default, c10d.all_gather_into_tensor.default) \
        else None
    if node.target == c10d.all_reduce.default:
        return hw.latency + 2 * volume / hw.link_bw  # (n-1)/n ~ 1/2 for small n; upper bound n -> inf
    factor = (n - 1) / n if n else 1.0
    if node.target == c10d.all_gather_into_tensor.default:
        volume *= n
    return hw.latency + factor * volume / hw.link_bw


def simulate(gm: fx.GraphModule, hw: Hardware) -> Timeline:
    tl = Timeline()
    now = comm_free = 0.0
    done: dict[fx.Node, float] = {}
    for node in gm.graph.nodes:
        if node.target in COLLECTIVES:
            start = max(now, comm_free)
            dur = comm_time(node, hw)
            comm_free = done[node] = start + dur
            tl.comm += dur
            tl.collectives.append((start, dur, node.name))
        elif node.target == c10d.wait_tensor.default and node.args[0] in done:
            ready = done[node.args[0]]
            if ready > now:
                tl.exposed_comm += ready - now
                now = ready
        else:
            dur = compute_time(node, hw)
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
