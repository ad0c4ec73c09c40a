"""The private torch APIs longshield_fx uses, all behind this one adapter (checked on torch 2.13).

A torch upgrade that breaks one of them breaks it here; nothing else in the package imports
a ``torch._*`` module or ``torch.testing._internal``.

=================================================================  ======================================
private API                                                        why
=================================================================  ======================================
``torch._dynamo.functional_export.dynamo_graph_capture_for_export``  capture with module metadata kept
``torch._functorch.aot_autograd.aot_export_joint_with_descriptors``  the joint forward+backward graph
``torch._functorch._aot_autograd.descriptors``                       which graph input/output is what
``torch._dynamo.config.patch``, ``torch._guards.tracing``            static shapes; the tracing context
``torch._subclasses.fake_tensor.FakeTensorMode``                     fake models (planner, tests)
``torch._ops.OpOverload``                                            "is this an aten overload with tags"
``torch.ops._c10d_functional``                                       functional collectives in graphs
``torch.testing._internal.distributed.fake_pg``                      registers the "fake" process group
``torch.distributed.distributed_c10d._resolve_process_group``        a graph's group name -> its group
=================================================================  ======================================
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.fx as fx
from torch._functorch._aot_autograd import descriptors  # noqa: F401  (re-exported)
from torch._ops import OpOverload  # noqa: F401  (re-exported)
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: F401  (re-exported)

__all__ = ["COLLECTIVES", "FakeTensorMode", "OpOverload", "c10d", "descriptors", "export_joint", "fake_world",
           "resolve_process_group"]

c10d = torch.ops._c10d_functional
COLLECTIVES = {c10d.reduce_scatter_tensor.default, c10d.all_reduce.default, c10d.all_gather_into_tensor.default}


def resolve_process_group(group_name: str) -> dist.ProcessGroup:
    """The process group a functional collective or custom op names by ``group_name``."""
    return dist.distributed_c10d._resolve_process_group(group_name)


def export_joint(model: torch.nn.Module, example_batch: tuple) -> tuple[fx.GraphModule, object]:
    """The aot-autograd joint graph of ``model(*example_batch)`` and its fake mode.

    Dynamo keeps ``nn_module_stack`` (forward) / ``fwd_nn_module_stack`` (backward) on nodes.
    Shapes are static: a second capture of the same code with another batch size would
    otherwise turn sizes symbolic (dynamo's automatic dynamic shapes).
    """
    from torch._dynamo.functional_export import dynamo_graph_capture_for_export
    from torch._functorch.aot_autograd import aot_export_joint_with_descriptors
    import torch.fx.traceback as fx_traceback

    with torch._dynamo.config.patch(automatic_dynamic_shapes=False, assume_static_by_default=True), \
            fx_traceback.preserve_node_meta():
        dynamo_gm = dynamo_graph_capture_for_export(model)(*example_batch)
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch._guards.tracing(dynamo_gm.meta["tracing_context"]))
        joint = aot_export_joint_with_descriptors(stack, dynamo_gm, tuple(example_batch))
    return joint.graph_module, joint.fake_mode


@contextlib.contextmanager
def fake_world(cp: int, dp: int = 1):
    """A one-process fake process group of ``dp * cp`` ranks; yields its ("dp", "cp") mesh
    (1-D "cp" when ``dp == 1``). Rank 0's view: graphs get real shapes and collective
    nodes, nothing is sent. The group is destroyed on exit."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("fake", rank=0, world_size=dp * cp, store=dist.HashStore())
    try:
        if dp == 1:
            yield init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
        else:
            yield init_device_mesh("cpu", (dp, cp), mesh_dim_names=("dp", "cp"))
    finally:
        dist.destroy_process_group()
