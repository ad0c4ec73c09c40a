"""Shared fixtures: the fake world, tiny models and batches, and shared captures.

Captures (dynamo + aot-autograd export + the passes) are most of this suite's time, so a
graph that several tests read is lowered once per session here and the tests only read
it: never mutate a shared graph, engine or model (a test that monkeypatches, trains or
rewrites builds its own). Oracles and the tiny models themselves live in ``oracles.py``.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import longshield_fx as lf
from longshield_fx import _torch
from longshield_fx.passes import Lowered

from oracles import tiny_llama, token_batch, vmap_per_sample_grads


# --- fake world ------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def fake_world():
    """``with fake_world(cp, dp=1) as mesh:`` a one-process fake process group of dp*cp ranks
    (rank 0's view: real shapes and collective nodes, nothing sent), destroyed on exit.
    ``longshield_fx._torch.fake_world``; session-scoped so session fixtures can use it."""
    return _torch.fake_world


# --- tiny models and batches -------------------------------------------------------------------

@pytest.fixture
def tiny():
    """A fresh tiny Llama (2 layers, dim 64, GQA 4/2, vocab 256) in ``CausalLMLoss``, init seed 0."""
    return tiny_llama()


@pytest.fixture
def tokens():
    """``token_batch()``: (ids, labels) of shape (3, 16), seed 0."""
    return token_batch()


# --- shared captures -----------------------------------------------------------------------------

@dataclass
class Shared:
    """A lowered engine that several tests read. ``lowered = engine.lower(*batch, graph=...)``."""

    engine: object
    batch: tuple
    lowered: Lowered

    @property
    def gm(self):
        return self.lowered.gm


@pytest.fixture(scope="session")
def cp_graph(fake_world):
    """``cp_graph(cp, dp=1, T=32, B=2, comm="input_stationary", **model_kw) -> Shared``: the
    training graph of the tiny Llama (``DPConfig(1.0, 1.0)``) lowered on a fake world of
    dp*cp ranks, with zero token ids. Memoised per argument set for the session (the
    fake group is gone afterwards: read graphs and metadata, do not run them);
    ``fresh=True`` lowers a new one that is not shared."""
    cache: dict = {}

    def build(cp, dp=1, T=32, B=2, comm="input_stationary", fresh=False, **model_kw):
        key = (cp, dp, T, B, comm, tuple(sorted(model_kw.items())))
        if fresh or key not in cache:
            with fake_world(cp, dp) as mesh:
                engine = lf.compile(tiny_llama(**model_kw), mesh,
                                    config=lf.DPConfig(1.0, 1.0, per_sample_comm=comm))
                ids = torch.zeros(B, T, dtype=torch.long)
                shared = Shared(engine, (ids, ids), engine.lower(ids, ids))
            if fresh:
                return shared
            cache[key] = shared
        return cache[key]

    return build


@pytest.fixture(scope="session")
def tiny_per_sample():
    """The tiny Llama (seed 0) on ``token_batch()``: its per-sample graph lowered, our
    per-sample gradients (``ours``) and the torch.func oracle's (``ref``)."""
    model, batch = tiny_llama(), token_batch()
    engine = lf.compile(model)
    ours = engine.per_sample_grads(*batch)
    shared = Shared(engine, batch, engine.lower(*batch, graph="per_sample"))
    shared.model, shared.ours, shared.ref = model, ours, vmap_per_sample_grads(model, batch)
    return shared


def collectives(gm) -> str:
    """One line per distinct collective (and ring attention) of a graph: op, shapes in -> out, count."""
    lines: dict[str, int] = {}
    for node in gm.graph.nodes:
        name = str(node.target)
        if not name.startswith(("_c10d_functional.", "longshield.")) or "wait_tensor" in name:
            continue
        ins = [tuple(a.meta["val"].shape) for a in node.args if isinstance(a, torch.fx.Node)]
        val = node.meta["val"]
        outs = [tuple(v.shape) for v in (val if isinstance(val, (tuple, list)) else [val])]
        key = f"{name.split('.')[1]} {ins} -> {outs}"
        lines[key] = lines.get(key, 0) + 1
    return "\n".join(f"{k} x{v}" for k, v in lines.items())


@pytest.fixture(scope="session")
def describe_collectives():
    """``describe_collectives(gm) -> str``: one line per distinct collective, with counts."""
    return collectives
