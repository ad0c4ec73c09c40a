"""Structure of the context-parallel graph on a fake process group (one process, no data).

Pins the collectives the ``context_parallel``, ``shard_grads`` and ``clip`` passes insert
at world sizes 2, 4 and 8 (golden, and derived from the model's parameters), and checks the
bytes claims from fake-tensor metadata. Graphs come from the shared ``cp_graph`` fixture.
"""
import pytest
import torch
from expecttest import assert_expected_inline

import longshield_fx as lf
from longshield_fx._torch import COLLECTIVES
from longshield_fx.passes.shard_grads import shard_dim

from oracles import tiny_llama


def test_collectives_cp2(cp_graph, describe_collectives):
    assert_expected_inline(describe_collectives(cp_graph(2).gm), """\
ring_attention [(2, 4, 16, 16), (2, 2, 16, 16), (2, 2, 16, 16)] -> [(2, 4, 16, 16), (2, 4, 16)] x2
lm_head_loss [(2, 16, 64), (256, 64), (2, 16), (2, 16)] -> [(2, 16), (2, 16, 64), (2, 256, 64)] x1
reduce_scatter_tensor [(256, 2, 64)] -> [(128, 2, 64)] x1
all_reduce [(2, 64)] -> [(2, 64)] x5
reduce_scatter_tensor [(64, 2, 192)] -> [(32, 2, 192)] x2
reduce_scatter_tensor [(192, 2, 64)] -> [(96, 2, 64)] x4
reduce_scatter_tensor [(64, 2, 64)] -> [(32, 2, 64)] x4
ring_attention_backward [(2, 4, 16, 16), (2, 4, 16, 16), (2, 2, 16, 16), (2, 2, 16, 16), (2, 4, 16, 16), (2, 4, 16)] -> [(2, 4, 16, 16), (2, 2, 16, 16), (2, 2, 16, 16)] x2
reduce_scatter_tensor [(32, 2, 64)] -> [(16, 2, 64)] x4
all_gather_into_tensor [(16, 2)] -> [(32, 2)] x1
all_gather_into_tensor [(16, 2, 64)] -> [(32, 2, 64)] x1
all_reduce [(2,)] -> [(2,)] x1""")


def test_collectives_cp4(cp_graph, describe_collectives):
    assert_expected_inline(describe_collectives(cp_graph(4).gm), """\
ring_attention [(2, 4, 8, 16), (2, 2, 8, 16), (2, 2, 8, 16)] -> [(2, 4, 8, 16), (2, 4, 8)] x2
lm_head_loss [(2, 8, 64), (256, 64), (2, 8), (2, 8)] -> [(2, 8), (2, 8, 64), (2, 256, 64)] x1
reduce_scatter_tensor [(256, 2, 64)] -> [(64, 2, 64)] x1
all_reduce [(2, 64)] -> [(2, 64)] x5
reduce_scatter_tensor [(64, 2, 192)] -> [(16, 2, 192)] x2
reduce_scatter_tensor [(192, 2, 64)] -> [(48, 2, 64)] x4
reduce_scatter_tensor [(64, 2, 64)] -> [(16, 2, 64)] x4
ring_attention_backward [(2, 4, 8, 16), (2, 4, 8, 16), (2, 2, 8, 16), (2, 2, 8, 16), (2, 4, 8, 16), (2, 4, 8)] -> [(2, 4, 8, 16), (2, 2, 8, 16), (2, 2, 8, 16)] x2
reduce_scatter_tensor [(32, 2, 64)] -> [(8, 2, 64)] x4
all_gather_into_tensor [(8, 2)] -> [(32, 2)] x1
all_gather_into_tensor [(8, 2, 64)] -> [(32, 2, 64)] x1
all_reduce [(2,)] -> [(2,)] x1""")


def test_collectives_dp2_cp4_are_those_of_cp4(cp_graph, describe_collectives):
    """dp only splits the batch between replicas: the graph's collectives are cp's."""
    assert describe_collectives(cp_graph(4, dp=2).gm) == describe_collectives(cp_graph(4).gm)


@pytest.mark.parametrize("cp, dp", [(2, 1), (4, 1), (4, 2)])
def test_one_collective_per_parameter_derived_from_the_model(cp_graph, cp, dp):
    """The per-sample collectives, derived from the model's parameters and ``shard_dim``: a
    reduce-scatter of (P_d, B, *rest) along the shard dim, or an all-reduce of (B, *shape);
    for the embedding (T = 32 tokens, fewer than its 256 rows) an all-gather of each rank's
    token ids (T/cp, B) and gradient rows (T/cp, B, d) instead; one all-reduce of the B
    squared norms; one ring attention (and backward) per layer."""
    shared = cp_graph(cp, dp=dp)
    B, T = shared.batch[0].shape
    model = shared.engine.model
    expected = []
    for name, p in model.named_parameters():
        dim = shard_dim(tuple(p.shape), cp)
        assert shared.lowered.shard_dims[name] == dim, name
        if p is model.lm.tok_embeddings.weight:
            assert T < p.shape[0] and dim == 0
            expected += [("all_gather_into_tensor", (T // cp, B)), ("all_gather_into_tensor", (T // cp, B, p.shape[1]))]
        elif dim is None:
            expected.append(("all_reduce", (B, *p.shape)))
        else:
            rest = [s for d, s in enumerate(p.shape) if d != dim]
            expected.append(("reduce_scatter_tensor", (p.shape[dim], B, *rest)))
    expected.append(("all_reduce", (B,)))  # flat clipping: the squared norms
    found = [(str(n.target).split(".")[1], tuple(n.args[0].meta["val"].shape))
             for n in shared.gm.graph.nodes if n.target in COLLECTIVES]
    assert sorted(found) == sorted(expected)
    ring = [n for n in shared.gm.graph.nodes if str(n.target).startswith("longshield.ring_attention")]
    n_layers = len(model.lm.layers)
    assert sorted(str(n.target) for n in ring) == ["longshield.ring_attention.default"] * n_layers + \
        ["longshield.ring_attention_backward.default"] * n_layers


def test_embedding_rows_are_gathered_only_while_fewer_than_the_table_rows(cp_graph):
    """T = 32 tokens, 256 embedding rows: each rank's ids and rows are gathered and no (B, V, d)
    buffer is reduce-scattered; T = 512: the dense gradient's reduce-scatter moves fewer bytes."""
    V, d = cp_graph(2).engine.model.lm.tok_embeddings.weight.shape
    for shared, gathered in ((cp_graph(2), True), (cp_graph(2, T=512, B=1), False)):
        B, T = shared.batch[0].shape
        found = [(str(n.target).split(".")[1], tuple(n.args[0].meta["val"].shape))
                 for n in shared.gm.graph.nodes if n.target in COLLECTIVES]
        rows = [("all_gather_into_tensor", (T // 2, B)), ("all_gather_into_tensor", (T // 2, B, d))]
        assert all(f in found for f in rows) == gathered
        assert found.count(("reduce_scatter_tensor", (V, B, d))) == (1 if gathered else 2)  # the head's, + the table's


def test_reduce_scatter_bytes_do_not_grow_with_T_and_activations_halve_with_cp(cp_graph):
    def activation_bytes(gm):
        return sum(n.meta["val"].numel() * n.meta["val"].element_size() for n in gm.graph.nodes
                   if n.meta.get("partitioner_tag") == "is_forward" and n.op == "call_function"
                   and n.meta.get("batch_dim") is not None and isinstance(n.meta.get("val"), torch.Tensor)
                   and n.meta["val"].dim() >= 2)  # per-token tensors; the (B,) loss has no T

    short, long = cp_graph(2, T=512, B=1), cp_graph(2, T=2048, B=1)  # shared with the test below
    short_bytes, long_bytes = short.engine.communication_bytes(), long.engine.communication_bytes()
    assert short_bytes["reduce_scatter"] == long_bytes["reduce_scatter"] > 0
    assert short_bytes["all_reduce"] == long_bytes["all_reduce"]
    assert long_bytes["ring_attention"] == 4 * short_bytes["ring_attention"]  # K/V blocks: linear in T
    assert activation_bytes(cp_graph(4, T=2048, B=1).gm) * 2 == activation_bytes(long.gm)


def per_sample_bytes(engine):
    b = engine.communication_bytes()
    return b["reduce_scatter"] + b["all_reduce"] + b["all_gather"]


def test_input_stationary_bytes_constant_output_stationary_linear_in_T(cp_graph):
    Ts = (512, 2048, 8192)
    inp = [per_sample_bytes(cp_graph(2, T=T, B=1).engine) for T in Ts]
    out = [per_sample_bytes(cp_graph(2, T=T, B=1, comm="output_stationary").engine) for T in Ts]
    assert inp[0] == inp[1] == inp[2]
    # affine in T: equal steps for equal increments (2048-512 = 1536, 8192-2048 = 6144 = 4x)
    assert (out[2] - out[1]) == 4 * (out[1] - out[0]) > 0
    assert out[2] > inp[2]


def test_shard_dim_rule():
    assert shard_dim((256, 64), 2) == 0      # dim 0 when divisible
    assert shard_dim((64, 192), 4) == 0
    assert shard_dim((6, 192), 4) == 1
    assert shard_dim((64,), 2) is None       # norm weights: all-reduced
    assert shard_dim((6, 9), 4) is None      # nothing divisible
    assert shard_dim((6, 8), 4) == 1


def test_bad_mesh_and_sequence_are_refused_before_any_collective(fake_world):
    from torch.distributed.device_mesh import init_device_mesh

    with fake_world(2) as mesh:
        flat = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        with pytest.raises(ValueError, match="dimension named 'cp'"):
            lf.compile(tiny_llama(), flat, config=lf.DPConfig(1.0, 1.0))
        engine = lf.compile(tiny_llama(), mesh, config=lf.DPConfig(1.0, 1.0))
        ids = torch.zeros(2, 30, dtype=torch.long)
        with pytest.raises(ValueError, match="multiple of 2\\*cp = 4"):
            engine.accumulate(ids, ids)
    with fake_world(4):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
        with pytest.raises(ValueError, match="the mesh has 2 ranks but the world has 4"):
            lf.compile(tiny_llama(), mesh, config=lf.DPConfig(1.0, 1.0))
