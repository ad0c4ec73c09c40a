"""The ``per_sample`` pass: rewrite every trainable parameter's gradient into per-sample form.

Rewrites: the backward ops that reduce a weight gradient over the batch (found by the
``batch_dims`` tags, matched on aten ops through views) into ops that keep the batch:

- ``mm(t(grad2d), act2d)`` over folded (B*T) rows -> ``einsum("btp,btd->bpd")`` on the
  un-folded (B, T, ·) tensors (linear weights, either orientation);
- ``sum`` over the batch (biases, RMSNorm weights) -> the same sum over T only;
- ``native_layer_norm_backward`` weight/bias -> sums over T of ``grad * x_hat`` / ``grad``;
- ``embedding_dense_backward`` -> sparse rows: token ids (B, n) and gradient rows (B, n, H),
  so no (B, V, H) tensor is made for a large vocabulary;
- the ops between such a reduction and the parameter's gradient output (views,
  transposes, casts, the ``add`` that sums tied-weight contributions) are applied
  per sample, so a tied embedding gets both contributions of each sample.

Assumes: ``batch_dims`` has tagged the graph.

Guarantees: every trainable parameter's placeholder has ``meta[PER_SAMPLE_GRAD]`` (a
``PerSampleGrad``) and ``meta[PER_SAMPLE_RULE]`` (the rules that formed it); the graph returns ``(per_sample_loss, *dense per-sample grads)`` with shapes
(B, *param.shape) whose sum over B equals the original gradient. A gradient reached
through an op no rule knows raises ``UnsupportedModelError`` naming the parameter, the op
and the way out. Users add rules with ``longshield_fx.per_sample_rule(op)``.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..errors import UnsupportedModelError
from ._context import PER_SAMPLE_GRAD, PER_SAMPLE_RULE, PassContext
from ._graph import GraphBuilder, is_pointwise, module_of, permutation, val
from .batch_dims import BatchDim, batch_dim

aten = torch.ops.aten


@dataclass
class PerSampleGrad:
    """One parameter's per-sample gradient as graph nodes.

    Sample b's gradient is ``dense[b]`` plus, for each ``(indices, values)`` in ``rows``,
    ``values[b, j]`` added to row ``indices[b, j]``. ``dense`` is (B, *shape) or None;
    ``indices`` is (B, n) int64 and ``values`` (B, n, *shape[1:]).
    """

    shape: tuple
    dense: fx.Node | None = None
    rows: tuple = ()


class Rewriter:
    """What a per-sample rule gets: graph building, batch geometry, and recursion."""

    def __init__(self, gm: fx.GraphModule, ctx: PassContext):
        self.graph = gm.graph
        self.B = ctx.batch_size
        self.call = GraphBuilder(gm.graph, ctx.captured.fake_mode)
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
        outer, self.rules = self.rules, set()
        with self.graph.inserting_before(node):
            out = rule(self, node)
        self.rules.add(getattr(rule, "rule_name", rule.__name__.strip("_")))
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
        if not g.rows:
            return g.dense
        V, row = g.shape[0], list(g.shape[1:])
        B = self.B
        dtype = val(g.rows[0][1]).dtype
        flat = self.call(aten.zeros.default, [B * V, *row], dtype=dtype, device=val(g.rows[0][1]).device)
        offsets = self.call(aten.mul.Tensor, self.call(aten.arange.default, B, device=val(g.rows[0][0]).device), V)
        for indices, values in g.rows:
            n = val(indices).shape[1]
            idx = self.call(aten.add.Tensor, indices, self.call(aten.unsqueeze.default, offsets, 1))
            flat = self.call(aten.index_add.default, flat, 0, self.call(aten.view.default, idx, [B * n]),
                             self.call(aten.view.default, values, [B * n, *row]))
        out = self.call(aten.view.default, flat, [B, V, *row])
        return out if g.dense is None else self.call(aten.add.Tensor, g.dense, out)


def _batch_derived(graph: fx.Graph) -> set[fx.Node]:
    derived = set()
    for node in graph.nodes:
        if batch_dim(node) is not None:
            derived.add(node)
        else:
            if any(i in derived for i in node.all_input_nodes):
                derived.add(node)
    return derived


# ---------------------------------------------------------------------------------------
_RULES: dict = {}


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


def _contraction(labels_a: str, labels_b: str, labels_out: str):
    """The rule for a matmul whose contracted dim ``k`` holds the folded batch (B*T rows):
    the same contraction as an einsum that keeps ``b``. ``mm`` is "mk,kn->mn"; ``bmm`` with
    a leading group dim (grouped linear layers) "gmk,gkn->gmn"."""

    def rule(rw: Rewriter, node: fx.Node) -> PerSampleGrad:
        a, b = node.args
        if batch_dim(a) is None and batch_dim(b) is None:  # a piece already reduced upstream
            if a in rw.batch_derived and b not in rw.batch_derived:
                return _dense(rw, node, rw.call(aten.matmul.default, _input_rep(rw, node, a), b))
            if b in rw.batch_derived and a not in rw.batch_derived:
                return _dense(rw, node, rw.call(aten.matmul.default, a, _input_rep(rw, node, b)))
            raise UnsupportedModelError(f"parameter {rw.param!r}: product of two gradient pieces at {node.name}")
        operands = [_contracted_operand(rw, node, x, labels) for x, labels in ((a, labels_a), (b, labels_b))]
        (xa, la), (xb, lb) = operands
        return _dense(rw, node, rw.call(aten.einsum.default, f"{la},{lb}->b{labels_out}", [xa, xb]))

    return rule


def _contracted_operand(rw: Rewriter, node: fx.Node, x: fx.Node, labels: str) -> tuple[fx.Node, str]:
    """``x`` unfolded to (B, ...) with its einsum labels; looks through a transpose of a tagged tensor."""
    if x.target in (aten.t.default, aten.transpose.int, aten.permute.default) and batch_dim(x.args[0]) is not None:
        perm = permutation(x)
        x, labels = x.args[0], "".join(labels[perm.index(j)] for j in range(len(labels)))
    tag = batch_dim(x)
    if tag is None:
        raise UnsupportedModelError(f"parameter {rw.param!r}: {node.name} contracts per-sample data with shared data")
    if labels[tag.dim] != "k":
        raise UnsupportedModelError(f"parameter {rw.param!r}: {node.name} keeps the batch in an output dim")
    xu, _ = rw.unfold(x)
    return xu, "b" + labels[: tag.dim] + ("t" if tag.inner != 1 else "") + labels[tag.dim + 1:]


per_sample_rule(aten.mm.default, name="linear")(_contraction("mk", "kn", "mn"))
per_sample_rule(aten.bmm.default, name="grouped_linear")(_contraction("gmk", "gkn", "gmn"))


@per_sample_rule(aten.sum.dim_IntList, aten.sum.default, name="sum")
def _sum(rw: Rewriter, node: fx.Node) -> PerSampleGrad:
    x = node.args[0]
    rank = val(x).dim()
    dims = node.args[1] if len(node.args) > 1 and node.args[1] else list(range(rank))
    dims = [d % rank for d in dims] if rank else []
    out_shape = list(val(node).shape)
    if batch_dim(x) is not None:
        if batch_dim(x).dim not in dims:
            raise UnsupportedModelError(f"parameter {rw.param!r}: {node.name} keeps the batch dimension")
        return _dense(rw, node, rw.per_sample_sum(x, dims, out_shape))
    keepdim = len(node.args) > 2 and node.args[2]
    y = rw.call(aten.sum.dim_IntList, _input_rep(rw, node, x), [d + 1 for d in dims], keepdim)
    return _dense(rw, node, y)


@per_sample_rule((aten.native_layer_norm_backward.default, 1), (aten.native_layer_norm_backward.default, 2),
                 name="layer_norm")
def _layer_norm(rw: Rewriter, node: fx.Node) -> PerSampleGrad:
    grad_out, x, normalized_shape, mean, rstd = node.args[0].args[:5]
    lead = list(range(val(x).dim() - len(normalized_shape)))
    if node.args[1] == 1:  # weight: sum over leading dims of grad * x_hat
        x_hat = rw.call(aten.mul.Tensor, rw.call(aten.sub.Tensor, x, mean), rstd)
        x_hat.meta["batch_dim"] = batch_dim(x)
        piece = rw.call(aten.mul.Tensor, grad_out, x_hat)
        piece.meta["batch_dim"] = batch_dim(x)
    else:
        piece = grad_out
    return _dense(rw, node, rw.per_sample_sum(piece, lead, list(val(node).shape)))


@per_sample_rule(aten.embedding_dense_backward.default, name="embedding")
def _embedding(rw: Rewriter, node: fx.Node) -> PerSampleGrad:
    grad, indices, num_weights, padding_idx, scale_grad_by_freq = node.args
    if scale_grad_by_freq:
        raise UnsupportedModelError(
            f"parameter {rw.param!r}: embedding with scale_grad_by_freq=True scales by in-batch counts, "
            "which mixes samples. Way out: scale_grad_by_freq=False.")
    B = rw.B
    H = val(node).shape[1]
    if batch_dim(grad) is not None:
        values, _ = rw.unfold(grad)
    else:
        values = _input_rep(rw, node, grad)
    n = val(values).numel() // (B * H)
    values = rw.rows(values, [B, n, H])
    if batch_dim(indices) is not None:
        ids, _ = rw.unfold(indices)
        ids = rw.rows(ids, [B, n])
    elif val(indices).numel() == B * n:  # ids shared by the samples but laid out per row (OPT's positions)
        ids = rw.call(aten.reshape.default, indices, [B, n])
    else:
        ids = rw.call(aten.expand.default, rw.call(aten.view.default, indices, [1, n]), [B, n])
    if padding_idx is not None and padding_idx >= 0:
        is_pad = rw.call(aten.unsqueeze.default, rw.call(aten.eq.Scalar, ids, padding_idx), 2)
        values = rw.call(aten.mul.Tensor, values, rw.call(aten.logical_not.default, is_pad))
    return PerSampleGrad(tuple(val(node).shape), None, ((ids, values),))


_ZEROS = {aten.zeros.default, aten.new_zeros.default, aten.zeros_like.default}


@per_sample_rule(aten.index_put.default, aten._index_put_impl.default, name="indexed_rows")
def _index_put(rw: Rewriter, node: fx.Node) -> PerSampleGrad:
    """A table read at per-sample indices (``w[ids]``, e.g. MoE expert weights): its gradient
    adds each read's gradient into the row it read, kept as sparse rows per sample."""
    table, indices, values = node.args[:3]
    accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
    ids = indices[0] if len(indices) == 1 else None
    if not accumulate or ids is None or batch_dim(ids) is None or batch_dim(values) is None:
        raise UnsupportedModelError(
            f"parameter {rw.param!r}: {node.name} writes into the gradient other than by adding rows at "
            "per-sample indices; no per-sample rule covers it. Way out: freeze the parameter.")
    if table.target in _ZEROS:
        base = PerSampleGrad(tuple(val(node).shape))
    elif table in rw.batch_derived:
        base = rw.rep(table)
    else:
        raise UnsupportedModelError(f"parameter {rw.param!r}: {node.name} adds rows into a constant table")
    ids_u, _ = rw.unfold(ids)
    values_u, _ = rw.unfold(values)
    n = val(ids_u).numel() // rw.B
    rows = (rw.rows(ids_u, [rw.B, n]), rw.rows(values_u, [rw.B, n, *val(node).shape[1:]]))
    return rw.add(base, PerSampleGrad(tuple(val(node).shape), None, (rows,)))


@per_sample_rule((aten.convolution_backward.default, 1), (aten.convolution_backward.default, 2), name="conv")
def _conv(rw: Rewriter, node: fx.Node) -> PerSampleGrad:
    """Per-sample conv weight gradients as ONE grouped convolution_backward: the batch folded
    into the channels (B*groups groups), so sample b's input only meets its own output grad.
    Bias: the output gradient summed over positions."""
    conv = node.args[0]
    grad, x, weight, _, stride, padding, dilation, transposed, output_padding, groups = conv.args[:10]
    B = rw.B
    if transposed or batch_dim(grad) != BatchDim(0, 1) or batch_dim(x) != BatchDim(0, 1):
        raise UnsupportedModelError(
            f"parameter {rw.param!r}: no per-sample rule for a transposed convolution or one over a "
            f"folded batch ({conv.name}). Way out: freeze the parameter.")
    if node.args[1] == 2:
        return _dense(rw, node, rw.call(aten.sum.dim_IntList, grad, list(range(2, val(grad).dim()))))
    w_shape = list(val(weight).shape)
    folded = [rw.call(aten.reshape.default, t, [1, B * val(t).shape[1], *val(t).shape[2:]]) for t in (grad, x)]
    weights = rw.call(aten.repeat.default, weight, [B] + [1] * (len(w_shape) - 1))
    both = rw.call(aten.convolution_backward.default, *folded, weights, None, stride, padding, dilation,
                   False, output_padding, B * groups, [False, True, False])
    per_sample = rw.call(operator.getitem, both, 1)
    return _dense(rw, node, rw.view(per_sample, [B, *w_shape]))


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


@per_sample_rule(aten.view.default, aten._unsafe_view.default, aten.reshape.default, name="view")
def _view(rw: Rewriter, node: fx.Node) -> PerSampleGrad:
    g = rw.rep(node.args[0])
    shape = list(val(node).shape)
    if g.rows and list(g.shape) == shape:
        return g
    return _dense(rw, node, rw.view(rw.densify(g), [rw.B, *shape]))


@per_sample_rule(aten.t.default, aten.transpose.int, aten.permute.default, name="transpose")
def _transpose(rw: Rewriter, node: fx.Node) -> PerSampleGrad:
    x = rw.densify(rw.rep(node.args[0]))
    return _dense(rw, node, rw.permute(x, [0] + [p + 1 for p in permutation(node)]))


@per_sample_rule(aten.add.Tensor, name="add")
def _add(rw: Rewriter, node: fx.Node) -> PerSampleGrad:
    a, b = node.args[:2]
    if len(node.args) > 2 or node.kwargs.get("alpha", 1) != 1:
        raise UnsupportedModelError(f"parameter {rw.param!r}: add with alpha at {node.name}")
    return rw.add(rw.rep(a), rw.rep(b))


@per_sample_rule(aten.mul.Tensor, aten.div.Tensor, aten.mul.Scalar, aten.div.Scalar, name="scale")
def _scale(rw: Rewriter, node: fx.Node) -> PerSampleGrad:
    a, b = node.args[:2]
    if isinstance(b, fx.Node) and b in rw.batch_derived:
        if node.target in (aten.div.Tensor, aten.div.Scalar) or a in rw.batch_derived:
            raise UnsupportedModelError(f"parameter {rw.param!r}: {node.name} divides/multiplies gradient pieces")
        a, b = b, a
    if isinstance(b, fx.Node) and val(b) is not None and val(b).dim() > 0:
        x = rw.densify(rw.rep(a))
        return _dense(rw, node, rw.call(node.target, x, b))
    g = rw.rep(a)
    dense = rw.call(node.target, g.dense, b) if g.dense is not None else None
    rows = tuple((i, rw.call(node.target, v, b)) for i, v in g.rows)
    return PerSampleGrad(g.shape, dense, rows)


@per_sample_rule(aten.neg.default, name="scale")
def _neg(rw: Rewriter, node: fx.Node) -> PerSampleGrad:
    g = rw.rep(node.args[0])
    dense = rw.call(aten.neg.default, g.dense) if g.dense is not None else None
    return PerSampleGrad(g.shape, dense, tuple((i, rw.call(aten.neg.default, v)) for i, v in g.rows))


@per_sample_rule(aten._to_copy.default, aten.clone.default, aten.detach.default, aten.alias.default,
                 name="cast")
def _cast(rw: Rewriter, node: fx.Node) -> PerSampleGrad:
    g = rw.rep(node.args[0])
    dense = rw.call(node.target, g.dense, *node.args[1:], **node.kwargs) if g.dense is not None else None
    rows = tuple((i, rw.call(node.target, v, *node.args[1:], **node.kwargs)) for i, v in g.rows)
    return PerSampleGrad(g.shape, dense, rows)


@per_sample_rule(aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, name="view")
def _squeeze(rw: Rewriter, node: fx.Node) -> PerSampleGrad:
    x = rw.densify(rw.rep(node.args[0]))
    return _dense(rw, node, rw.view(x, [rw.B, *val(node).shape]))


@per_sample_rule(aten.cat.default, aten.stack.default, name="view")
def _cat(rw: Rewriter, node: fx.Node) -> PerSampleGrad:
    """Pieces of a parameter's gradient laid side by side (hyper-connection weights)."""
    pieces = node.args[0]
    if not all(p in rw.batch_derived for p in pieces):
        raise UnsupportedModelError(f"parameter {rw.param!r}: {node.name} joins gradient pieces with constants")
    dim = node.args[1] if len(node.args) > 1 else 0
    dense = [rw.densify(rw.rep(p)) for p in pieces]
    return _dense(rw, node, rw.call(node.target, dense, dim % val(node).dim() + 1))


@per_sample_rule(aten.slice.Tensor, aten.select.int, name="view")
def _slice(rw: Rewriter, node: fx.Node) -> PerSampleGrad:
    x = rw.densify(rw.rep(node.args[0]))
    dim = node.args[1] % val(node.args[0]).dim() if len(node.args) > 1 else 0
    return _dense(rw, node, rw.call(node.target, x, dim + 1, *node.args[2:]))


@per_sample_rule(aten.slice_backward.default, aten.select_backward.default, name="view")
def _slice_backward(rw: Rewriter, node: fx.Node) -> PerSampleGrad:
    """A parameter used through a slice or an index: its gradient zero-padded back to size."""
    grad, sizes, dim, *rest = node.args
    x = rw.densify(rw.rep(grad))
    return _dense(rw, node, rw.call(node.target, x, [rw.B, *sizes], dim % len(sizes) + 1, *rest))


@per_sample_rule(aten.expand.default, name="view")
def _expand(rw: Rewriter, node: fx.Node) -> PerSampleGrad:
    """A parameter broadcast in the forward (e.g. ``w.sum()`` used by every sample)."""
    x = rw.densify(rw.rep(node.args[0]))
    lead = [rw.B] + [1] * (val(node).dim() - val(node.args[0]).dim())
    x = rw.view(x, lead + list(val(node.args[0]).shape))
    return _dense(rw, node, rw.call(aten.expand.default, x, [rw.B, *val(node).shape]))


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
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm
