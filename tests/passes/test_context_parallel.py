"""The ``context_parallel`` pass on the attention kernels of every device, and its refusals.

CUDA kernels cannot run here, so their graphs are made by swapping the CPU flash attention
nodes of a captured graph for CUDA memory-efficient attention nodes (the kernel SDPA picks for
fp32 on CUDA), with shapes from fake tensors. The ring rewrite must produce the same
collectives as from the CPU graph (pinned in test_shard_grads.py).
"""
import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from oracles import tiny_llama
from test_shard_grads import build, collectives, fake_world

import longshield_fx as lf
import longshield_fx.runtime.engine as engine_module
from longshield_fx.passes._graph import GraphBuilder

aten = torch.ops.aten
CPU_FLASH = aten._scaled_dot_product_flash_attention_for_cpu.default
CPU_FLASH_BWD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
EFFICIENT = aten._scaled_dot_product_efficient_attention.default
EFFICIENT_BWD = aten._scaled_dot_product_efficient_attention_backward.default


def swap_to_efficient_attention(captured):
    """Replace each CPU flash attention and its backward by the CUDA memory-efficient kernel's."""
    graph = captured.gm.graph
    b = GraphBuilder(graph, captured.fake_mode)
    for fwd in list(graph.find_nodes(op="call_function", target=CPU_FLASH)):
        q, k, v, dropout, causal = (list(fwd.args) + [0.0, False])[:5]
        scale = fwd.kwargs.get("scale")
        with graph.inserting_before(fwd):
            eff = b(EFFICIENT, q, k, v, fwd.kwargs.get("attn_mask"), True, dropout, causal, scale=scale)
            out, lse, seed, offset = (b(operator.getitem, eff, i) for i in range(4))
        for node in (eff, out, lse, seed, offset):
            node.meta.update({key: fwd.meta[key] for key in ("nn_module_stack", "partitioner_tag") if key in fwd.meta})
        old = {u.args[1]: u for u in fwd.users}
        old[0].replace_all_uses_with(out)
        old[1].replace_all_uses_with(lse)
        for node in (*old.values(), fwd):
            graph.erase_node(node)
        for bwd in list(graph.find_nodes(op="call_function", target=CPU_FLASH_BWD)):
            if tuple(bwd.args[1:4]) != (q, k, v):
                continue
            with graph.inserting_before(bwd):
                # args[4] is out (through a detach); args[5] is now the new lse.
                eff_bwd = b(EFFICIENT_BWD, bwd.args[0], q, k, v, None, bwd.args[4], lse, seed, offset, dropout,
                            [True, True, True, False], causal, scale=scale)
                for user in list(bwd.users):
                    user.replace_all_uses_with(b(operator.getitem, eff_bwd, user.args[1]))
                    graph.erase_node(user)
            graph.erase_node(bwd)
    captured.gm.recompile()
    return captured


def capture_with_efficient_attention(monkeypatch) -> list:
    """From now on the engine's captures use CUDA efficient attention; returns swap counts."""
    real_capture = engine_module.capture
    swapped = []

    def capture_then_swap(*args, **kwargs):
        captured = swap_to_efficient_attention(real_capture(*args, **kwargs))
        targets = [n.target for n in captured.gm.graph.nodes]
        assert CPU_FLASH not in targets and CPU_FLASH_BWD not in targets
        swapped.append((targets.count(EFFICIENT), targets.count(EFFICIENT_BWD)))
        return captured

    monkeypatch.setattr(engine_module, "capture", capture_then_swap)
    return swapped


def test_cuda_efficient_attention_becomes_the_same_ring_as_cpu_flash(monkeypatch):
    with fake_world(2):
        cpu = collectives(build(2).graph_module)
    swapped = capture_with_efficient_attention(monkeypatch)
    with fake_world(2):
        gm = build(2).graph_module
    assert swapped == [(2, 2)]  # both layers' attention and its backward, before the passes ran
    assert not any("efficient_attention" in str(n.target) for n in gm.graph.nodes)
    assert "ring_attention" in cpu
    assert collectives(gm) == cpu


def test_cuda_efficient_attention_keeps_samples_apart_in_one_process(monkeypatch):
    capture_with_efficient_attention(monkeypatch)
    engine = lf.compile(tiny_llama(), config=lf.DPConfig(1.0, 1.0, seed=0))
    ids = torch.zeros(2, 16, dtype=torch.long)
    gm = engine._training_graph((ids, ids))[1]
    attention = list(gm.graph.find_nodes(op="call_function", target=EFFICIENT))
    assert len(attention) == 2
    for node in attention:
        assert [u.meta["batch_dim"] for u in sorted(node.users, key=lambda u: u.args[1])][:2] == \
            [node.args[0].meta["batch_dim"]] * 2
    assert len(engine._train[2].per_sample) == len(dict(engine.model.named_parameters()))


class HandWrittenAttentionLM(nn.Module):
    """Causal attention as matmul + softmax: under cp it would attend within the local shard."""

    def __init__(self, dim=16):
        super().__init__()
        self.embed = nn.Embedding(256, dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.head = nn.Linear(dim, 256, bias=False)

    def forward(self, ids, position_ids=None):
        q, k, v = self.qkv(self.embed(ids)).chunk(3, dim=-1)
        T = ids.shape[1]
        future = torch.ones(T, T, dtype=torch.bool, device=ids.device).triu(1)
        scores = (q @ k.transpose(1, 2)).masked_fill(future, float("-inf"))
        return self.head(F.softmax(scores, dim=-1) @ v)


def test_hand_written_attention_is_refused_under_context_parallelism():
    from torch.distributed.device_mesh import init_device_mesh

    ids = torch.zeros(2, 16, dtype=torch.long)
    one = lf.compile(lf.CausalLMLoss(HandWrittenAttentionLM()), config=lf.DPConfig(1.0, 1.0, seed=0))
    one._training_graph((ids, ids))  # fine in one process
    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
        engine = lf.compile(lf.CausalLMLoss(HandWrittenAttentionLM()), mesh, config=lf.DPConfig(1.0, 1.0, seed=0))
        with pytest.raises(lf.UnsupportedModelError, match=r"softmax over the \(sharded\) sequence.*sdpa"):
            engine._training_graph((ids, ids))
