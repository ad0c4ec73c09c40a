"""Structure of the context-parallel graph on a fake process group (one process, no data).

Pins the collectives the ``context_parallel``, ``shard_grads`` and ``clip`` passes insert
at world sizes 2, 4 and 8, and checks the bytes claims from fake-tensor metadata.
"""
import contextlib

import pytest
import torch
import torch.distributed as dist
from expecttest import assert_expected_inline
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

import longshield_fx as lf
from longshield_fx.passes.shard_grads import shard_dim

from oracles import tiny_llama


@contextlib.contextmanager
def fake_world(size):
    dist.init_process_group("fake", rank=0, world_size=size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def build(cp, dp=1, T=32, B=2, comm="input_stationary", **model_kw):
    mesh = init_device_mesh("cpu", (dp, cp), mesh_dim_names=("dp", "cp")) if dp > 1 else \
        init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    engine = lf.compile(tiny_llama(**model_kw), mesh, config=lf.DPConfig(1.0, 1.0, per_sample_comm=comm))
    ids = torch.zeros(B, T, dtype=torch.long)
    engine._training_graph((ids, ids))
    return engine


def collectives(gm) -> str:
    """One line per distinct collective: op, shapes in -> out, count."""
    lines = {}
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


def test_collectives_cp2():
    with fake_world(2):
        gm = build(2).graph_module
    assert_expected_inline(collectives(gm), """\
ring_attention [(2, 4, 16, 16), (2, 2, 16, 16), (2, 2, 16, 16)] -> [(2, 4, 16, 16), (2, 4, 16)] x2
reduce_scatter_tensor [(256, 2, 64)] -> [(128, 2, 64)] x2
all_reduce [(2, 64)] -> [(2, 64)] x5
reduce_scatter_tensor [(192, 2, 64)] -> [(96, 2, 64)] x6
reduce_scatter_tensor [(64, 2, 64)] -> [(32, 2, 64)] x4
ring_attention_backward [(2, 4, 16, 16), (2, 4, 16, 16), (2, 2, 16, 16), (2, 2, 16, 16), (2, 4, 16, 16), (2, 4, 16)] -> [(2, 4, 16, 16), (2, 2, 16, 16), (2, 2, 16, 16)] x2
reduce_scatter_tensor [(64, 2, 32)] -> [(32, 2, 32)] x4
all_reduce [(2,)] -> [(2,)] x1""")


def test_collectives_cp4():
    with fake_world(4):
        gm = build(4).graph_module
    assert_expected_inline(collectives(gm), """\
ring_attention [(2, 4, 8, 16), (2, 2, 8, 16), (2, 2, 8, 16)] -> [(2, 4, 8, 16), (2, 4, 8)] x2
reduce_scatter_tensor [(256, 2, 64)] -> [(64, 2, 64)] x2
all_reduce [(2, 64)] -> [(2, 64)] x5
reduce_scatter_tensor [(192, 2, 64)] -> [(48, 2, 64)] x6
reduce_scatter_tensor [(64, 2, 64)] -> [(16, 2, 64)] x4
ring_attention_backward [(2, 4, 8, 16), (2, 4, 8, 16), (2, 2, 8, 16), (2, 2, 8, 16), (2, 4, 8, 16), (2, 4, 8)] -> [(2, 4, 8, 16), (2, 2, 8, 16), (2, 2, 8, 16)] x2
reduce_scatter_tensor [(64, 2, 32)] -> [(16, 2, 32)] x4
all_reduce [(2,)] -> [(2,)] x1""")


def test_collectives_dp2_cp4():
    with fake_world(8):
        gm = build(4, dp=2).graph_module
    assert_expected_inline(collectives(gm), """\
ring_attention [(2, 4, 8, 16), (2, 2, 8, 16), (2, 2, 8, 16)] -> [(2, 4, 8, 16), (2, 4, 8)] x2
reduce_scatter_tensor [(256, 2, 64)] -> [(64, 2, 64)] x2
all_reduce [(2, 64)] -> [(2, 64)] x5
reduce_scatter_tensor [(192, 2, 64)] -> [(48, 2, 64)] x6
reduce_scatter_tensor [(64, 2, 64)] -> [(16, 2, 64)] x4
ring_attention_backward [(2, 4, 8, 16), (2, 4, 8, 16), (2, 2, 8, 16), (2, 2, 8, 16), (2, 4, 8, 16), (2, 4, 8)] -> [(2, 4, 8, 16), (2, 2, 8, 16), (2, 2, 8, 16)] x2
reduce_scatter_tensor [(64, 2, 32)] -> [(16, 2, 32)] x4
all_reduce [(2,)] -> [(2,)] x1""")


def test_reduce_scatter_bytes_do_not_grow_with_T_and_activations_halve_with_cp():
    def activation_bytes(gm):
        return sum(n.meta["val"].numel() * n.meta["val"].element_size() for n in gm.graph.nodes
                   if n.meta.get("partitioner_tag") == "is_forward" and n.op == "call_function"
                   and n.meta.get("batch_dim") is not None and isinstance(n.meta.get("val"), torch.Tensor)
                   and n.meta["val"].dim() >= 2)  # per-token tensors; the (B,) loss has no T

    with fake_world(2):
        short, long = build(2, T=256), build(2, T=2048)
        cp2 = activation_bytes(long.graph_module)
        assert short.communication_bytes()["reduce_scatter"] == long.communication_bytes()["reduce_scatter"] > 0
        assert short.communication_bytes()["all_reduce"] == long.communication_bytes()["all_reduce"]
        assert long.communication_bytes()["ring_attention"] == 8 * short.communication_bytes()["ring_attention"]
    with fake_world(4):
        cp4 = activation_bytes(build(4, T=2048).graph_module)
    assert cp4 * 2 == cp2


def per_sample_bytes(engine):
    b = engine.communication_bytes()
    return b["reduce_scatter"] + b["all_reduce"] + b["all_gather"]


def test_input_stationary_bytes_constant_output_stationary_linear_in_T():
    with fake_world(2):
        inp = [per_sample_bytes(build(2, T=T, B=1)) for T in (512, 2048, 8192)]
        out = [per_sample_bytes(build(2, T=T, B=1, comm="output_stationary")) for T in (512, 2048, 8192)]
    assert inp[0] == inp[1] == inp[2]
    # affine in T: equal steps for equal increments (2048-512 = 1536, 8192-2048 = 6144 = 4x)
    assert (out[2] - out[1]) == 4 * (out[1] - out[0]) > 0
    assert out[2] > inp[2]


def test_shard_dim_rule():
    assert shard_dim((256, 64), 2) == 0      # the larger dim
    assert shard_dim((64, 192), 4) == 1
    assert shard_dim((64,), 2) is None       # norm weights: all-reduced
    assert shard_dim((6, 9), 4) is None      # nothing divisible
    assert shard_dim((6, 8), 4) == 1


def test_bad_mesh_and_sequence_are_refused_before_any_collective():
    with fake_world(2):
        flat = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        with pytest.raises(ValueError, match="dimension named 'cp'"):
            lf.compile(tiny_llama(), flat, config=lf.DPConfig(1.0, 1.0))
        engine = lf.compile(tiny_llama(), init_device_mesh("cpu", (2,), mesh_dim_names=("cp",)),
                            config=lf.DPConfig(1.0, 1.0))
        ids = torch.zeros(2, 30, dtype=torch.long)
        with pytest.raises(ValueError, match="multiple of 2\\*cp = 4"):
            engine.accumulate(ids, ids)
    with fake_world(4):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
        with pytest.raises(ValueError, match="the mesh has 2 ranks but the world has 4"):
            lf.compile(tiny_llama(), mesh, config=lf.DPConfig(1.0, 1.0))
