"""Context-parallel ring attention (longshield_fx/runtime/ring_attention.py).

Multi-rank cases run on CPU gloo, one ``torch.multiprocessing.spawn`` per test function
(two spawns back to back in one process occasionally abort at teardown). The export case
runs in a subprocess because it initialises a (fake) default process group.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from longshield_fx.ops import ring_attention as ra

REPO = Path(__file__).resolve().parents[2]
B, HQ, HKV, T, D = 2, 4, 2, 32, 8
TOL = dict(atol=1e-5, rtol=1e-5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _inputs(seed: int, T: int = T):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, T, D, generator=g)
    k = torch.randn(B, HKV, T, D, generator=g)
    v = torch.randn(B, HKV, T, D, generator=g)
    grad = torch.randn(B, HQ, T, D, generator=g)
    return q, k, v, grad


def _reference(q, k, v, grad):
    """Full causal attention with K/V heads repeated: out, lse, (dq, dk, dv)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    rep = HQ // HKV
    kr, vr = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    out = F.scaled_dot_product_attention(q, kr, vr, is_causal=True)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    _, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.detach(), kr.detach(), vr.detach(), 0.0, True
    )
    return out.detach(), lse, grads


# ----------------------------------------------------------------------------------------
# Layout


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_zigzag_index_partitions_sequence(cp):
    idx = [ra.zigzag_index(T, cp, r) for r in range(cp)]
    c = T // (2 * cp)
    assert all(i.dtype == torch.long and len(i) == T // cp for i in idx)
    assert torch.equal(torch.sort(torch.cat(idx)).values, torch.arange(T))
    assert idx[0][:c].tolist() == list(range(c))  # rank 0: first and last chunk
    assert idx[0][c:].tolist() == list(range(T - c, T))


@pytest.mark.parametrize("cp, dim", [(1, 1), (2, 1), (4, 2), (4, -2)])
def test_shard_unshard_round_trip(cp, dim):
    x = torch.randn(2, 3, T, 5) if dim in (2, -2) else torch.randn(2, T, 3)
    shards = [ra.shard_sequence(x, cp, r, dim=dim) for r in range(cp)]
    assert all(s.shape[dim] == T // cp for s in shards)
    torch.testing.assert_close(ra.unshard_sequence(shards, cp, dim=dim), x, atol=0, rtol=0)


def test_bad_length_raises():
    with pytest.raises(ValueError, match="divisible by 2\\*cp"):
        ra.zigzag_index(30, 4, 0)
    with pytest.raises(ValueError, match="divisible by 2\\*cp"):
        ra.shard_sequence(torch.randn(1, 12, 2), 4, 0)


# ----------------------------------------------------------------------------------------
# Schedule (pure): balanced, and covers exactly the causal lower triangle of chunk pairs


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_block_plan_balanced_and_exact(cp):
    counts = ra.blocks_per_rank(cp)
    assert counts == [2 * cp + 1] * cp
    covered: dict[tuple[int, int], int] = {}
    for r in range(cp):
        for s in range(cp):
            src = (r - s) % cp
            qids, kids = (r, 2 * cp - 1 - r), (src, 2 * cp - 1 - src)
            for qs, ks, causal, n in ra.block_plan(cp, r, src):
                qi = [0, 1] if qs == "all" else [qs]
                ki = [0, 1] if ks == "all" else [ks]
                pairs = [(qids[i], kids[j]) for i in qi for j in ki if kids[j] <= qids[i]]
                assert len(pairs) == n
                if not causal:  # a full block never contains a diagonal or skipped pair
                    assert all(kj < qi_ for qi_, kj in pairs) and len(pairs) == len(qi) * len(ki)
                for p in pairs:
                    covered[p] = covered.get(p, 0) + 1
    assert covered == {(i, j): 1 for i in range(2 * cp) for j in range(i + 1)}


# ----------------------------------------------------------------------------------------
# Single process (cp == 1): plain causal attention, no communication


def test_cp1_equals_causal_attention():
    q, k, v, grad = _inputs(0)
    ref_out, ref_lse, ref_grads = _reference(q, k, v, grad)
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = torch.ops.longshield.ring_attention(qq, kk, vv, D**-0.5, "unused", 1)
    assert out.dtype == q.dtype and lse.dtype == torch.float32 and lse.shape == (B, HQ, T)
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(lse, ref_lse, **TOL)
    grads = torch.autograd.grad(out, (qq, kk, vv), grad)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, **TOL)
    assert grads[1].shape == (B, HKV, T, D)
    assert ra.last_block_counts == {"forward": 3, "forward_calls": 1, "backward": 3, "backward_calls": 1}


def test_cp1_opcheck():
    q, k, v, _ = _inputs(1, T=8)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    torch.library.opcheck(torch.ops.longshield.ring_attention.default, (q, k, v, 0.3, "unused", 1))


# ----------------------------------------------------------------------------------------
# Multi-process (gloo)


def _check_ring(rank: int, world: int, cp: int) -> None:
    # cp groups are strided ({0, 2}, {1, 3} for world 4, cp 2) so that global ranks and group
    # ranks differ; each dp replica (group) gets its own data.
    n_rep = world // cp
    groups = [dist.new_group(list(range(d, world, n_rep))) for d in range(n_rep)]
    dp = rank % n_rep
    group = groups[dp]
    cp_rank = dist.get_rank(group)
    assert cp_rank == rank // n_rep

    q, k, v, grad = _inputs(100 * cp + dp)
    ref_out, ref_lse, ref_grads = _reference(q, k, v, grad)
    local = [ra.shard_sequence(t, cp, cp_rank, dim=2) for t in (q, k, v, grad)]
    ql, kl, vl = (t.clone().requires_grad_() for t in local[:3])
    out, lse = torch.ops.longshield.ring_attention(ql, kl, vl, D**-0.5, group.group_name, cp)
    dq, dk, dv = torch.autograd.grad(out, (ql, kl, vl), local[3])
    assert out.shape == (B, HQ, T // cp, D) and lse.shape == (B, HQ, T // cp)
    assert dk.shape == dv.shape == (B, HKV, T // cp, D)

    def gathered(x):
        parts = [torch.empty_like(x) for _ in range(cp)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return ra.unshard_sequence(parts, cp, dim=2)  # (B, H, L[, D]): sequence is dim 2

    for name, got, want in [
        ("out", out, ref_out), ("lse", lse, ref_lse),
        ("dq", dq, ref_grads[0]), ("dk", dk, ref_grads[1]), ("dv", dv, ref_grads[2]),
    ]:
        torch.testing.assert_close(gathered(got), want, **TOL, msg=lambda m: f"cp={cp} {name}: {m}")

    counts = [None] * cp
    dist.all_gather_object(counts, dict(ra.last_block_counts), group=group)
    expected = ra.blocks_per_rank(cp)[cp_rank]
    assert all(c == counts[0] for c in counts), (cp, counts)
    assert counts[0] == {
        "forward": expected, "forward_calls": cp, "backward": expected, "backward_calls": cp
    }, (cp, counts)


def _ring_worker(rank: int, world: int, port: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        _check_ring(rank, world, cp=4)
        _check_ring(rank, world, cp=2)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_ring_matches_full_attention_cp4_and_cp2():
    """4 gloo ranks: cp=4 on the world group, then cp=2 on two strided groups (dp=2).
    Forward out/lse, backward dq/dk/dv (autograd through the op) vs full causal GQA
    attention, and balanced block counts. One spawn for both (spawns are slow here)."""
    mp.spawn(_ring_worker, args=(4, _free_port()), nprocs=4, join=True)


# ----------------------------------------------------------------------------------------
# Export: each op stays a single opaque node in the joint graph (fake process group, fake kernels)

_EXPORT_SCRIPT = textwrap.dedent(
    """
    import contextlib, json
    import torch, torch.distributed as dist
    from torch._functorch.aot_autograd import aot_export_joint_with_descriptors
    import longshield_fx.ops.ring_attention as ra

    dist.init_process_group("fake", rank=0, world_size=2)
    name = dist.group.WORLD.group_name

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wq = torch.nn.Linear(8, 8, bias=False)
            self.wk = torch.nn.Linear(8, 4, bias=False)
            self.wv = torch.nn.Linear(8, 4, bias=False)

        def forward(self, x):
            B, L, _ = x.shape
            q = self.wq(x).view(B, L, 2, 4).transpose(1, 2)
            k = self.wk(x).view(B, L, 1, 4).transpose(1, 2)
            v = self.wv(x).view(B, L, 1, 4).transpose(1, 2)
            out, lse = torch.ops.longshield.ring_attention(q, k, v, 0.5, name, 2)
            return (out.sum(),)

    with contextlib.ExitStack() as stack:
        gm = aot_export_joint_with_descriptors(stack, M(), (torch.randn(2, 16, 8),)).graph_module
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    bwd = next(n for n in gm.graph.nodes if n.target is torch.ops.longshield.ring_attention_backward.default)
    print(json.dumps({
        "fwd": targets.count("longshield.ring_attention.default"),
        "bwd": targets.count("longshield.ring_attention_backward.default"),
        "sdpa": sum("scaled_dot_product" in t for t in targets),
        "bwd_args": [a for a in bwd.args if not isinstance(a, torch.fx.Node)],
        "dk_shape": list(bwd.meta["val"][1].shape),
        "real_calls": len(ra.last_block_counts),
    }))
    """
)


def test_export_keeps_single_nodes():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run(
        [sys.executable, "-c", _EXPORT_SCRIPT], capture_output=True, text=True, env=env, cwd=REPO, timeout=120
    )
    assert res.returncode == 0, res.stderr[-4000:]

    info = json.loads(res.stdout.strip().splitlines()[-1])
    assert info["fwd"] == 1 and info["bwd"] == 1, info
    assert info["sdpa"] == 0, info
    scale, group_name, cp = info["bwd_args"]
    assert scale == 0.5 and isinstance(group_name, str) and cp == 2, info
    assert info["dk_shape"] == [2, 1, 16, 4]
    assert info["real_calls"] == 0  # only fake kernels ran
