"""The ``per_sample`` pass: rewrite every trainable parameter's gradient into per-sample form.

Rewrites: the backward ops that reduce a weight gradient over the batch (found by the
``batch_dims`` tags, matched on aten ops through views) into ops that keep the batch:

- ``mm(t(grad2d), act2d)`` over folded (B*T) rows -> ``einsum("btp,btd->bpd")`` on the
  un-folded (B, T, ·) tensors (linear weights, either orientation); rows tiled in blocks
  (a (T, B) layout folded into T*B rows) are regrouped per sample first, and an operand
  that holds no sample (a linear layer applied to a constant) is paired row by row;
- ``sum`` over the batch (biases, RMSNorm weights) -> the same sum over T only;
- ``native_layer_norm_backward`` weight/bias -> sums over T of ``grad * x_hat`` / ``grad``;
- ``embedding_dense_backward`` -> sparse rows: token ids (B, n) and gradient rows (B, n, H),
  so no (B, V, H) tensor is made for a large vocabulary; ``index_put`` into a table read at
  per-token indices (MoE expert weights ``w[expert_ids]``, or positions shared by the samples
  and laid out per row) the same way;
- ``bmm`` over groups (grouped linear) -> an einsum that keeps the batch; a convolution's
  weight gradient -> one grouped ``convolution_backward`` with the batch folded into groups;
- the ops between such a reduction and the parameter's gradient output (views,
  transposes, casts, slices, cat, the ``add`` that sums tied-weight contributions, and the
  elementwise ``*_backward(grad_output, ...)`` of an activation a parameter passes through)
  are applied per sample, so a tied embedding gets both contributions of each sample.
The rules are in ``per_sample_rules``; this module has the machinery and the pass.

Packed documents (``ctx.packed_units`` = U): rows hold several documents and a document may
span rows, so the samples are the U unit slots named per token by the last input, ``units``
(B, T), and slot U takes the padding tokens. A per-sample reduction over the batch becomes a
sum over each unit's tokens (``packed_tokens.Packing``): linear weights as each unit's product over
its own token rows (``longshield::segment_outer``), sums (biases, norm weights) as an index_add by
unit, embeddings as sparse rows with an owner per row, ``(ids, values, owner)``. The per-sample
gradients then have U + 1 rows; the last, the padding slot, is never counted (``clip``).

Assumes: ``batch_dims`` has tagged the graph; a trainable parameter the loss never reaches
has a ``zeros_like`` gradient (``capture`` puts it there) and gets zero per-sample gradients.

Guarantees: every trainable parameter's placeholder has ``meta[PER_SAMPLE_GRAD]`` (a
``PerSampleGrad``) and ``meta[PER_SAMPLE_RULE]`` (the rules that formed it); the graph
returns ``(per_sample_loss, *dense per-sample grads)`` with shapes
(B, *param.shape) whose sum over B equals the original gradient. A gradient reached
through an op no rule knows raises ``UnsupportedModelError`` naming the parameter, the op
and the way out. Users add rules with ``longshield_fx.per_sample_rule(op)``.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from .. import ops  # noqa: F401  (registers longshield::segment_outer)
from ..errors import UnsupportedModelError
from ._context import PER_SAMPLE_GRAD, PER_SAMPLE_RULE, PassContext
from ._graph import CONSTANT_LIKE, GraphBuilder, eliminate_dead_code, is_pointwise, module_of, val
from .batch_dims import BatchDim, batch_dim
from .packed_tokens import Packing

aten = torch.ops.aten


@dataclass
class PerSampleGrad:
    """One parameter's per-sample gradient as graph nodes.

    Sample b's gradient is ``dense[b]`` plus, for each ``(indices, values)`` in ``rows``,
    ``values[b, j]`` added to row ``indices[b, j]``, plus ``L[b]ᵀ R[b]`` for ``outer = (L, R)``.
    With packed documents a ``rows`` entry is ``(indices, values, owner)``: indices (n,),
    values (n, *shape[1:]) and owner (n,), the unit slot each row belongs to.
    ``dense`` is (B, *shape) or None; ``indices`` is (B, n) int64 and ``values``
    (B, n, *shape[1:]); ``L`` is (B, T, shape[0]) and ``R`` (B, T, shape[1]) (the
    ``ghost_norm`` pass makes this form; ``clip`` never densifies it); packed, ``L`` (N, shape[0])
    and ``R`` (N, shape[1]) are the N token rows in the batch's order (``Packing.unit`` names
    each one's slot).
    """

    shape: tuple
    dense: fx.Node | None = None
    rows: tuple = ()
    outer: tuple | None = None

    @property
    def nodes(self) -> list[fx.Node]:
        """Every graph node this gradient is made of."""
        return ([self.dense] if self.dense is not None else []) + [n for pair in self.rows for n in pair] \
            + list(self.outer or ())

    @property
    def only_outer(self) -> bool:
        """True for the ``ghost_norm`` form alone: ``L[b]ᵀ R[b]``, nothing dense or in rows."""
        return bool(self.outer) and self.dense is None and not self.rows


class Rewriter:
    """What a per-sample rule gets: graph building, batch geometry, and recursion."""

    def __init__(self, gm: fx.GraphModule, ctx: PassContext):
        self.graph = gm.graph
        self.call = GraphBuilder(gm.graph, ctx.captured.fake_mode)
        self.packing = Packing.of(gm, ctx, self.call) if ctx.packed_units else None
        self.B = ctx.packed_units + 1 if self.packing else ctx.batch_size
        self._memo: dict[fx.Node, tuple[PerSampleGrad, set[str]]] = {}  # piece -> (its form, rules used)
        self.param = ""
        self.rules: set[str] = set()
        self.batch_derived = _batch_derived(gm.graph)

    # --- geometry -------------------------------------------------------------------
    def view(self, x: fx.Node, shape) -> fx.Node:
        """view, skipping no-op views and collapsing a view of a view we made."""
        if list(val(x).shape) == list(shape):
            return x
        if x.target == aten.view.default and x.meta.get("per_sample"):
            x = x.args[0]
        out = self.call(aten.view.default, x, list(shape))
        out.meta["per_sample"] = True
        return out

    def rows(self, x: fx.Node, shape) -> fx.Node:
        """``x`` as contiguous sparse-row ids or values of ``shape`` (later flattened by views)."""
        if not val(x).is_contiguous():
            x = self.call(aten.clone.default, x, memory_format=torch.contiguous_format)
        return x if list(val(x).shape) == list(shape) else self.call(aten.view.default, x, list(shape))

    def permute(self, x: fx.Node, perm) -> fx.Node:
        """permute, composing with a permute we made and skipping the identity."""
        if x.target == aten.permute.default and x.meta.get("per_sample"):
            x, perm = x.args[0], [x.args[1][p] for p in perm]
        if list(perm) == list(range(len(perm))):
            return x
        out = self.call(aten.permute.default, x, list(perm))
        out.meta["per_sample"] = True
        return out

    def unfold(self, node: fx.Node) -> tuple[fx.Node, list]:
        """View a batched node with the batch as a new leading dimension.

        Returns ``(node_u, axis_of)``: ``node_u`` has shape (B, *dims before the batch dim,
        [inner], *dims after) and ``axis_of[e]`` is where original dim e went (None for the
        batch dim when each sample owns one row). Looks through a view whose input
        already has that shape, so ``view(g3d, (B*T, p))`` unfolds back to ``g3d``.
        """
        tag: BatchDim = batch_dim(node)
        if self.packing:
            raise self.packing.unsupported(self.param, node)
        if tag.outer != 1:  # a sample's rows recur in every block: no (B, ...) view collects them
            raise UnsupportedModelError(
                f"parameter {self.param!r}: its gradient reduces {node.name} ({node.target}, from "
                f"{module_of(node)}), whose batch rows are tiled in {tag.outer} blocks ({tag}); no per-sample "
                "rule covers that. Way out: freeze the parameter or register a rule with "
                "longshield_fx.per_sample_rule.")
        shape = list(val(node).shape)
        d, inner = tag.dim, tag.inner
        new_shape = shape[:d] + ([inner] if inner != 1 else []) + shape[d + 1:]
        axis_of = [e + 1 for e in range(d)] + ([d + 1] if inner != 1 else [None]) + \
                  [e + (1 if inner != 1 else 0) for e in range(d + 1, len(shape))]
        # (B, *rest) in row-major order only when the batch leads; else view then move.
        split = shape[:d] + [self.B] + ([inner] if inner != 1 else []) + shape[d + 1:]
        source = node
        if node.target in (aten.view.default, aten._unsafe_view.default, aten.reshape.default) \
                and list(val(node.args[0]).shape) == split:
            source = node.args[0]
        x = source if list(val(source).shape) == split else self.call(aten.view.default, node, split)
        if d != 0:
            x = self.call(aten.movedim.int, x, d, 0)
        assert list(val(x).shape) == [self.B] + new_shape
        return x, axis_of

    def per_sample_sum(self, node: fx.Node, dims, out_shape) -> fx.Node:
        """Per-sample version of ``sum(node, dims)`` where dims include the batch dim."""
        if self.packing:
            return self.packing.unit_sum(self.param, node, dims, out_shape)
        tag = batch_dim(node)
        if tag.outer != 1:  # sum each sample's copies over the blocks first: what is left is untiled
            shape, d = list(val(node).shape), tag.dim
            blocks = self.call(aten.reshape.default, node, shape[:d] + [tag.outer, self.B * tag.inner] + shape[d + 1:])
            node = self.call(aten.sum.dim_IntList, blocks, [d])
            node.meta["batch_dim"] = BatchDim(d, tag.inner)
        x, axis_of = self.unfold(node)
        rdims = [axis_of[e] for e in dims if axis_of[e] is not None]
        y = self.call(aten.sum.dim_IntList, x, rdims) if rdims else x
        return self.view(y, [self.B, *out_shape])

    # --- recursion --------------------------------------------------------------------
    def rep(self, node: fx.Node) -> PerSampleGrad:
        """The per-sample form of an unbatched, batch-derived node (a gradient piece)."""
        if node in self._memo:
            out, rules = self._memo[node]
            self.rules |= rules  # a piece shared with another parameter (a joined weight)
            return out
        if node not in self.batch_derived:
            raise UnsupportedModelError(
                f"parameter {self.param!r}: its gradient combines per-sample data with a constant at "
                f"{node.name} ({node.target}); the per-sample form is undefined. Way out: freeze the "
                "parameter or register a rule with longshield_fx.per_sample_rule.")
        key = node.target
        if key is operator.getitem:
            key = (node.args[0].target, node.args[1])
        rule = _RULES.get(key) or _RULES.get(node.target) or _linear_in_grad_output(self, node)
        if rule is None:
            op = f"output {key[1]} of {key[0]}" if isinstance(key, tuple) else str(key)
            raise UnsupportedModelError(
                f"parameter {self.param!r}: no per-sample rule for {op} (node {node.name}, "
                f"from {module_of(node)}) on the path to its gradient. Way out: freeze the parameter "
                "(requires_grad=False) or register a rule with @longshield_fx.per_sample_rule(op).")
        if self.packing and getattr(rule, "rule_name", None) not in _PACKED_RULES \
                and any(batch_dim(a) is not None for a in node.all_input_nodes):
            raise self.packing.unsupported(self.param, node)
        outer, self.rules = self.rules, set()
        with self.graph.inserting_before(node):
            out = rule(self, node)
        # A pass that formed the per-sample value itself names it (chunked_loss: "lm_head_loss").
        self.rules.add(node.meta.get("per_sample_rule") or getattr(rule, "rule_name", rule.__name__.strip("_")))
        self._memo[node] = (out, self.rules)
        self.rules = outer | self.rules
        return out

    def add(self, a: PerSampleGrad, b: PerSampleGrad) -> PerSampleGrad:
        if a.dense is None or b.dense is None:
            dense = a.dense if b.dense is None else b.dense
        else:
            dense = self.call(aten.add.Tensor, a.dense, b.dense)
        return PerSampleGrad(a.shape, dense, a.rows + b.rows)

    def densify(self, g: PerSampleGrad) -> fx.Node:
        """(B, *shape) dense form; index_add of sparse rows into a flat (B*V, ·) buffer."""
        if g.outer:
            if self.packing:  # token rows, each unit's by its slot
                outer = self.call(torch.ops.longshield.segment_outer.default, *g.outer, self.packing.unit,
                                  self.packing.counts)
            else:
                outer = self.call(aten.einsum.default, "btm,btn->bmn", list(g.outer))
            if g.dense is None and not g.rows:
                return outer
            return self.call(aten.add.Tensor, self.densify(PerSampleGrad(g.shape, g.dense, g.rows)), outer)
        if not g.rows:
            return g.dense
        V, row = g.shape[0], list(g.shape[1:])
        B = self.B
        dtype = val(g.rows[0][1]).dtype
        # Rows go straight into the dense part when there is one (a tied head's (B, V, d)): one
        # (B, V, d) buffer fewer live at once than a zeroed one added to it.
        into = g.dense is not None and val(g.dense).dtype == dtype and val(g.dense).is_contiguous() \
            and list(val(g.dense).shape) == [B, V, *row]
        flat = self.call(aten.view.default, g.dense, [B * V, *row]) if into else \
            self.call(aten.zeros.default, [B * V, *row], dtype=dtype, device=val(g.rows[0][1]).device)
        offsets = self.call(aten.mul.Tensor, self.call(aten.arange.default, B, device=val(g.rows[0][0]).device), V)
        for indices, values, *owner in g.rows:
            if owner:  # packed: flat rows, each with its unit slot
                idx = self.call(aten.add.Tensor, indices, self.call(aten.mul.Tensor, owner[0], V))
                flat = self.call(aten.index_add.default, flat, 0, idx, values)
                continue
            n = val(indices).shape[1]
            idx = self.call(aten.add.Tensor, indices, self.call(aten.unsqueeze.default, offsets, 1))
            flat = self.call(aten.index_add.default, flat, 0, self.call(aten.view.default, idx, [B * n]),
                             self.call(aten.view.default, values, [B * n, *row]))
        out = self.call(aten.view.default, flat, [B, V, *row])
        return out if g.dense is None or into else self.call(aten.add.Tensor, g.dense, out)


def _batch_derived(graph: fx.Graph) -> set[fx.Node]:
    """Nodes whose values depend on per-sample data; a constant-like op (``new_zeros``,
    ``zeros_like``) reads only its input's shape, so its output holds no sample."""
    derived = set()
    for node in graph.nodes:
        if batch_dim(node) is not None:
            derived.add(node)
        elif node.target not in CONSTANT_LIKE and any(i in derived for i in node.all_input_nodes):
            derived.add(node)
    return derived


# ---------------------------------------------------------------------------------------
_RULES: dict = {}
# The rules that reduce a batch-tagged tensor and know packed documents (``Packing``).
_PACKED_RULES = {"linear", "sum", "layer_norm", "embedding", "lm_head_loss"}


def per_sample_rule(*ops, name: str | None = None):
    """Register ``fn(rw: Rewriter, node) -> PerSampleGrad`` for gradient ops.

    Use it for a layer whose weight gradient comes from an op longshield_fx does not
    know (e.g. your own ``torch.library`` op). ``op`` may be an op overload, or
    ``(op, i)`` for output i of a multi-output op. The rule runs with the insertion point
    before ``node`` and must return the per-sample gradient of ``node``'s value.
    """

    def deco(fn):
        fn.rule_name = name or fn.__name__.strip("_")
        for op in ops:
            _RULES[op] = fn
        return fn

    return deco


def _dense(rw: Rewriter, node: fx.Node, dense: fx.Node) -> PerSampleGrad:
    return PerSampleGrad(tuple(val(node).shape), dense)


def _input_rep(rw: Rewriter, node: fx.Node, x: fx.Node) -> fx.Node:
    return rw.densify(rw.rep(x))


# --- ops between a reduction and the gradient output, applied per sample ---------------

def _linear_in_grad_output(rw: Rewriter, node: fx.Node):
    """The rule for a pointwise ``*_backward(grad_output, ...)`` op when only ``grad_output`` is
    a gradient piece: such ops are ``grad_output * f'(...)`` (the chain rule), linear in it,
    so they apply to each sample's piece as to the sum (a parameter inside an activation,
    e.g. ``softplus(alpha)``). None for any other op."""
    op = node.target
    if not (is_pointwise(op) and op._schema.arguments and op._schema.arguments[0].name == "grad_output"):
        return None
    if any(a in rw.batch_derived for a in node.all_input_nodes if a is not node.args[0]):
        return None
    return _grad_output_scaled


def _grad_output_scaled(rw: Rewriter, node: fx.Node) -> PerSampleGrad:
    x = rw.densify(rw.rep(node.args[0]))
    shape = [rw.B, *val(node).shape]
    others = [rw.call(aten.expand.default, a, shape) if isinstance(a, fx.Node) and val(a) is not None else a
              for a in node.args[1:]]
    return _dense(rw, node, rw.call(node.target, x, *others, **node.kwargs))


_grad_output_scaled.rule_name = "activation"


# ---------------------------------------------------------------------------------------

def per_sample(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Rewrite parameter gradients into per-sample form (see the module docstring)."""
    rw = Rewriter(gm, ctx)
    output = gm.graph.output_node()
    loss, *grads = output.args[0]
    dense_outputs = []
    for name, grad in zip(ctx.captured.param_names, grads):
        rw.param, rw.rules = name, set()
        if grad.target is aten.zeros_like.default and grad.args[0].op == "placeholder":  # unused (capture)
            with gm.graph.inserting_before(output):
                zeros = rw.call(aten.zeros.default, [rw.B, *val(grad).shape], dtype=val(grad).dtype,
                                device=val(grad).device)
            ctx.param_meta(name).update({PER_SAMPLE_GRAD: PerSampleGrad(tuple(val(grad).shape), zeros),
                                         PER_SAMPLE_RULE: "unused"})
            dense_outputs.append(zeros)
            continue
        if batch_dim(grad) is not None or grad not in rw.batch_derived:
            raise UnsupportedModelError(
                f"parameter {name!r}: its gradient ({grad.name}) is not a reduction over samples; "
                "longshield_fx cannot form per-sample gradients for it. Way out: freeze it.")
        g = rw.rep(grad)
        if tuple(g.shape) != tuple(val(grad).shape):
            raise AssertionError(f"per-sample shape {g.shape} != gradient shape {tuple(val(grad).shape)}")
        meta = ctx.param_meta(name)
        meta[PER_SAMPLE_GRAD] = g
        meta[PER_SAMPLE_RULE] = "+".join(sorted(rw.rules - {"view", "transpose", "cast", "add", "scale"})) or "?"
        with gm.graph.inserting_before(output):
            dense_outputs.append(rw.densify(g))
    output.args = ((loss, *dense_outputs),)
    if rw.packing:
        rw.packing.sink_rows()
    eliminate_dead_code(gm.graph)
    gm.recompile()
    return gm
