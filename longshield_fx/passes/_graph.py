"""Graph utilities shared by the passes."""
from __future__ import annotations

import re

import torch
import torch.fx as fx

from .._torch import OpOverload, c10d

aten = torch.ops.aten


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


_BLOCK = re.compile(r"^(.*?\.)?\w+\.\d+$")


def region_of(node: fx.Node) -> str | None:
    """The transformer block a node comes from (the first module on its path whose name
    ends in an index: ``layers.3``, ``h.0``), from the forward's module stack, or for a
    backward node the stack of the forward node it differentiates; None outside blocks."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    for path, _ in stack.values():
        if _BLOCK.match(path):
            return path
    return None


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



# Fused attention kernels, one row per kernel the SDPA dispatcher may pick (CPU: flash; CUDA:
# flash for fp16/bf16, memory-efficient for fp32, cuDNN where enabled), with the forward
# outputs that hold per-sample rows (the others are RNG state, sequence offsets or sizes).
# Forwards take (q, k, v, ...) and return (out, lse, ...); backwards take (grad_out, q, k, v,
# ...) and return (dq, dk, dv, ...).
_ATTENTION_KERNELS = {
    "flash_attention_for_cpu": (0, 1),  # out, lse
    "flash_attention": (0, 1, 8),  # out, lse, debug mask
    "efficient_attention": (0, 1),
    "cudnn_attention": (0, 1, 8),
}
FUSED_ATTENTION = {}  # forward -> backward
ATTENTION_BATCHED_OUTPUTS = {}  # forward or backward -> outputs holding per-sample rows
for _kernel, _rows in _ATTENTION_KERNELS.items():
    _fwd = getattr(aten, f"_scaled_dot_product_{_kernel}").default
    FUSED_ATTENTION[_fwd] = getattr(aten, f"_scaled_dot_product_{_kernel}_backward").default
    ATTENTION_BATCHED_OUTPUTS[_fwd] = _rows
    ATTENTION_BATCHED_OUTPUTS[FUSED_ATTENTION[_fwd]] = (0, 1, 2)  # dq, dk, dv


def is_head_all_to_all(node: fx.Node) -> bool:
    """2D attention's all-to-alls over hp split evenly; ``scatter_clipped_sums``' exchange of
    clipped-sum shards over the fsdp group does not (it sends nothing to some ranks)."""
    return node.target == c10d.all_to_all_single.default and len(set(node.args[1])) == 1


def arg_of(node: fx.Node, name: str, default=None):
    """Argument ``name`` of an aten call, by its schema (positional, keyword or default)."""
    for i, arg in enumerate(node.target._schema.arguments):
        if arg.name != name:
            continue
        if not arg.kwarg_only and i < len(node.args):
            return node.args[i]
        return node.kwargs.get(name, arg.default_value if arg.has_default_value() else default)
    return default


def norm_dim(dim: int, rank: int) -> int:
    """A dim argument as a non-negative index."""
    return dim + rank if dim < 0 else dim


def permutation(node: fx.Node) -> list[int]:
    """For ``t``, ``transpose`` or ``permute``: output dim i is input dim perm[i]."""
    rank = val(node).dim()
    if node.target == aten.t.default:
        return list(range(rank))[::-1]
    if node.target == aten.transpose.int:
        perm = list(range(rank))
        a, b = norm_dim(node.args[1], rank), norm_dim(node.args[2], rank)
        perm[a], perm[b] = perm[b], perm[a]
        return perm
    return [norm_dim(d, rank) for d in node.args[1]]


_POINTWISE_EXTRA = {aten._to_copy.default, aten.detach.default, aten.alias.default,
                    aten.copy.default, aten.lift_fresh_copy.default, aten.contiguous.default,
                    aten.floor_divide.default, aten.floor_divide.Scalar}
# Elementwise activation backwards that aten does not tag pointwise.
_POINTWISE_EXTRA |= {getattr(aten, f"{name}_backward").default for name in (
    "softplus", "gelu", "silu", "elu", "leaky_relu", "hardtanh", "hardswish", "hardsigmoid", "mish", "logit")}


def is_pointwise(op) -> bool:
    """Elementwise with broadcasting: aten's ``pointwise`` tag, plus copies and casts."""
    return op in _POINTWISE_EXTRA or (isinstance(op, OpOverload) and torch.Tag.pointwise in op.tags)


# Ops whose values do not depend on their tensor inputs, only on shapes and scalars.
CONSTANT_LIKE = (aten.zeros_like.default, aten.ones_like.default, aten.full_like.default,
                 aten.empty_like.default, aten.fill.Scalar, aten.new_zeros.default,
                 aten.new_ones.default, aten.new_empty.default, aten.new_full.default)

REDUCTIONS = {aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default, aten.amax.default,
              aten.amin.default, aten.max.dim, aten.min.dim, aten.argmax.default, aten.argmin.default,
              aten.var.correction, aten.std.correction, aten.logsumexp.default, aten.prod.dim_int,
              aten.any.dim, aten.all.dim, aten.var_mean.correction, aten.max.default, aten.min.default}


def reduced_dims(node: fx.Node) -> tuple[list[int], bool]:
    """For a reduction in ``REDUCTIONS``: the dims it removes, and whether it keeps them as size 1."""
    rank = val(node.args[0]).dim()
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if isinstance(dims, int):
        dims = [dims]
    dims = list(range(rank)) if not dims else [norm_dim(d, rank) for d in dims]
    keepdim = node.args[2] if len(node.args) > 2 and isinstance(node.args[2], bool) else node.kwargs.get("keepdim", False)
    return dims, keepdim


def eliminate_dead_code(graph: fx.Graph) -> None:
    """``graph.eliminate_dead_code()``, asking only nodes without users whether they are impure:
    the same nodes go, and torch's purity check (a schema lookup per node) is skipped for the
    nodes that stay anyway."""
    graph.eliminate_dead_code(is_impure_node=lambda node: bool(node.users) or node.is_impure())


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
        if op is aten.einsum.default and not fake_kwargs:
            node.meta["val"] = self._einsum_val(*fake_args)
        else:
            with self.fake_mode:
                node.meta["val"] = op(*fake_args, **fake_kwargs)
        node.meta["partitioner_tag"] = "is_backward"
        return node

    def _einsum_val(self, equation: str, operands: list) -> torch.Tensor:
        """The einsum's output on the meta device (its C++ decomposition, on meta kernels), made
        a fake tensor of the same shape, strides, dtype and device: the same value as running
        it under the fake mode, about 7x faster (the fake mode dispatches each op of the
        decomposition in Python, and the per-sample and clipping passes emit one einsum per
        parameter). An einsum's output never aliases its operands."""
        meta = torch.einsum(equation, [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
                                       for t in operands])
        with self.fake_mode:
            return torch.empty_strided(meta.shape, meta.stride(), dtype=meta.dtype, device=operands[0].device)
