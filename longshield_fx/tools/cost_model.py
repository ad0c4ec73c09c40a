"""A two-lane cost model of a scheduled graph: compute on one lane, collectives on another.

Per node, compute time is ``max(FLOPs / flops, bytes / mem_bw)``: FLOPs counted by
``torch.utils.flop_counter`` (its matmul and attention formulas; einsum runs as bmm; the CPU
flash kernel and ring attention, which it has no formula for, get its own sdpa formula here,
halved for causal masking), bytes read and written from fake-tensor metadata. A collective starts when issued and the communication lane is free and takes
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

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from .. import ops  # noqa: F401  (registers longshield::ring_attention, counted below)
from .._torch import COLLECTIVES, c10d
from ..passes._graph import nbytes
aten = torch.ops.aten


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


def _ring(q, k, v, scale, group_name, cp, *, out_shape=None) -> int:
    return _causal(sdpa_flop_count(q, _ring_kv(k, cp), _ring_kv(v, cp)), True)


def _ring_backward(grad_out, q, k, v, out, lse, scale, group_name, cp, *, out_shape=None) -> int:
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
    flops = node_flops(gm)
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
