"""scatter_clipped_sums on a fake world of dp=2 x cp=2: ZeRO-3 over all four ranks and hybrid
sharding (over cp, replicated over dp). Values: tests/runtime/test_parallel.py."""
import math

import pytest
import torch

from longshield_fx._torch import c10d
from longshield_fx.passes._context import CP_SHARD_DIM

aten = torch.ops.aten


def shard_outputs(shared) -> dict:
    loss_sum, norms, *sums = shared.gm.graph.output_node().args[0]
    return dict(zip(shared.lowered.captured.param_names, sums))


@pytest.mark.parametrize("fsdp, n", [(("dp", "cp"), 4), (("cp",), 2)], ids=["zero3", "hybrid"])
def test_each_clipped_sum_leaves_the_graph_as_this_ranks_fp32_shard(cp_graph, fsdp, n):
    shared = cp_graph(2, dp=2, fsdp=fsdp, vocab_size=250)
    sharding = shared.engine.sharding
    model = shared.engine.model
    sp_sharded = 0
    for name, out in shard_outputs(shared).items():
        full = model.get_parameter(name).shape
        padded = (math.ceil(full[0] / n) * n, *full[1:])
        assert tuple(out.meta["val"].shape) == (padded[0] // n, *full[1:]), name
        assert out.meta["val"].dtype == torch.float32, name
        if sharding.replica_group is not None:  # hybrid: summed over the replicas of the shard
            assert out.args[0].target == c10d.all_reduce.default
            assert out.args[0].args[1:] == ("sum", sharding.replica_group.group_name)
            out = out.args[0].args[0]
        else:
            assert sharding.replica_group is None
        scatter = out.args[0]
        assert scatter.target == c10d.reduce_scatter_tensor.default, name
        assert scatter.args[1:] == ("sum", n, sharding.group.group_name), name
        contribution = scatter.args[0]
        assert tuple(contribution.meta["val"].shape) == padded, name  # the padded full parameter
        dim = shared.lowered.ctx.param_meta(name).get(CP_SHARD_DIM)
        if dim is None and padded[0] == full[0]:
            assert contribution.target != aten.constant_pad_nd.default, name  # whole: contributed as it is
            continue
        # One padding op: this rank's sp slice in its place, zeros around it, dim 0 padded to whole shards.
        assert contribution.target == aten.constant_pad_nd.default, name
        pad, local = contribution.args[1], contribution.args[0].meta["val"].shape
        for d in range(len(full)):
            before, after = pad[2 * (len(full) - 1 - d)], pad[2 * (len(full) - 1 - d) + 1]
            assert local[d] + before + after == padded[d], name
            assert before == (shared.lowered.ctx.sp_rank * local[d] if d == dim else 0), name
        sp_sharded += dim is not None
    assert sp_sharded > 0


def test_the_reduce_scatters_move_the_padded_parameters_in_fp32(cp_graph):
    shared = cp_graph(2, dp=2, fsdp=("dp", "cp"), vocab_size=250)
    padded = sum(math.ceil(p.shape[0] / 4) * 4 * math.prod(p.shape[1:]) for p in shared.engine.model.parameters())
    scatters = [n for n in shared.gm.graph.nodes if n.target == c10d.reduce_scatter_tensor.default
                and n.args[2] == 4]
    assert sum(s.args[0].meta["val"].numel() * 4 for s in scatters) == padded * 4
