"""The ``overlap`` pass: issue collectives early, wait late, so compute hides communication.

Rewrites: the node ORDER only. Every functional collective (``_c10d_functional.*``) stays
where ``shard_grads``/``clip`` put it, right after the per-sample einsum that produces its
input (the input-stationary pattern of longshield.md section 3.2); its ``wait_tensor`` and
the layout ops that read only the waited result are sunk to just before their first real
consumer, so the backward data-gradient matmuls of earlier layers run while the
reduce-scatter is in flight. The all-gathers of sharded parameters (``gather_params``)
are prefetched instead: grouped by the transformer block (and phase, forward or backward)
of their first use, each group is issued right before the previous group's first use, so a
block's parameters travel while the block before it computes. The new order is a
topological sort (on the graph's data edges) keyed by original position, waits
keyed by their first consumer, parameter gathers by their prefetch point.

Caps: at most ``max_in_flight`` collectives outstanding and at most ``max_pinned_bytes`` of
their outputs pinned; when a new collective would exceed either, the oldest outstanding
wait is moved up to just before it. Under activation checkpointing one slot is left free
for the collective the ``checkpoint`` pass recomputes after this pass (issued and waited
back to back, so never more than one at a time).

Assumes: the graph is the same on every rank (it is: one capture of the same model).
Guarantees: values are unchanged (only independent nodes move); collectives are issued in
their original relative order, so every rank issues them in the same order;
``verify_schedule`` holds afterwards.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch
import torch.fx as fx

from .._torch import COLLECTIVES, c10d
from ._context import PassContext
from ._graph import is_backward, nbytes, region_of, val

aten = torch.ops.aten
_LAYOUT = {aten.movedim.int, aten.view.default, aten.permute.default, aten.select.int, aten.unsqueeze.default,
           aten.slice.Tensor}


@dataclass(frozen=True)
class OverlapLimits:
    max_in_flight: int = 16
    max_pinned_bytes: int = 2**40


def overlap(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Reorder so collectives overlap compute (see the module docstring)."""
    limits = OverlapLimits()
    if ctx.checkpoint is not None:
        # The checkpoint pass runs next and issues recomputed collectives (a block's
        # re-gathers, 2D attention's all-to-alls), each waited right away: one more in flight
        # than scheduled here, at any point. Keep a slot for it so the final graph is in the cap.
        limits = OverlapLimits(limits.max_in_flight - 1, limits.max_pinned_bytes)
    order = schedule(gm.graph, limits)
    _apply(gm.graph, order)
    gm.recompile()
    verify_schedule(list(gm.graph.nodes), limits)
    return gm


def _deferred(graph: fx.Graph) -> set[fx.Node]:
    """Waits, and layout ops reading only deferred nodes: they can move down together."""
    out = set()
    for node in graph.nodes:
        if node.target == c10d.wait_tensor.default:
            out.add(node)
        elif node.target in _LAYOUT and node.all_input_nodes and all(i in out for i in node.all_input_nodes):
            out.add(node)
    return out


def schedule(graph: fx.Graph, limits: OverlapLimits) -> list[fx.Node]:
    """List scheduling on the data-edge DAG: ready nodes run in key order, where a node's key
    is its original position, and a deferred node's key is just before its first consumer's.

    Before issuing a collective that would exceed the caps, the oldest outstanding wait is
    run first (it is always ready: it depends only on its collective).
    """
    nodes = list(graph.nodes)
    deferred = _deferred(graph)
    key = {n: float(i) for i, n in enumerate(nodes)}
    for node in reversed(nodes):  # a deferred node runs just before its first consumer
        if node in deferred and node.users:
            key[node] = min(key[u] for u in node.users) - 1e-3
    key.update(_prefetch_keys(nodes, key))
    missing = {n: len(n.all_input_nodes) for n in nodes}  # inputs not yet emitted
    ready = [(key[n], i, n) for i, n in enumerate(nodes) if missing[n] == 0]
    heapq.heapify(ready)
    index = {n: i for i, n in enumerate(nodes)}
    order: list[fx.Node] = []
    done: set[fx.Node] = set()
    outstanding: list[fx.Node] = []  # collectives issued and not yet waited, oldest first

    def emit(node):
        order.append(node)
        done.add(node)
        if node.target in COLLECTIVES:
            outstanding.append(node)
        elif node.target == c10d.wait_tensor.default and node.args[0] in outstanding:
            outstanding.remove(node.args[0])
        for user in node.users:
            missing[user] -= 1
            if missing[user] == 0:
                heapq.heappush(ready, (key[user], index[user], user))

    while ready:
        _, _, node = heapq.heappop(ready)
        if node in done:
            continue
        if node.target in COLLECTIVES:
            while outstanding and (len(outstanding) + 1 > limits.max_in_flight or
                                   sum(map(nbytes, outstanding)) + nbytes(node) > limits.max_pinned_bytes):
                emit(_wait_of(outstanding[0]))  # ready: its only input is the collective
        emit(node)
    assert len(order) == len(nodes), "overlap: the graph has a cycle"
    return order


def _prefetch_keys(nodes: list[fx.Node], key: dict) -> dict:
    """Keys that issue each parameter all-gather one group ahead: groups are consecutive
    gathers (by first use) whose first reader is in the same block and phase; group i is
    keyed just before group i-1's first use. The first group keeps its own key."""
    gathers = [n for n in nodes if n.target == c10d.all_gather_into_tensor.default and n.args[0].op == "placeholder"]
    first_reader = {g: _first_reader(g, key) for g in gathers}
    gathers.sort(key=lambda g: key[first_reader[g]])
    groups: list[list[fx.Node]] = []
    label = None
    for g in gathers:
        reader = first_reader[g]
        mine = (region_of(reader), is_backward(reader))
        if not groups or mine[0] is None or mine != label:
            groups.append([])
        groups[-1].append(g)
        label = mine
    out = {}
    for previous, group in zip(groups, groups[1:]):
        start = min(key[first_reader[g]] for g in previous)
        for g in group:
            out[g] = start - 0.5
    return out


def _first_reader(gather: fx.Node, key: dict) -> fx.Node:
    """The first node reading the gathered parameter past its wait and layout ops."""
    frontier, readers = [gather], []
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user.target == c10d.wait_tensor.default or user.target in _LAYOUT:
                frontier.append(user)
            else:
                readers.append(user)
    return min(readers, key=key.__getitem__) if readers else gather


def _wait_of(issue: fx.Node) -> fx.Node:
    return next(u for u in issue.users if u.target == c10d.wait_tensor.default)


def _apply(graph: fx.Graph, order: list[fx.Node]) -> None:
    anchor = next(iter(graph.nodes))
    for node in order[1:]:
        anchor.append(node)  # moves node right after anchor
        anchor = node


class ScheduleError(AssertionError):
    pass


def collective_signature(order) -> list[tuple]:
    """The sequence of collectives as every rank must issue them: (op, args other than data).

    The group (every functional collective's last argument) is named by the order in which
    this rank first uses it: ranks of different groups of one mesh dim (the cp group of dp
    replica 0 and of replica 1) hold different group names for the same role. An
    all-to-all's split sizes are per rank (``scatter_clipped_sums``' exchange sends each rank
    other rows): their totals are what every rank shares."""
    out, groups = [], {}
    for node in order:
        if node.target in COLLECTIVES:
            shape = tuple(val(node.args[0]).shape) if val(node.args[0]) is not None else None
            *args, group = node.args[1:]
            if node.target == c10d.all_to_all_single.default:
                args = [sum(splits) for splits in args]
            role = f"group {groups.setdefault(group, len(groups))}"
            out.append((str(node.target), shape, tuple(a for a in args if not isinstance(a, fx.Node)) + (role,)))
    return out


def verify_schedule(order: list[fx.Node], limits: OverlapLimits = OverlapLimits(),
                    other_ranks: list[list[fx.Node]] = ()) -> None:
    """Check a node order: each wait after its issue, limits respected, same collectives as other ranks."""
    seen = set()
    outstanding: list[fx.Node] = []
    for node in order:
        if node.target == c10d.wait_tensor.default:
            issue = node.args[0]
            if issue.target in COLLECTIVES and issue not in seen:
                raise ScheduleError(f"wait {node.name} comes before its collective {issue.name}")
            if issue in outstanding:
                outstanding.remove(issue)
        if node.target in COLLECTIVES:
            outstanding.append(node)
            if len(outstanding) > limits.max_in_flight:
                raise ScheduleError(f"{len(outstanding)} collectives in flight at {node.name} "
                                    f"(cap {limits.max_in_flight})")
            if len(outstanding) > 1 and sum(nbytes(c) for c in outstanding) > limits.max_pinned_bytes:
                raise ScheduleError(f"collectives in flight pin more than {limits.max_pinned_bytes} bytes at {node.name}")
        seen.add(node)
    mine = collective_signature(order)
    for rank, theirs in enumerate(other_ranks):
        if collective_signature(theirs) != mine:
            raise ScheduleError(f"rank {rank + 1} issues collectives in a different order than rank 0")
