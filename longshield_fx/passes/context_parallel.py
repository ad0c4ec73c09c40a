"""The ``context_parallel`` pass: attention -> ring attention over cp, or 2D attention over hp x cp.

Rewrites: every causal fused-attention node (``_graph.FUSED_ATTENTION``: the CPU flash kernel, and the
CUDA flash / memory-efficient / cuDNN kernels) and its backward into
``longshield::ring_attention`` / ``ring_attention_backward`` (``ops/ring_attention.py``),
which pass K/V blocks around the cp ring and merge block outputs with their log-sum-exp. For GQA
the rewrite looks through the K/V head repeat (``view(clone(expand(unsqueeze(k, 2))))``) so K/V
travel with Hkv heads, and replaces the gradient's group-sum
``sum(view(dk_rep, [B, Hkv, g, T, D]), [2], keepdim=True)`` by the ring backward's dk directly.

With head parallelism (hp > 1, LoongTrain's 2D attention) each rank holds one hp-th of its cp
rank's tokens; around the ring, functional ``all_to_all_single`` collectives over hp trade
heads for sequence (``_HeadAllToAll``): q, k, v go from (B, H, T/sp, D) to (B, H/hp, T/cp, D),
the ring runs over cp on H/hp heads, and the output comes back to (B, H, T/sp, D); the
backward mirrors it (grad_out forward, dq/dk/dv back). When Hkv < hp, each K/V head is
replicated hp/Hkv times before the all-to-all and the replicas' gradients are summed after
it (LoongTrain Fig. 8); when hp divides Hkv only the real heads move. Everything outside
attention is unchanged: linear layers see their T/sp tokens, and ``shard_grads`` reduces
per-sample gradients over the whole sp group.

Packed documents: the model already attends with ``longshield::ring_attention`` on one process
(cp = 1, the tokens' segment ids as its ``segments``); those nodes get the cp group, and any
other attention kernel is refused (as plain causal ring attention it would cross documents).

Assumes: the graph was captured on one rank's piece of the sequence (the engine feeds the
tokens' global positions, so RoPE is unchanged); attention is causal, either
``is_causal=True`` or a mask that depends on no sample data (Hugging Face builds its
causal mask from an all-ones attention mask, which ``ShardedCausalLMLoss`` passes). Other
attention (dropout, sample-dependent masks, attention written as matmul + softmax over the
sequence, head counts hp does not split) stops with ``UnsupportedModelError``.

Guarantees: the rewritten graph computes exactly full causal attention over the global
sequence on each rank's tokens; the new nodes carry ``meta["val"]`` and batch tags, and
the nodes that selective checkpointing keeps (the ring's inputs and the attention output
after the all-to-all) carry ``meta[KEEP_SELECTIVE]``.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .._torch import c10d
from ..errors import UnsupportedModelError
from .. import ops  # noqa: F401  (registers longshield::ring_attention)
from ._context import KEEP_SELECTIVE, PassContext
from ._graph import FUSED_ATTENTION, GraphBuilder, arg_of, eliminate_dead_code, module_of, val
from .batch_dims import BatchDim, batch_dim, register_batch_rule

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
    _ring_documents(graph, ctx)
    b = GraphBuilder(graph, ctx.captured.fake_mode)
    derived = _sample_dependent(graph)
    backward_of = {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target in FUSED_ATTENTION.values():
            backward_of[tuple(node.args[1:4])] = node
    for fwd in [n for n in graph.nodes if n.op == "call_function" and n.target in FUSED_ATTENTION]:
        q, k_rep, v_rep = fwd.args[:3]
        dropout = arg_of(fwd, "dropout_p", 0.0)
        is_causal = arg_of(fwd, "is_causal", False)
        mask = arg_of(fwd, "attn_mask") or arg_of(fwd, "attn_bias")
        where = f"{fwd.name} in {module_of(fwd)}"
        if ctx.packed_units:
            # Plain causal ring attention would attend across the documents of a row.
            raise UnsupportedModelError(
                f"context_parallel: with packed documents every attention must be the document attention "
                f"(longshield::ring_attention with segment ids), but {where} attends through {fwd.target}; "
                "way out: the reference Llama or a Hugging Face model whose attention layers call transformers' "
                "attention interface, or unpacked batches (CLI --no-pack)")
        if dropout:
            raise UnsupportedModelError(f"context_parallel: attention dropout at {where} is not supported; set it to 0")
        if not is_causal and (mask is None or mask in derived):
            raise UnsupportedModelError(
                f"context_parallel: attention at {where} is not causal (or its mask depends on the samples); "
                "ring attention here supports causal language-model attention only")
        scale = arg_of(fwd, "scale") or val(q).shape[-1] ** -0.5
        k, k_group_sum = _unrepeat(k_rep)
        v, v_group_sum = _unrepeat(v_rep)
        bwd = backward_of.get((q, k_rep, v_rep))
        tag = batch_dim(q)
        heads = _HeadAllToAll(b, ctx, fwd, val(q).shape[1], val(k).shape[1], where) if ctx.hp_size > 1 else None
        with graph.inserting_before(fwd):
            q_ring, k_ring, v_ring = (q, k, v) if heads is None else heads.forward_inputs(q, k, v)
            ring = b(ring_fwd, q_ring, k_ring, v_ring, scale, ctx.cp_group_name or "", ctx.cp_size, _inner(ctx))
            out_ring, lse_ring = b(operator.getitem, ring, 0), b(operator.getitem, ring, 1)
            for node in (ring, out_ring, lse_ring):
                node.meta["batch_dim"] = (tag,) * 2 if node is ring else tag
                _mark_forward(node, fwd)
            out = out_ring if heads is None else heads.output(out_ring)
        _replace_getitems(fwd, {0: out} if heads is not None else {0: out, 1: lse_ring})
        if bwd is None:
            continue
        with graph.inserting_before(bwd):
            grad_out = bwd.args[0] if heads is None else heads.to_sequence(bwd.args[0], tag)
            grads = b(ring_bwd, grad_out, q_ring, k_ring, v_ring, out_ring, lse_ring, scale,
                      ctx.cp_group_name or "", ctx.cp_size, _inner(ctx))
            grads.meta["batch_dim"] = (tag,) * 3
            dq, dk, dv = (b(operator.getitem, grads, i) for i in range(3))
            for node in (dq, dk, dv):
                node.meta["batch_dim"] = tag
            if heads is not None:
                dq = heads.to_heads(dq, tag)
                dk, dv = (heads.to_heads(d, tag, replicas=heads.kv_replicas) for d in (dk, dv))
        _replace_backward(b, bwd, (dq, dk, dv), grouped=(k_group_sum is not None, v_group_sum is not None))
    eliminate_dead_code(graph)
    # fx keeps attention kernels it thinks random (dropout argument) even when unused, and the
    # CUDA kernels' RNG outputs keep a forward alive until its backward is gone: erase by hand,
    # backwards first.
    for node in reversed(list(graph.nodes)):
        if node.op == "call_function" and node.target in _ATTENTION_OPS:
            _replace_getitems(node, {})
    eliminate_dead_code(graph)
    _refuse_unrewritten_attention(graph)
    gm.recompile()
    return gm


# Where (group_name, cp, inner) start in the ring ops' arguments.
_RING_GROUP_AT = {ring_fwd: 4, ring_bwd: 7}


def _ring_documents(graph: fx.Graph, ctx: PassContext) -> None:
    """Packed documents: the model attends with the ring op on one process (``cp`` = 1, with the
    tokens' segment ids); give it this rank's cp group, cp and inner ring."""
    for node in graph.nodes:
        at = _RING_GROUP_AT.get(node.target) if node.op == "call_function" else None
        if at is None or node.args[at + 1] != 1:
            continue
        if ctx.hp_size > 1:
            raise UnsupportedModelError(f"context_parallel: packed documents' attention ({node.name} in "
                                        f"{module_of(node)}) runs over cp only, not hp={ctx.hp_size}; use a mesh "
                                        "without an 'hp' dim for packed documents")
        args = list(node.args) + [0] * (at + 3 - len(node.args))
        args[at:at + 3] = [ctx.cp_group_name or "", ctx.cp_size, _inner(ctx)]
        node.args = tuple(args)


def _replace_backward(b: GraphBuilder, bwd: fx.Node, grads: tuple, grouped: tuple[bool, bool]) -> None:
    """Route the users of ``bwd``'s (dq, dk, dv) to ``grads``. Under GQA the graph sums dk/dv
    over the repeated heads' group; the ring backward's dk/dv already have Hkv heads, so that
    group-sum is replaced by them (unsqueezed to its keepdim shape)."""
    graph = bwd.graph
    dq, dk, dv = grads
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


def _inner(ctx: PassContext) -> int:
    """The ring op's ``inner`` argument: 0 for one ring (graphs then read as before)."""
    return 0 if ctx.cp_inner in (0, ctx.cp_size) else ctx.cp_inner


def _mark_forward(node: fx.Node, like: fx.Node) -> None:
    node.meta["partitioner_tag"] = "is_forward"
    node.meta["nn_module_stack"] = like.meta.get("nn_module_stack")


class _HeadAllToAll:
    """The hp all-to-alls of one attention layer (Ulysses' SeqAlltoAll): nodes built at the
    graph's insertion point, batch-tagged, forward ones marked as forward of ``fwd``.

    A (B, X, L, D) tensor is cut into hp head groups; group j goes to hp rank j, and the
    pieces received (one per hp rank, in rank order = sequence order) are joined along L.
    ``to_heads`` is the inverse and returns the flash kernels' layout (heads inner to L),
    which the graph around attention was traced with.
    """

    def __init__(self, b: GraphBuilder, ctx: PassContext, fwd: fx.Node, heads: int, kv_heads: int, where: str):
        hp = ctx.hp_size
        if heads % hp:
            raise UnsupportedModelError(f"context_parallel: {heads} attention heads at {where} cannot be split "
                                        f"over hp={hp}; pick hp dividing the head count")
        if kv_heads % hp and hp % kv_heads:
            raise UnsupportedModelError(f"context_parallel: {kv_heads} K/V heads at {where} can be neither split "
                                        f"over hp={hp} nor replicated to it; pick hp dividing or divided by "
                                        f"{kv_heads}")
        self.b, self.fwd, self.hp, self.group = b, fwd, ctx.hp_size, ctx.hp_group_name
        self.kv_replicas = 1 if kv_heads % hp == 0 else hp // kv_heads

    def forward_inputs(self, q, k, v):
        tag = batch_dim(q)
        if self.kv_replicas > 1:
            k, v = (self._replicate(x, tag) for x in (k, v))
        ring_inputs = tuple(self.to_sequence(x, tag, forward=True) for x in (q, k, v))
        for x in ring_inputs:
            x.meta[KEEP_SELECTIVE] = True
        return ring_inputs

    def output(self, out_ring):
        out = self.to_heads(out_ring, batch_dim(out_ring), forward=True)
        out.meta[KEEP_SELECTIVE] = True
        return out

    def to_sequence(self, x, tag, forward=False):
        """(B, X, L, D) -> (B, X/hp, hp*L, D)."""
        B, X, L, D = val(x).shape
        hp = self.hp
        parts = self._call(aten.view.default, [x, [B, hp, X // hp, L, D]], tag, forward)
        parts = self._call(aten.permute.default, [parts, [1, 0, 2, 3, 4]], tag.at(1), forward)
        received = self._exchange(parts, tag.at(1), forward)  # (hp, B, X/hp, L, D): row j = rank j's tokens
        joined = self._call(aten.permute.default, [received, [1, 2, 0, 3, 4]], tag, forward)
        joined = self._call(aten.clone.default, [joined], tag, forward, memory_format=torch.contiguous_format)
        return self._call(aten.view.default, [joined, [B, X // hp, hp * L, D]], tag, forward)

    def to_heads(self, y, tag, replicas=1, forward=False):
        """(B, X, hp*L, D) -> (B, hp*X / replicas, L, D) in flash layout, summing each head's
        ``replicas`` consecutive copies."""
        B, X, S, D = val(y).shape
        hp, L = self.hp, S // self.hp
        parts = self._call(aten.view.default, [y, [B, X, hp, L, D]], tag, forward)
        parts = self._call(aten.permute.default, [parts, [2, 0, 1, 3, 4]], tag.at(1), forward)
        received = self._exchange(parts, tag.at(1), forward)  # (hp, B, X, L, D): row j = head group j
        joined = self._call(aten.permute.default, [received, [1, 3, 0, 2, 4]], tag, forward)
        joined = self._call(aten.clone.default, [joined], tag, forward, memory_format=torch.contiguous_format)
        heads = self._call(aten.view.default, [joined, [B, L, hp * X, D]], tag, forward)
        if replicas > 1:
            grouped = self._call(aten.view.default, [heads, [B, L, hp * X // replicas, replicas, D]], tag, forward)
            heads = self._call(aten.sum.dim_IntList, [grouped, [3]], tag, forward)
        return self._call(aten.transpose.int, [heads, 1, 2], tag, forward)

    def _replicate(self, x, tag):
        """(B, Hkv, L, D) -> (B, Hkv*r, L, D), head h's copies consecutive (query head groups
        on hp rank j all read K/V head j*Hkv/hp)."""
        B, H, L, D = val(x).shape
        r = self.kv_replicas
        x = self._call(aten.unsqueeze.default, [x, 2], tag, True)
        x = self._call(aten.expand.default, [x, [B, H, r, L, D]], tag, True)
        x = self._call(aten.clone.default, [x], tag, True, memory_format=torch.contiguous_format)
        return self._call(aten.view.default, [x, [B, H * r, L, D]], tag, True)

    def _exchange(self, parts, tag, forward):
        parts = self._call(aten.clone.default, [parts], tag, forward, memory_format=torch.contiguous_format)
        ones = [1] * self.hp
        sent = self._call(c10d.all_to_all_single.default, [parts, ones, ones, self.group], tag, forward)
        return self._call(c10d.wait_tensor.default, [sent], tag, forward)

    def _call(self, op, args, tag: BatchDim, forward: bool, **kwargs):
        node = self.b(op, *args, **kwargs)
        node.meta["batch_dim"] = tag
        if forward:
            _mark_forward(node, self.fwd)
        return node


def _refuse_unrewritten_attention(graph: fx.Graph) -> None:
    local_len = _local_sequence_length(graph)
    for node in graph.nodes:
        if node.target in _ATTENTION_OPS:
            raise UnsupportedModelError(f"context_parallel: attention node {node.name} could not be rewritten")
        if node.target in _SOFTMAX and node.meta.get("partitioner_tag") == "is_forward" \
                and val(node).shape[arg_of(node, "dim")] == local_len:
            # Attention written as matmul + softmax would attend within the local shard only.
            if _feeds_dropout(node):  # SDPA with dropout_p > 0 runs as math attention on the CPU
                raise UnsupportedModelError(
                    f"context_parallel: attention dropout at {node.name} in {module_of(node)} is not supported "
                    "under context parallelism; set it to 0 (Hugging Face: attention_dropout / attn_pdrop in "
                    "the config), other dropout is fine")
            raise UnsupportedModelError(
                f"context_parallel: softmax over the (sharded) sequence at {node.name} in {module_of(node)}: "
                "attention written by hand cannot be split over the context; use "
                "torch.nn.functional.scaled_dot_product_attention (Hugging Face: attn_implementation='sdpa')")


def _feeds_dropout(node: fx.Node, depth: int = 3) -> bool:
    """Whether ``node`` reaches a dropout within ``depth`` ops (through casts and views)."""
    return any(u.target == torch.ops.aten.native_dropout.default or (depth > 1 and _feeds_dropout(u, depth - 1))
               for u in node.users)


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
