"""The ``context_parallel`` pass: attention -> ring attention over the cp group.

Rewrites: every causal fused-attention node (``_graph.FUSED_ATTENTION``: the CPU flash kernel, and the
CUDA flash / memory-efficient / cuDNN kernels) and its backward into
``longshield::ring_attention`` / ``ring_attention_backward`` (``ops/ring_attention.py``),
which pass K/V blocks around the cp ring and merge block outputs with their log-sum-exp. For GQA
the rewrite looks through the K/V head repeat (``view(clone(expand(unsqueeze(k, 2))))``) so K/V
travel with Hkv heads, and replaces the gradient's group-sum
``sum(view(dk_rep, [B, Hkv, g, T, D]), [2], keepdim=True)`` by the ring backward's dk directly.

Assumes: the graph was captured on one rank's zig-zag shard of the sequence (the engine
feeds the tokens' global positions, so RoPE is unchanged); attention is causal, either
``is_causal=True`` or a mask that depends on no sample data (Hugging Face builds its
causal mask from an all-ones attention mask, which ``ShardedCausalLMLoss`` passes). Other
attention (dropout, sample-dependent masks, attention written as matmul + softmax over the
sequence) stops with ``UnsupportedModelError``.

Guarantees: the rewritten graph computes exactly full causal attention over the global
sequence on each rank's shard; the new nodes carry ``meta["val"]`` and batch tags.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..errors import UnsupportedModelError
from .. import ops  # noqa: F401  (registers longshield::ring_attention)
from ._context import PassContext
from ._graph import FUSED_ATTENTION, GraphBuilder, module_of, val
from .batch_dims import batch_dim, register_batch_rule

aten = torch.ops.aten
ring_fwd = torch.ops.longshield.ring_attention.default
ring_bwd = torch.ops.longshield.ring_attention_backward.default
_ATTENTION_OPS = set(FUSED_ATTENTION) | set(FUSED_ATTENTION.values())
_SOFTMAX = (aten._softmax.default, aten._safe_softmax.default)


@register_batch_rule(ring_fwd)
def _ring_tag(node, B):
    return (batch_dim(node.args[0]),) * 2


@register_batch_rule(ring_bwd)
def _ring_bwd_tag(node, B):
    return (batch_dim(node.args[1]),) * 3


def context_parallel(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Rewrite causal attention into ring attention (see the module docstring)."""
    graph = gm.graph
    b = GraphBuilder(graph, ctx.captured.fake_mode)
    derived = _sample_dependent(graph)
    backward_of = {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target in FUSED_ATTENTION.values():
            backward_of[tuple(node.args[1:4])] = node
    for fwd in [n for n in graph.nodes if n.op == "call_function" and n.target in FUSED_ATTENTION]:
        q, k_rep, v_rep = fwd.args[:3]
        dropout = _arg(fwd, "dropout_p", 0.0)
        is_causal = _arg(fwd, "is_causal", False)
        mask = _arg(fwd, "attn_mask") or _arg(fwd, "attn_bias")
        where = f"{fwd.name} in {module_of(fwd)}"
        if dropout:
            raise UnsupportedModelError(f"context_parallel: attention dropout at {where} is not supported; set it to 0")
        if not is_causal and (mask is None or mask in derived):
            raise UnsupportedModelError(
                f"context_parallel: attention at {where} is not causal (or its mask depends on the samples); "
                "ring attention here supports causal language-model attention only")
        scale = _arg(fwd, "scale") or val(q).shape[-1] ** -0.5
        k, k_group_sum = _unrepeat(k_rep)
        v, v_group_sum = _unrepeat(v_rep)
        bwd = backward_of.get((q, k_rep, v_rep))
        with graph.inserting_before(fwd):
            ring = b(ring_fwd, q, k, v, scale, ctx.cp_group_name, ctx.cp_size)
            out, lse = b(operator.getitem, ring, 0), b(operator.getitem, ring, 1)
        for node in (ring, out, lse):
            node.meta["batch_dim"] = (batch_dim(q),) * 2 if node is ring else batch_dim(q)
            node.meta["partitioner_tag"] = "is_forward"
            node.meta["nn_module_stack"] = fwd.meta.get("nn_module_stack")
        _replace_getitems(fwd, {0: out, 1: lse})
        if bwd is None:
            continue
        with graph.inserting_before(bwd):
            grads = b(ring_bwd, bwd.args[0], q, k, v, out, lse, scale, ctx.cp_group_name, ctx.cp_size)
        _replace_backward(b, bwd, grads, batch_dim(q), grouped=(k_group_sum is not None, v_group_sum is not None))
    graph.eliminate_dead_code()
    # fx keeps attention kernels it thinks random (dropout argument) even when unused, and the
    # CUDA kernels' RNG outputs keep a forward alive until its backward is gone: erase by hand,
    # backwards first.
    for node in reversed(list(graph.nodes)):
        if node.op == "call_function" and node.target in _ATTENTION_OPS:
            _replace_getitems(node, {})
    graph.eliminate_dead_code()
    _refuse_unrewritten_attention(graph)
    gm.recompile()
    return gm


def _replace_backward(b: GraphBuilder, bwd: fx.Node, grads: fx.Node, tag, grouped: tuple[bool, bool]) -> None:
    """Route the users of ``bwd``'s (dq, dk, dv) to the ring backward's. Under GQA the graph
    sums dk/dv over the repeated heads' group; the ring backward's dk/dv already have Hkv
    heads, so that group-sum is replaced by them (unsqueezed to its keepdim shape)."""
    graph = bwd.graph
    with graph.inserting_before(bwd):
        dq, dk, dv = (b(operator.getitem, grads, i) for i in range(3))
        for node in (dq, dk, dv):
            node.meta["batch_dim"] = tag
        grads.meta["batch_dim"] = (tag,) * 3
    replacements = {0: dq}
    for i, grad, group_summed in ((1, dk, grouped[0]), (2, dv, grouped[1])):
        if not group_summed:
            replacements[i] = grad
            continue
        getitem = next(u for u in bwd.users if u.args[1] == i)
        sum_node = _group_sum_of(getitem)
        with graph.inserting_before(sum_node):
            kept = b(aten.unsqueeze.default, grad, 2)
        kept.meta["batch_dim"] = batch_dim(sum_node)
        sum_node.replace_all_uses_with(kept)
    _replace_getitems(bwd, replacements)


def _refuse_unrewritten_attention(graph: fx.Graph) -> None:
    local_len = _local_sequence_length(graph)
    for node in graph.nodes:
        if node.target in _ATTENTION_OPS:
            raise UnsupportedModelError(f"context_parallel: attention node {node.name} could not be rewritten")
        if node.target in _SOFTMAX and node.meta.get("partitioner_tag") == "is_forward" \
                and val(node).shape[_arg(node, "dim")] == local_len:
            # Attention written as matmul + softmax would attend within the local shard only.
            raise UnsupportedModelError(
                f"context_parallel: softmax over the (sharded) sequence at {node.name} in {module_of(node)}: "
                "attention written by hand cannot be split over the context; use "
                "torch.nn.functional.scaled_dot_product_attention (Hugging Face: attn_implementation='sdpa')")


def _arg(node: fx.Node, name: str, default=None):
    """Argument ``name`` of an aten call, by its schema (positional, keyword or default)."""
    for i, arg in enumerate(node.target._schema.arguments):
        if arg.name != name:
            continue
        if not arg.kwarg_only and i < len(node.args):
            return node.args[i]
        return node.kwargs.get(name, arg.default_value if arg.has_default_value() else default)
    return default


def _local_sequence_length(graph: fx.Graph) -> int | None:
    """This rank's sequence length: dimension 1 of the first per-sample (B, T) input."""
    for ph in graph.find_nodes(op="placeholder"):
        if ph.meta.get("batch_dim") is not None and val(ph).dim() >= 2:
            return val(ph).shape[1]
    return None


def _unrepeat(x: fx.Node):
    """(k, True) if x = view(clone(expand(unsqueeze(k, 2)))) repeats heads, else (x, None)."""
    node = x
    if node.target in (aten.view.default, aten._unsafe_view.default, aten.reshape.default):
        inner = node.args[0]
        if inner.target == aten.clone.default:
            inner = inner.args[0]
        if inner.target == aten.expand.default and inner.args[0].target == aten.unsqueeze.default \
                and inner.args[0].args[1] == 2:
            return inner.args[0].args[0], True
    return x, None


def _group_sum_of(grad_rep: fx.Node) -> fx.Node:
    """The node summing a repeated-head gradient back over its group: sum(view(g), [2], True)."""
    users = list(grad_rep.users)
    if len(users) == 1 and users[0].target in (aten.view.default, aten._unsafe_view.default):
        sums = list(users[0].users)
        if len(sums) == 1 and sums[0].target == aten.sum.dim_IntList and list(sums[0].args[1]) == [2]:
            return sums[0]
    raise UnsupportedModelError(
        f"context_parallel: the gradient of repeated K/V heads ({grad_rep.name}) is not summed back over "
        "its head group in the usual way; cannot un-repeat GQA heads")


def _replace_getitems(node: fx.Node, replacements: dict) -> None:
    """Redirect ``node[i]`` users to ``replacements[i]`` and erase ``node``.

    Erased by hand: fx's dead-code elimination keeps attention ops (they take a dropout
    probability, so fx treats them as random and impure).
    """
    for user in list(node.users):
        if user.target is operator.getitem and user.args[1] in replacements:
            user.replace_all_uses_with(replacements[user.args[1]])
        if user.target is operator.getitem and not user.users:
            node.graph.erase_node(user)
    if not node.users:
        node.graph.erase_node(node)


def _sample_dependent(graph: fx.Graph) -> set:
    derived = set()
    for node in graph.nodes:
        if node.meta.get("batch_dim") is not None and node.op == "placeholder":
            # The all-ones attention mask is made from the ids' shape only (ones_like), and
            # position ids place tokens; neither is sample data for the mask's purpose.
            derived.add(node)
        elif node.op == "call_function" and node.target not in (aten.ones_like.default, aten.new_ones.default):
            if any(i in derived for i in node.all_input_nodes):
                derived.add(node)
    return derived
