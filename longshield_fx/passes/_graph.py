"""Graph utilities shared by the passes."""
from __future__ import annotations

import torch
import torch.fx as fx


def module_of(node: fx.Node) -> str:
    """The module path a node came from, from dynamo's metadata, or '<model>'."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    if not stack:
        return "<model>"
    path, cls = list(stack.values())[-1]
    path = path.replace("L['self'].", "").replace("L['mod'].", "")
    if path.startswith("L['"):
        path = path.split("].", 1)[-1] if "]." in path else "<model>"
    name = getattr(cls, "__name__", str(cls))
    return f"{path} ({name})"


def is_backward(node: fx.Node) -> bool:
    return node.meta.get("partitioner_tag") == "is_backward"


def val(node) -> torch.Tensor | None:
    """The fake tensor a node produces, or None for non-tensor values."""
    if isinstance(node, fx.Node):
        v = node.meta.get("val")
        return v if isinstance(v, torch.Tensor) else None
    return None


def nbytes(node) -> int:
    """Bytes of the tensor a node produces (0 for non-tensor values)."""
    v = val(node)
    return 0 if v is None else v.numel() * v.element_size()



# Fused attention forward -> its backward, for every device the SDPA dispatcher may pick
# (CPU: flash; CUDA: flash for fp16/bf16, memory-efficient for fp32, cuDNN where enabled).
# All take (q, k, v, ...) and return (out, lse, ...); backwards take (grad_out, q, k, v, ...)
# and return (dq, dk, dv, ...).
FUSED_ATTENTION = {
    getattr(torch.ops.aten, f"_scaled_dot_product_{kernel}").default:
        getattr(torch.ops.aten, f"_scaled_dot_product_{kernel}_backward").default
    for kernel in ("flash_attention_for_cpu", "flash_attention", "efficient_attention", "cudnn_attention")
}


def tensor_args(node: fx.Node) -> list[fx.Node]:
    """Flattened tensor-valued node inputs (lists of tensors included)."""
    out = []
    for a in _flat(node):
        if val(a) is not None:
            out.append(a)
    return out


def _flat(node: fx.Node):
    found = []
    torch.fx.node.map_arg((node.args, node.kwargs), found.append)
    return found


def fake_propagate(gm: fx.GraphModule) -> None:
    """Fill ``meta["val"]`` of every node by fake-tensor propagation from the placeholders."""
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    fake_args = [p.meta["val"] for p in placeholders]
    mode = next(a.fake_mode for a in fake_args if hasattr(a, "fake_mode"))
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fake_args)


class GraphBuilder:
    """Creates nodes at the graph's current insertion point with ``meta["val"]`` filled.

    ``b(op, *args)`` inserts ``op(*args)`` and runs it on the fake inputs so later rules can
    read shapes without a separate propagation pass. New nodes are tagged as backward.
    """

    def __init__(self, graph: fx.Graph, fake_mode):
        self.graph = graph
        self.fake_mode = fake_mode

    def __call__(self, op, *args, **kwargs) -> fx.Node:
        node = self.graph.call_function(op, args, kwargs)
        fake_args, fake_kwargs = fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
        with self.fake_mode:
            node.meta["val"] = op(*fake_args, **fake_kwargs)
        node.meta["partitioner_tag"] = "is_backward"
        return node
