"""The planner's layer extrapolation: the liveness timeline of a decoder with L layers from
captures of the same graph with 4, 5 and 6 layers.

A capture costs about 1.8 s plus 0.56 s per layer here (llama3.1-8b at cp=4 with block
checkpointing, one CPU core), so the three small captures cost less than one whole capture from
about 21 layers on: ``plan`` extrapolates models of more than ``WHOLE_UP_TO`` layers (8B's 32:
12 s instead of 20 s per fit point). The rule that makes this exact is read off the three
graphs and checked on them, never assumed:

- **Nodes.** The per-rank training graph of k layers is a fixed sequence of constant runs and
  runs of one block of nodes repeated k - 2 times (each layer's forward, its recomputation, its
  backward, its per-sample norms...): the first and last layers' copies can differ (the ring's
  first step, the reduce-scatter behind the next layer), so they belong to the constant runs.
  ``template`` finds the blocks from the nodes the 6-layer graph adds to the 5-layer one and
  accepts the decomposition only when it rebuilds all three graphs' op sequences exactly.
- **Bytes.** Live bytes at a constant node are a + b*k; at copy m of n = k - 2 of a repeated
  node they are a + b*k + c*m, plus one offset for the first copy and one for the last (a
  tensor that the neighbouring constant run frees or allocates). Five integers per repeated
  node from nine points (2 + 3 + 4 copies), two per constant node from three: ``extrapolate``
  solves them and returns None unless every point is reproduced to the byte.

The L-layer timeline is then the constant nodes at L and the repeated nodes at copies 0, 1,
n - 2 and n - 1, which hold the maximum over all n copies (the bytes are affine in m between
the two ends). It is a timeline of those representative nodes, not of every node: its maximum
is the L-layer graph's peak, which is all the planner reads.
"""
from __future__ import annotations

import difflib

import torch

LAYERS = (4, 5, 6)
WHOLE_UP_TO = 18  # layers; more are extrapolated from LAYERS


def template(ops: dict[int, list[str]]) -> list[tuple[str, list[str]]] | None:
    """``[("const", ops) | ("repeat", ops)]`` such that the graph of k layers (``ops[k]``, k in
    ``LAYERS``) is the parts in order, each repeated part k - 2 times; None when there is none."""
    five, six = ops[LAYERS[1]], ops[LAYERS[2]]
    added = []
    for tag, _, _, j1, j2 in difflib.SequenceMatcher(None, five, six, autojunk=False).get_opcodes():
        if tag != "equal":
            if tag != "insert":
                return None
            added.append((j1, j2))
    copies = LAYERS[2] - 2
    parts, pos, i = [], 0, 0
    while i < len(added):
        found = None
        # one layer's new nodes can come out of the diff as a few separate insertions
        for last in range(i, min(i + 4, len(added))):
            period = sum(j2 - j1 for j1, j2 in added[i:last + 1])
            lo, hi = added[i][0], added[last][1]
            found = next(((last, s, period) for s in range(max(pos, hi - copies * period), lo + 1)
                          if _periodic_until(six, s, period) >= s + copies * period), None)
            if found:
                break
        if found is None:
            return None
        last, start, period = found
        parts += [("const", six[pos:start]), ("repeat", six[start:start + period])]
        pos, i = start + copies * period, last + 1
    parts.append(("const", six[pos:]))
    if any(_expand(parts, k) != ops[k] for k in LAYERS):
        return None
    return parts


def _periodic_until(seq: list[str], start: int, period: int) -> int:
    end = start + period
    while end < len(seq) and seq[end] == seq[end - period]:
        end += 1
    return end


def _expand(parts, k: int) -> list:
    return [x for kind, xs in parts for x in (xs * (k - 2) if kind == "repeat" else xs)]


def _positions(parts, k: int) -> list[tuple[int, int, int]]:
    """(part, offset, copy) of every node of the k-layer graph."""
    return [(i, p, m) for i, (kind, xs) in enumerate(parts) for m in range(k - 2 if kind == "repeat" else 1)
            for p in range(len(xs))]


def _features(k: int, m: int | None) -> list[int]:
    if m is None:
        return [1, k]
    n = k - 2
    return [1, k, m, int(m == 0), int(m == n - 1)]


def extrapolate(parts, timelines: dict[int, list[int]], names: list[str], layers: int
                ) -> tuple[list[int], list[str]] | None:
    """(timeline, node names) of the ``layers``-layer graph's representative nodes from the
    timelines at ``LAYERS`` (``names``: the 6-layer graph's), or None when a node's bytes do not
    follow the rule of the module docstring exactly."""
    values = {}
    for k in LAYERS:
        for key, v in zip(_positions(parts, k), timelines[k], strict=True):
            values[(k, *key)] = v
    name_of = dict(zip(_positions(parts, LAYERS[2]), names, strict=True))
    n = layers - 2
    captured_copy = {0: 0, 1: 1, n - 2: LAYERS[2] - 4, n - 1: LAYERS[2] - 3}  # the 6-layer graph's copy of the same role
    timeline, out_names = [], []
    for i, (kind, xs) in enumerate(parts):
        for p in range(len(xs)):
            points = ([(_features(k, None), values[(k, i, p, 0)]) for k in LAYERS] if kind == "const" else
                      [(_features(k, m), values[(k, i, p, m)]) for k in LAYERS for m in range(k - 2)])
            coef = _exact_solution(points)
            if coef is None:
                return None
            if kind == "const":
                timeline.append(_dot(coef, _features(layers, None)))
                out_names.append(name_of[(i, p, 0)])
                continue
            for m in sorted({0, 1, n - 2, n - 1}):
                timeline.append(_dot(coef, _features(layers, m)))
                out_names.append(f"{name_of[(i, p, captured_copy[m])]} (layer block {m + 1} of {n})")
    return timeline, out_names


def _exact_solution(points) -> list[int] | None:
    """Integer coefficients reproducing every (features, bytes) point exactly, or None."""
    A = torch.tensor([f for f, _ in points], dtype=torch.float64)
    y = torch.tensor([v for _, v in points], dtype=torch.float64)
    coef = [round(c) for c in torch.linalg.lstsq(A, y.unsqueeze(1)).solution.squeeze(1).tolist()]
    return coef if all(_dot(coef, f) == v for f, v in points) else None


def _dot(coef: list[int], features: list[int]) -> int:
    return sum(c * f for c, f in zip(coef, features, strict=True))
