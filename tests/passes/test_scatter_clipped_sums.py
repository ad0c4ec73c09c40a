"""scatter_clipped_sums on a fake world of dp=2 x cp=2: ZeRO-3 over all four ranks and hybrid
sharding (over cp, replicated over dp). Values: tests/runtime/test_parallel.py."""
import math

import pytest
import torch

from longshield_fx._torch import c10d
from longshield_fx.passes._context import CP_SHARD_DIM

aten = torch.ops.aten
VOCAB = 250  # 250 rows: not a multiple of 4 (ZeRO-3 pads the embedding and head), but of 2


def shard_outputs(shared) -> dict:
    loss_sum, norms, *sums = shared.gm.graph.output_node().args[0]
    return dict(zip(shared.lowered.captured.param_names, sums))


def padded_contribution(shared, name, out, full, padded):
    """``out`` is the reduce-scatter of one padding op: this rank's sp slice in its place, zeros
    around it, dim 0 padded to whole shards (the gradient as it is when neither is needed)."""
    scatter = out.args[0]
    sharding = shared.engine.sharding
    assert scatter.target == c10d.reduce_scatter_tensor.default, name
    assert scatter.args[1:] == ("sum", sharding.n, sharding.group_name), name
    contribution = scatter.args[0]
    assert tuple(contribution.meta["val"].shape) == padded, name
    dim = shared.lowered.ctx.param_meta(name).get(CP_SHARD_DIM)
    if dim is None and padded[0] == full[0]:
        assert contribution.target != aten.constant_pad_nd.default, name
        return
    assert contribution.target == aten.constant_pad_nd.default, name
    pad, local = contribution.args[1], contribution.args[0].meta["val"].shape
    for d in range(len(full)):
        before, after = pad[2 * (len(full) - 1 - d)], pad[2 * (len(full) - 1 - d) + 1]
        assert local[d] + before + after == padded[d], name
        assert before == (shared.lowered.ctx.sp_rank * local[d] if d == dim else 0), name


@pytest.mark.parametrize("fsdp, n, rank", [(("dp", "cp"), 4, 0), (("dp", "cp"), 4, 1), (("cp",), 2, 1)],
                         ids=["zero3-rank0", "zero3-rank1", "hybrid-rank1"])
def test_each_clipped_sum_leaves_the_graph_as_this_ranks_fp32_shard(cp_graph, fsdp, n, rank):
    """Mesh ("dp", "cp"): rank r = 2d + c holds sp slice c (rows [c p/2, (c+1) p/2)). ZeRO-3
    shard r is rows [r p/4, (r+1) p/4), in slice d. A gradient sharded along dim 0 whose rows
    divide into 4 goes straight from the slices: rank r sends its slice's shards 2c, 2c+1 to
    their owners and sums the two copies of its own shard from the holders of slice d, ranks
    d and 2 + d. Hybrid (shards over cp): slice c is shard c, so nothing moves within the
    shard group. Every other gradient is padded and reduce-scattered."""
    shared = cp_graph(2, dp=2, fsdp=fsdp, vocab_size=VOCAB, rank=rank)
    sharding = shared.engine.sharding
    model = shared.engine.model
    d, c = divmod(rank, 2)
    kinds = set()
    for name, out in shard_outputs(shared).items():
        full = model.get_parameter(name).shape
        padded = (math.ceil(full[0] / n) * n, *full[1:])
        size = padded[0] // n
        assert tuple(out.meta["val"].shape) == (size, *full[1:]), name
        assert out.meta["val"].dtype == torch.float32, name
        if sharding.replica_group_name is not None:  # hybrid: summed over the replicas of the shard
            assert out.args[0].target == c10d.all_reduce.default
            assert out.args[0].args[1:] == ("sum", sharding.replica_group_name)
            out = out.args[0].args[0]
        dim = shared.lowered.ctx.param_meta(name).get(CP_SHARD_DIM)
        if dim != 0 or full[0] % n:
            padded_contribution(shared, name, out, full, padded)
            kinds.add("padded")
        elif n == 2:
            assert out.op == "call_function" and out.target not in (c10d.wait_tensor.default,), name
            assert not any(a.target in (c10d.all_to_all_single.default, c10d.reduce_scatter_tensor.default)
                           for a in out.all_input_nodes), name
            kinds.add("kept")
        else:
            assert out.target == aten.sum.dim_IntList and out.args[1] == [0], name
            exchange = out.args[0].args[0].args[0]
            assert exchange.target == c10d.all_to_all_single.default, name
            receive, send, group = exchange.args[1:]
            assert group == sharding.group_name
            assert send == [size if k in (2 * c, 2 * c + 1) else 0 for k in range(4)], name
            assert receive == [size if k in (d, d + 2) else 0 for k in range(4)], name
            assert tuple(exchange.args[0].meta["val"].shape) == (full[0] // 2, *full[1:]), name  # the slice
            kinds.add("exchanged")
    assert kinds == ({"padded", "kept"} if n == 2 else {"padded", "exchanged"})


def test_only_the_padded_gradients_move_whole_the_exchanged_ones_move_their_slice(cp_graph):
    shared = cp_graph(2, dp=2, fsdp=("dp", "cp"), vocab_size=VOCAB)
    model, ctx = shared.engine.model, shared.lowered.ctx
    padded = exchanged = 0
    for name, p in model.named_parameters():
        if ctx.param_meta(name).get(CP_SHARD_DIM) == 0 and p.shape[0] % 4 == 0:
            exchanged += p.numel() // 2  # the sp slice
        else:
            padded += math.ceil(p.shape[0] / 4) * 4 * math.prod(p.shape[1:])
    nodes = shared.gm.graph.nodes
    scatters = [n for n in nodes if n.target == c10d.reduce_scatter_tensor.default and n.args[2] == 4]
    exchanges = [n for n in nodes if n.target == c10d.all_to_all_single.default]
    assert sum(s.args[0].meta["val"].numel() * 4 for s in scatters) == padded * 4
    assert sum(e.args[0].meta["val"].numel() * 4 for e in exchanges) == exchanged * 4
    assert exchanged > padded > 0
    # rank 0 (d = c = 0) keeps its own shard of slice 0 and sends the other: half of each slice leaves
    assert shared.engine.communication_bytes()["all_to_all"] == exchanged * 4 // 2
