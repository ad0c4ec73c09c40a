"""The ``chunked_loss`` pass: the LM head and its cross-entropy over T-chunks, no (T, V) logits.

Rewrites: ``logits = mm(h, w.T)`` -> (views, slices, transposes, casts) -> ``_log_softmax``
-> (views) -> ``nll_loss[2d]_forward`` (no class weights, no reduction), and the backward of
that chain down to the two matmuls that consume the logits' gradient, into one
``longshield::lm_head_loss`` node (``ops/lm_head_loss.py``): per-position losses, the hidden
states' gradient and the head's PER-SAMPLE gradient (B, V, d), formed chunk by chunk of
``DPConfig.loss_chunk`` rows. The head's weight gradient becomes ``sum(per_sample, 0)``,
which ``per_sample`` turns back into the per-sample gradient itself, so the (B, T, V) logits,
their log-softmax and their gradient are never materialised; the op's working set is one
chunk's logits (recorded as ``meta["workspace_bytes"]`` for the memory estimate).

Packed documents (``ctx.packed_units`` = U): the samples are the U + 1 unit slots, and the
head's per-unit gradient takes one of two forms, by a cost rule (``_rows_form``):

- dense: the op sums each chunk's rows per slot into a (U+1, V, d) accumulator (``per_unit``
  meta on it: ``per_sample`` takes its rows as they are);
- rows: the op returns the logits' gradient dz (N, V), a row per position of the N = B·T
  (row-major, as ``Packing.unit`` names their slots), and the weight gradient becomes
  ``longshield::head_weight_grad(dz, h)``, whose per-sample rule (below) is the linear layers'
  packed form, ``segment_outer`` of two token-row operands. ``ghost_norm``
  and ``clip`` then treat the head as any packed linear weight (ghost norm and book-keeping on
  the two operands, or the per-unit products): there is no (U+1, V, d) accumulator to fill,
  hold and pass over, whose cost grows with U whatever the units present.

  The cost rule is memory: rows when dz and the hidden rows hold fewer values than the
  dense form, N·(V+d) < (U+1)·V·d. dz is N·V values in the compute dtype, the size of the
  whole batch's logits that the chunking otherwise never holds at once, kept from the op to
  ``clip`` as the dense form would be; so the rows form never holds more values than the dense
  one (at llama3.2-1b's shapes, N = 8k tokens and U = 32: 2 GiB of bf16 dz and 32 MiB of h
  against 32 GiB of fp32). Few slots for many tokens (U + 1 ≤ N·(V+d)/(V·d): long rows, few
  units) keep the dense form, smaller there (2 rows of 32k tokens at U = 8: 8.8 GiB against
  15.7 GiB of bf16 dz). The two forms sum the same products in another order, so across that
  crossover the head's gradients differ by float rounding; any two U above it give bitwise the
  same values. Not under cp (no ``ghost_norm`` there; ``shard_grads`` reduce-scatters the dense
  form), nor for a head tied to another weight (its per-unit gradient is then a sum with the
  other's, which ``ghost_norm`` does not split: rows would only add dz's memory).

Which position of h a loss term belongs to is found by replaying the chain between the
logits and the NLL on an index tensor (arange over h's rows, the class dim of size 1), so
any shift (``logits[:, :-1]``), transpose or reshape the loss applies is followed exactly;
positions the chain drops get ``ignore_index`` and contribute nothing.

Assumes: ``batch_dims`` ran; h's rows are the batch folded with positions (``BatchDim(0,
inner=k)``). A loss that does not match the pattern (softcapped or scaled logits, a
hand-written NLL, logits used elsewhere) is left as it is: only memory is at stake, never
privacy. Guarantees: the same values as the unrewritten graph up to float rounding of the
chunked matmuls (each position's terms are computed by the same formulas, in the same dtypes);
every new node carries ``meta["val"]`` and its batch tag (None for the head's token rows,
which are not in the batch's layout).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..config import DPConfig
from ..ops import lm_head_loss as _op
from ._context import PassContext
from ._graph import GraphBuilder, eliminate_dead_code, norm_dim, permutation, val
from .batch_dims import BatchDim, batch_dim
from .packed_tokens import Packing
from .per_sample import PerSampleGrad, Rewriter, per_sample_rule

aten = torch.ops.aten
_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
_TRANSPOSES = (aten.t.default, aten.transpose.int, aten.permute.default)
_COPIES = (aten._to_copy.default, aten.clone.default, aten.alias.default, aten.detach.default)
_NLL = {aten.nll_loss_forward.default: aten.nll_loss_backward.default,
        aten.nll_loss2d_forward.default: aten.nll_loss2d_backward.default}
_GRAD_CHAIN = _VIEWS + _TRANSPOSES + _COPIES + (aten.slice_backward.default,)


def chunked_loss(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Replace LM head + cross-entropy by the chunked op (see the module docstring)."""
    graph = gm.graph
    chunk_rows = (ctx.config or DPConfig).loss_chunk  # no config (per-sample graphs): the default
    for log_softmax in [n for n in graph.nodes if n.target == aten._log_softmax.default]:
        match = _match(log_softmax, ctx.batch_size)
        if match is not None:
            _rewrite(gm, ctx, match, chunk_rows)
    eliminate_dead_code(graph)
    gm.recompile()
    return gm


@dataclass
class _Match:
    logits: fx.Node          # mm(h2d, wt)
    chain: list              # view-like nodes from the logits to the log-softmax input, in order
    to_nll: list             # views from the log-softmax to the NLL input, in order
    nll: fx.Node
    nll_backward: fx.Node
    grad_h: fx.Node          # mm(grad_logits, w): (N, d)
    grad_w: list             # [(mm node, transposed)]: mm giving the head's gradient, (V, d) or (d, V)
    rows_per_sample: int


def _match(log_softmax: fx.Node, B: int) -> _Match | None:
    chain, x = [], log_softmax.args[0]
    while x.target in _VIEWS + _TRANSPOSES + _COPIES + (aten.slice.Tensor,):
        chain.append(x)
        x = x.args[0]
    logits, chain = x, chain[::-1]
    if logits.target != aten.mm.default or any(len(n.users) != 1 for n in [logits, *chain]):
        return None
    h2d = logits.args[0]
    tag = batch_dim(h2d)
    N, V = val(logits).shape
    if tag is None or tag.dim != 0 or tag.outer != 1 or N != B * tag.inner:
        return None
    nll, to_nll = None, []
    for user in log_softmax.users:
        if user.target == aten.detach.default:
            continue
        node, path = user, []
        while node.target in _VIEWS and len(_forward_users(node)) == 1:
            path.append(node)
            node = _forward_users(node)[0]
        if node.target not in _NLL or nll is not None:
            return None
        nll, to_nll = node, path
    if nll is None or nll.args[2] is not None or nll.args[3] != 0:
        return None
    cls = _class_dim(chain, 1)
    if cls != norm_dim(log_softmax.args[1], val(log_softmax).dim()) or _class_dim(to_nll, cls) != 1:
        return None
    backward = [u for u in nll.args[0].users if u.target == _NLL[nll.target]]
    if len(backward) != 1 or backward[0].args[2] is not nll.args[1]:
        return None
    grad = _logits_grad(log_softmax, (N, V))
    if grad is None:
        return None
    grad_h, grad_w = None, []
    for mm, operand, flipped in _matmuls_of(grad):
        if mm is None:
            return None
        a, b = mm.args
        if operand is a and not flipped:
            grad_h = mm
        elif operand is a and flipped and _same_rows(b, h2d, transposed=False):
            grad_w.append((mm, False))
        elif operand is b and not flipped and _same_rows(a, h2d, transposed=True):
            grad_w.append((mm, True))
        else:
            return None
    if grad_h is None:
        return None
    return _Match(logits, chain, to_nll, nll, backward[0], grad_h, grad_w, tag.inner)


def _forward_users(node: fx.Node) -> list:
    return [u for u in node.users if u.target not in _NLL.values()]


def _class_dim(nodes: list, cls: int) -> int | None:
    """Where the class dim (``cls`` at the input of ``nodes[0]``) is after the chain ``nodes``;
    None if a view merges or splits it or a slice cuts it."""
    for node in nodes:
        cls = _class_dim_after(node, cls)
        if cls is None:
            return None
    return cls


def _class_dim_after(node: fx.Node, cls: int) -> int | None:
    """Where one chain op puts the class dim ``cls`` of its input (casts keep it)."""
    if node.target in _VIEWS:
        return _class_dim_after_view(list(val(node.args[0]).shape), cls, list(val(node).shape))
    if node.target in _TRANSPOSES:
        return permutation(node).index(cls)
    if node.target == aten.slice.Tensor and norm_dim(node.args[1], val(node).dim()) == cls:
        return None
    return cls


def _logits_grad(log_softmax: fx.Node, shape: tuple) -> fx.Node | None:
    """The (N, V) gradient of the logits: the last node of ``shape`` on the log-softmax
    backward's chain of single-user views, transposes, casts and slice_backwards, before
    any transpose of it (which ``_matmuls_of`` follows)."""
    saved, backs = [u for u in log_softmax.users if u.target == aten.detach.default], []
    while saved:
        node = saved.pop()
        for u in node.users:
            if u.target == aten.detach.default:
                saved.append(u)
            elif u.target == aten._log_softmax_backward_data.default:
                backs.append(u)
    if len(backs) != 1:
        return None
    node, found = backs[0], None
    while True:
        if tuple(val(node).shape) == shape:
            found = node
        user = next(iter(node.users)) if len(node.users) == 1 else None
        if user is None or user.target not in _GRAD_CHAIN or (found is not None and user.target in _TRANSPOSES):
            return found
        node = user


def _matmuls_of(grad: fx.Node) -> list[tuple]:
    """(mm, its operand, whether the operand is grad transposed) for every mm reading the
    (N, V) ``grad`` through 2-D views and transposes; a (None, ...) entry if anything else
    reads it."""
    out, stack = [], [(grad, False)]
    while stack:
        node, flipped = stack.pop()
        for u in node.users:
            if u.target in _VIEWS and tuple(val(u).shape) == tuple(val(node).shape):
                stack.append((u, flipped))
            elif u.target in _TRANSPOSES and val(u).dim() == 2:
                stack.append((u, not flipped))
            elif u.target == aten.mm.default:
                out.append((u, node, flipped))
            else:
                return [(None, None, None)]
    return out


def _same_rows(x: fx.Node, h2d: fx.Node, transposed: bool) -> bool:
    """Whether ``x`` is h2d (transposed: its transpose), up to views of the same node."""
    if transposed:
        if x.target not in _TRANSPOSES or val(x).dim() != 2:
            return False
        x = x.args[0]
    return _base(x) is _base(h2d) and val(x).shape == val(h2d).shape


def _base(x: fx.Node) -> fx.Node:
    while x.target in _VIEWS:
        x = x.args[0]
    return x


def _rewrite(gm: fx.GraphModule, ctx: PassContext, m: _Match, chunk_rows: int) -> None:
    graph = gm.graph
    build = GraphBuilder(graph, ctx.captured.fake_mode)
    forward = []

    def b(op, *args, **kwargs):  # a forward node, as the partitioner would tag it
        node = build(op, *args, **kwargs)
        node.meta["partitioner_tag"] = "is_forward"
        forward.append(node)
        return node

    B, k = ctx.batch_size, m.rows_per_sample
    h2d, wt = m.logits.args
    N, d = val(h2d).shape
    packing = Packing.of(gm, ctx, build) if ctx.packed_units else None
    if packing is not None and (B, k) != (packing.rows, packing.T):
        return  # the head reads other rows than the batch's positions (h[:, :-1]): ``per_sample`` refuses it by name
    rows = packing is not None and _rows_form(ctx, m, packing, val(wt).shape[1], d)
    target, ignore_index = m.nll.args[1], m.nll.args[4]
    grad_output = m.nll_backward.args[0]
    logits_dtype = val(m.nll.args[0]).dtype  # the log-softmax's output: fp32 from fp16 logits under half_to_float
    chunk = max(1, chunk_rows // B)
    _hoist(grad_output, before=m.nll)
    with graph.inserting_before(m.nll):
        position = _replay(b, m, N)  # shaped like the NLL's output: the row of h each term reads
        flat = b(aten.reshape.default, position, [-1])
        labels = b(aten.index_put.default,
                   b(aten.full.default, [N], ignore_index, dtype=torch.int64, device=val(target).device),
                   [flat], b(aten.reshape.default, target, [-1]))
        grads = b(aten.index_put.default,
                  b(aten.zeros.default, [N], dtype=val(grad_output).dtype, device=val(grad_output).device),
                  [flat], b(aten.reshape.default, grad_output, [-1]))
        # Packed documents: the head's per-unit gradient as the logits' gradient rows, or summed per slot in the op.
        per_unit = (None, 0, True) if rows else \
            (b(aten.view.default, packing.units, [B, k]), ctx.packed_units + 1) if packing else ()
        op = b(torch.ops.longshield.lm_head_loss.default, b(aten.view.default, h2d, [B, k, d]), b(aten.t.default, wt),
               b(aten.view.default, labels, [B, k]), b(aten.view.default, grads, [B, k]),
               chunk, ignore_index, logits_dtype, bool(m.grad_w), *per_unit)
        loss, grad_h, grad_w = (b(operator.getitem, op, i) for i in range(3))
        token_loss = b(aten.index.Tensor, b(aten.view.default, loss, [N]), [position])
    for node in (grad_h, grad_w):  # gradients, not activations
        node.meta["partitioner_tag"] = "is_backward"
    op.meta["workspace_bytes"] = _op.workspace_bytes(*(val(a) for a in op.args[:2]), chunk, logits_dtype,
                                                      bool(m.grad_w), ctx.packed_units + 1 if packing else 0, rows)
    loss_out = next(u for u in m.nll.users if u.args[1] == 0)
    _tag_batch(forward, B)
    token_loss.meta["batch_dim"] = batch_dim(loss_out)
    loss_out.replace_all_uses_with(token_loss)
    with graph.inserting_before(m.grad_h):
        grad_h2d = build(aten.view.default, grad_h, [N, d])
    grad_h2d.meta["batch_dim"] = BatchDim(0, k)
    m.grad_h.replace_all_uses_with(grad_h2d)
    if rows:
        op.meta["batch_dim"] = (BatchDim(0), BatchDim(0), None)
        grad_w.meta["batch_dim"] = None  # token rows, read by unit slot: no per-sample layout of their own
        _replace_weight_grad(graph, build, m, lambda: build(torch.ops.longshield.head_weight_grad.default, grad_w,
                                                            h2d))
    else:
        grad_w.meta["per_unit"] = bool(packing)  # rows are unit slots: per_sample takes them as they are
        _replace_weight_grad(graph, build, m, lambda: build(aten.sum.dim_IntList, grad_w, [0]))


def _replace_weight_grad(graph: fx.Graph, build: GraphBuilder, m: _Match, make) -> None:
    """Put ``make()``, the head's (V, d) weight gradient, in place of each matmul that formed it
    (transposed where that one was (d, V)); mark it as the lm_head_loss rule's."""
    for mm, transposed in m.grad_w:
        with graph.inserting_before(mm):
            summed = make()
            summed.meta.update(batch_dim=None, per_sample_rule="lm_head_loss")
            if transposed:
                summed = build(aten.t.default, summed)
                summed.meta["batch_dim"] = None
        mm.replace_all_uses_with(summed)


def _rows_form(ctx: PassContext, m: _Match, packing: Packing, V: int, d: int) -> bool:
    """Whether the packed head's per-unit gradient should come as the logits' gradient rows (see the
    module docstring): N·(V+d) < (U+1)·V·d, on a head trained alone (not tied) at cp = 1 (its h
    rows are the packed batch's positions in ``units``' order: ``_rewrite`` rewrites no other)."""
    if ctx.sp_size > 1 or len(m.grad_w) != 1 or not _reaches_output_alone(m.grad_w[0][0]):
        return False
    N = packing.rows * packing.T
    return N * (V + d) < (ctx.packed_units + 1) * V * d


def _reaches_output_alone(node: fx.Node) -> bool:
    """Whether ``node`` is a parameter's whole gradient: it reaches the graph's output through
    single-user views, transposes and casts only (a tied weight's gradient adds another piece)."""
    while len(node.users) == 1:
        user = next(iter(node.users))
        if user.op == "output":
            return True
        if user.target not in _VIEWS + _TRANSPOSES + _COPIES:
            return False
        node = user
    return False


@per_sample_rule(torch.ops.longshield.head_weight_grad.default, name="lm_head_loss")
def _head_weight_per_unit(rw: Rewriter, node: fx.Node) -> PerSampleGrad:
    """Per-unit rule of ``head_weight_grad(dz, h)`` (the rows form): its two operands are token
    rows, so each unit's gradient is ``dzᵀ h`` over its own rows, formed where they lie
    (``segment_outer``, as ``per_sample`` forms packed linear weights), which ``ghost_norm``
    recognises and may replace by the two operands."""
    if rw.packing is None:
        raise AssertionError("head_weight_grad is made for packed documents only")
    dz, h = node.args
    per_unit = rw.call(torch.ops.longshield.segment_outer.default, dz, h, rw.packing.unit, rw.packing.counts)
    return PerSampleGrad(tuple(val(node).shape), per_unit)


def _tag_batch(nodes: list, B: int) -> None:
    """Batch tags of the new forward nodes: (B, ...) tensors and (B*k,) rows hold samples in
    dim 0; the position index and the head weight hold none."""
    for node in nodes:
        v = node.meta["val"]
        if isinstance(v, tuple):
            node.meta["batch_dim"] = (BatchDim(0),) * len(v)
        elif not any(batch_dim(a) for a in node.all_input_nodes):
            node.meta["batch_dim"] = None
        elif v.dim() and v.shape[0] == B:
            node.meta["batch_dim"] = BatchDim(0)
        else:
            node.meta["batch_dim"] = BatchDim(0, v.shape[0] // B)


def _replay(b, m: _Match, N: int) -> fx.Node:
    """Apply the logits' chain (logits -> NLL input) to an index of h's rows whose class dim
    has size 1; return it without the class dim, shaped like the NLL's per-position output."""
    x = b(aten.view.default, b(aten.arange.default, N, device=val(m.logits).device), [N, 1])
    cls = 1
    for node in [*m.chain, *m.to_nll]:
        cls = _class_dim_after(node, cls)
        if node.target in _VIEWS:
            x = b(aten.reshape.default, x, [1 if i == cls else n for i, n in enumerate(val(node).shape)])
        elif node.target in _TRANSPOSES:
            x = b(aten.permute.default, x, permutation(node))
        elif node.target == aten.slice.Tensor:
            x = b(aten.slice.Tensor, x, *node.args[1:])
    return b(aten.squeeze.dim, x, 1)


def _class_dim_after_view(before: list, cls: int, after: list) -> int | None:
    """Where a view puts dim ``cls`` of ``before``: the dim of ``after`` with the same size and
    the same number of elements after it; None if the view merges or splits it."""
    inner = 1
    for s in before[cls + 1:]:
        inner *= s
    acc = 1
    for i in range(len(after) - 1, -1, -1):
        if acc == inner and after[i] == before[cls]:
            return i
        acc *= after[i]
    return None


def _hoist(node: fx.Node, before: fx.Node) -> None:
    """Move ``node`` and those of its ancestors that come after ``before`` to just before it,
    keeping their order (they depend only on graph inputs and earlier nodes)."""
    order = {n: i for i, n in enumerate(before.graph.nodes)}
    limit, moving, stack = order[before], set(), [node]
    while stack:
        n = stack.pop()
        if n in moving or order[n] < limit or n.op == "placeholder":
            continue
        moving.add(n)
        stack.extend(n.all_input_nodes)
    for n in sorted(moving, key=order.__getitem__):
        before.prepend(n)
