"""The token geometry of a packed batch for the passes (``compile(..., packed_units=U)``):
each token's unit slot, each slot's token count, and token-row views of the graph's tensors,
made once per graph however many passes and layers ask (``Packing.of``). ``per_sample`` builds
per-unit gradients from them (the ``longshield::segment_*`` ops read the rows as they lie, by
each row's slot: nothing is sorted or copied), ``chunked_loss`` the LM head's, and ``clip``
reads the counts."""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..errors import UnsupportedModelError
from ._context import PassContext
from ._graph import GraphBuilder, module_of, val
from .batch_dims import BatchDim, batch_dim

aten = torch.ops.aten


class Packing:
    """The geometry of a packed batch (see the module docstring): the ``units`` input (B, T)
    flattened to one unit slot per token (``unit``) and each slot's token count (``counts``).
    Each is made at its first use, right after the placeholders, and made again if a pass's
    dead-code elimination removed it."""

    def __init__(self, gm: fx.GraphModule, ctx: PassContext, call: GraphBuilder):
        captured = ctx.captured
        self.units = max(((p, key) for p, (kind, key) in zip(captured.placeholders, captured.inputs)
                          if kind == "input"), key=lambda pk: pk[1])[0]
        self.rows, self.T = (int(d) for d in val(self.units).shape)  # plain ints for the shapes built here
        self.U = ctx.packed_units
        self.graph, self.call = gm.graph, call
        self._nodes: dict[str, fx.Node] = {}
        self._made: set[fx.Node] = set()
        self._derived: dict[tuple, fx.Node] = {}  # ("tokens", node) -> its token rows

    def _node(self, name: str, build) -> fx.Node:
        node = self._nodes.get(name)
        if node is None or node._erased:
            # After the placeholders and every node made here: a build reads nothing else, and other
            # nodes may already sit among them (``_once`` puts a placeholder's reshape right after it).
            ours = {n for n in self._made if not n._erased}
            anchor = [n for n in self.graph.nodes if n.op == "placeholder" or n in ours][-1]
            with self.graph.inserting_before(anchor.next):
                node = self._nodes[name] = build()
            stack = [node]
            while stack:
                n = stack.pop()
                if n.op != "placeholder" and n not in self._made:
                    self._made.add(n)
                    stack += n.all_input_nodes
        return node

    @property
    def unit(self) -> fx.Node:
        return self._node("unit", lambda: self.call(aten.view.default, self.units, [self.rows * self.T]))

    @property
    def counts(self) -> fx.Node:
        unit = self.unit

        def build():
            zeros = self.call(aten.zeros.default, [self.U + 1], dtype=torch.int64, device=val(unit).device)
            return self.call(aten.index_add.default, zeros, 0, unit, self.call(aten.ones_like.default, unit))

        return self._node("counts", build)

    @property
    def unit_counts(self) -> fx.Node:
        """``counts`` with none for the padding slot U: the units' token counts on this rank."""
        counts = self.counts

        def build():
            slots = self.call(aten.arange.default, self.U + 1, device=val(counts).device)
            return self.call(aten.mul.Tensor, counts, self.call(aten.lt.Scalar, slots, self.U))

        return self._node("unit_counts", build)

    @staticmethod
    def of(gm: fx.GraphModule, ctx: PassContext, call: GraphBuilder) -> "Packing":
        """The graph's ``Packing``, made by the first pass that asks."""
        if "packing" not in gm.meta:
            gm.meta["packing"] = Packing(gm, ctx, call)
        return gm.meta["packing"]

    def unsupported(self, param: str, node: fx.Node) -> UnsupportedModelError:
        return UnsupportedModelError(
            f"parameter {param!r}: with packed documents its gradient comes through {node.name} "
            f"({node.target}, from {module_of(node)}), which has no per-unit rule (linear layers, embeddings, "
            "biases and norm weights have one). Way out: train on unpacked batches (compile without packed_units, "
            "CLI --no-pack) or freeze the parameter.")

    def tokens(self, param: str, node: fx.Node) -> tuple[fx.Node, int]:
        """``node`` as (B*T, ...) token rows in ``units``' order, and how many of its leading
        dims those rows were (1: already B*T rows; 2: (B, T, ...))."""
        tag, shape = batch_dim(node), list(val(node).shape)
        if isinstance(tag, BatchDim) and tag.dim == 0 and tag.outer == 1:
            if tag.inner == self.T and shape[0] == self.rows * self.T:
                return node, 1
            if tag.inner == 1 and len(shape) >= 2 and shape[:2] == [self.rows, self.T]:
                return self._once(("tokens", node), [node], lambda: self.call(
                    aten.reshape.default, node, [self.rows * self.T, *shape[2:]])), 2
        raise self.unsupported(param, node)

    def _once(self, key, inputs: list[fx.Node], build) -> fx.Node:
        """One node per ``key``, right after the last of its ``inputs`` (so every user sees it defined);
        ``sink_rows`` moves it down to its first user once the pass has made every user."""
        node = self._derived.get(key)
        if node is None or node._erased:
            position = {n: i for i, n in enumerate(self.graph.nodes)}
            last = max(inputs, key=position.__getitem__)
            if last.op == "placeholder":  # after every placeholder, not among them
                last = list(self.graph.find_nodes(op="placeholder"))[-1]
            with self.graph.inserting_after(last):
                node = self._derived[key] = build()
        return node

    def sink_rows(self) -> None:
        """Move every token-row reshape (``tokens``) to just before its first user.

        ``_once`` makes one right after its input, which for a forward activation is in the
        forward, while only the backward's per-unit gradients read it: there a reshape that must
        copy (a non-contiguous input) would live from the forward to the backward, and activation
        checkpointing would recompute its input in the forward to feed it.
        """
        position = {n: i for i, n in enumerate(self.graph.nodes)}
        copies = sorted((n for n in self._derived.values() if not n._erased and n.users), key=position.__getitem__)
        for node in reversed(copies):  # a copy read by another copy moves after that one has moved
            first = node.next
            while first not in node.users:
                first = first.next
            first.prepend(node)

    def unit_sum(self, param: str, node: fx.Node, dims, out_shape) -> fx.Node:
        """Per-unit ``sum(node, dims)`` where dims include the token dims: (U+1, *out_shape)."""
        if node.meta.get("per_unit"):  # one row per unit slot already (chunked_loss's head gradient)
            if [d % val(node).dim() for d in dims] != [0]:
                raise self.unsupported(param, node)
            return self.call(aten.view.default, node, [self.U + 1, *out_shape])
        tokens, lead = self.tokens(param, node)
        if not set(range(lead)) <= {d % val(node).dim() for d in dims}:
            raise self.unsupported(param, node)
        rest = [d % val(node).dim() - lead + 1 for d in dims if d % val(node).dim() >= lead]
        if rest:
            tokens = self.call(aten.sum.dim_IntList, tokens, rest)
        zeros = self.call(aten.zeros.default, [self.U + 1, *val(tokens).shape[1:]], dtype=val(tokens).dtype,
                          device=val(tokens).device)
        out = self.call(aten.index_add.default, zeros, 0, self.unit, tokens)
        return self.call(aten.view.default, out, [self.U + 1, *out_shape])
