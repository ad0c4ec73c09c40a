"""Capture forward + backward of a loss module as one aten-level FX graph.

The captured graph is flat: ``gm(*params, *buffers, *inputs, loss_cotangent)`` returns
``(per_sample_loss, *grads)`` with one grad per trainable parameter, in
``CapturedGraph.param_names`` order. Frozen parameters (``requires_grad=False``) are
inputs like buffers and get no gradient and no per-sample work. Parameters are named as
``named_parameters`` names them: a tied weight's shares under its other names are summed.
A trainable parameter the loss never reaches gets a ``zeros_like`` gradient (and a warning).
A forward dynamo cannot trace into one graph raises ``UnsupportedModelError``.

The route (see ../shared/TORCH_NOTES.md): dynamo captures the module with node metadata
preserved, so forward nodes carry ``nn_module_stack`` and backward nodes
``fwd_nn_module_stack``; aot-autograd then exports the joint graph (both private torch
APIs, called through ``longshield_fx._torch``).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch import nn

from ._torch import CaptureError, OpOverload, descriptors as d, export_joint, graph_module
from ._fixed_shape_forwards import for_capture
from ._packed_rnn import packed_rnns
from .errors import UnsupportedModelError

aten = torch.ops.aten


@dataclass
class CapturedGraph:
    gm: fx.GraphModule
    fake_mode: object
    # Placeholders in call order, each described by (kind, key): kind is "param",
    # "buffer", "input" or "cotangent"; key is the qualified name or input index.
    inputs: list[tuple[str, object]]
    param_names: list[str]  # trainable parameters, in output order
    grad_nodes: dict[str, fx.Node] = field(default_factory=dict)
    # Inputs the forward mutates (e.g. running statistics); the engine refuses these.
    mutations: list[str] = field(default_factory=list)

    @property
    def placeholders(self) -> list[fx.Node]:
        return list(self.gm.graph.find_nodes(op="placeholder"))

    def input_placeholders(self) -> list[fx.Node]:
        return [p for p, (kind, _) in zip(self.placeholders, self.inputs) if kind == "input"]

    def cotangent_placeholder(self) -> fx.Node:
        return next(p for p, (kind, _) in zip(self.placeholders, self.inputs) if kind == "cotangent")

    def param_placeholder(self, name: str) -> fx.Node:
        return next(p for p, (kind, key) in zip(self.placeholders, self.inputs) if kind == "param" and key == name)

    def copy(self) -> "CapturedGraph":
        """A copy whose graph the passes may rewrite without touching this one (nodes are
        new; their ``meta`` dicts are copies sharing the fake values)."""
        graph = fx.Graph()
        graph._codegen = self.gm.graph._codegen
        env: dict[fx.Node, fx.Node] = {}
        graph.output(graph.graph_copy(self.gm.graph, env))
        gm = graph_module(self.gm, graph)
        gm.meta.update(self.gm.meta)
        return CapturedGraph(gm, self.fake_mode, list(self.inputs), list(self.param_names),
                             {n: env[g] for n, g in self.grad_nodes.items() if g in env}, list(self.mutations))

    def gather_args(self, model: nn.Module, batch, cotangent, *, dtype=None, local=None) -> list:
        """The flat argument list for ``gm`` from the live model and a batch. ``local``: maps
        a sharded parameter to the value its placeholder takes (``runtime.fsdp``)."""
        args = []
        for kind, key in self.inputs:
            if kind in ("param", "buffer"):
                t = model.get_parameter(key) if kind == "param" else model.get_buffer(key)
                t = t.detach()
                if kind == "param" and local is not None:
                    t = local(t)
                if dtype is not None and t.is_floating_point():
                    t = t.to(dtype)
                args.append(t)
            elif kind == "input":
                args.append(batch[key])
            else:
                args.append(cotangent)
        return args


def capture(model: nn.Module, example_batch: tuple) -> CapturedGraph:
    """Capture the joint forward+backward graph of ``model(*example_batch)``.

    ``model`` must return per-sample losses of shape (B,). The objective is their sum;
    the loss cotangent (B,) is a graph input, which later passes use as the sample mask.
    """
    # Frozen parameters become plain inputs of the joint graph; toggling requires_grad
    # on the live model is avoided: we only read it.
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    try:
        with for_capture(model), packed_rnns(model):
            gm, fake_mode = export_joint(model, example_batch)
    except CaptureError as e:
        raise UnsupportedModelError(
            f"capture: the forward cannot be traced into one graph: {e}. Way out: replace or remove that call "
            "(a data-dependent shape, a skipped or untraceable function) so that the forward traces without "
            "graph breaks; torch.compile(fullgraph=True) shows the same break") from e
    return _flatten(gm, fake_mode, trainable, _aliases(model))


def _aliases(model: nn.Module) -> dict[str, str]:
    """Every name of a parameter (tied weights have several) -> the name ``named_parameters``
    gives it. The export may hand a tied weight's gradient to any of its names."""
    canonical = {id(p): n for n, p in model.named_parameters()}
    return {n: canonical[id(p)] for n, p in model.named_parameters(remove_duplicate=False)}


def _flatten(gm: fx.GraphModule, fake_mode, trainable: set[str], aliases: dict[str, str]) -> CapturedGraph:
    """Give the joint graph flat inputs and outputs ``(loss, *grads)``."""
    BufferAOTInput, GradAOTOutput, ParamAOTInput = d.BufferAOTInput, d.GradAOTOutput, d.ParamAOTInput
    PlainAOTInput, PlainAOTOutput, TangentAOTInput = d.PlainAOTInput, d.PlainAOTOutput, d.TangentAOTInput

    graph = gm.graph
    inputs: list[tuple[str, object]] = []
    for ph in graph.find_nodes(op="placeholder"):
        desc = ph.meta.get("desc")
        if isinstance(desc, ParamAOTInput):
            inputs.append(("param", aliases.get(desc.target, desc.target)))
        elif isinstance(desc, BufferAOTInput):
            inputs.append(("buffer", desc.target))
        elif isinstance(desc, PlainAOTInput):
            inputs.append(("input", desc.idx))
        elif isinstance(desc, TangentAOTInput):
            inputs.append(("cotangent", None))
        else:  # pragma: no cover - new descriptor kinds in a future torch
            raise UnsupportedModelError(f"capture: unexpected graph input {ph.name} ({desc!r})")
    if sum(kind == "cotangent" for kind, _ in inputs) != 1:
        raise UnsupportedModelError(
            "capture: the model must return exactly one tensor of per-sample losses, shape (B,), "
            "that requires grad")

    output = graph.output_node()
    outs, descs = output.args[0], output.meta.get("desc")
    loss, grads, mutated = None, {}, []
    for out, desc in zip(outs, descs):
        if isinstance(desc, GradAOTOutput) and isinstance(desc.grad_of, ParamAOTInput):
            name = aliases.get(desc.grad_of.target, desc.grad_of.target)
            if name in trainable and out is not None:
                if name in grads:  # a tied weight whose names each got a share
                    with graph.inserting_before(output):
                        out = graph.call_function(aten.add.Tensor, (grads[name], out))
                    out.meta.update(val=grads[name].meta["val"], partitioner_tag="is_backward")
                grads[name] = out
        elif isinstance(desc, PlainAOTOutput):
            loss = out
        elif desc is not None and not isinstance(desc, GradAOTOutput):
            mutated.append(str(desc))
    param_names = [n for n in dict.fromkeys(key for kind, key in inputs if kind == "param") if n in trainable]
    unused = [n for n in param_names if n not in grads]
    if unused:
        warnings.warn(
            f"trainable parameters {unused} get no gradient from the loss (e.g. cross-attention without an "
            "encoder): their per-sample gradients are 0, so DP-SGD moves them by noise alone. Freeze them "
            "(requires_grad=False) to keep them as they are", UserWarning, stacklevel=4)
        placeholders = {key: ph for ph, (kind, key) in zip(graph.find_nodes(op="placeholder"), inputs)
                        if kind == "param"}
        for name in unused:
            with graph.inserting_before(output):
                grads[name] = graph.call_function(aten.zeros_like.default, (placeholders[name],))
            with fake_mode:
                grads[name].meta.update(val=torch.zeros_like(placeholders[name].meta["val"]),
                                        partitioner_tag="is_backward")
    # Frozen parameters: the aot export already gives them no gradient (None output).
    graph._codegen = fx.graph.CodeGen()
    _tag_custom_backward(graph)
    _reshape_where_meta_strides_differ(graph)
    output.args = ((loss, *[grads[n] for n in param_names]),)
    output.meta.pop("desc", None)
    graph.eliminate_dead_code()
    gm.recompile()
    return CapturedGraph(gm, fake_mode, inputs, param_names, dict(grads), mutated)


def _tag_custom_backward(graph: fx.Graph) -> None:
    """The backward of a ``torch.autograd.Function`` comes out of the export without a
    ``partitioner_tag``; a node that reads a backward node is backward too. Untagged, the sum
    over the batch that such a backward makes for a parameter's gradient would read as the
    forward mixing samples, where it is a weight-gradient reduction like any other."""
    for node in graph.nodes:
        if node.op == "call_function" and "partitioner_tag" not in node.meta \
                and any(a.meta.get("partitioner_tag") == "is_backward" for a in node.all_input_nodes):
            node.meta["partitioner_tag"] = "is_backward"


def _reshape_where_meta_strides_differ(graph: fx.Graph) -> None:
    """``view`` -> ``reshape`` (the same values; a copy only where needed) on the output of an
    elementwise op whose full-size tensor inputs have different layouts. Which layout such an
    output gets is decided differently by the fake kernels (torch 2.13 refs) and the CPU
    kernels (TensorIterator), so an exported view of it can fail at run time (seen for
    softplus_backward and sigmoid_backward with a transposed grad_output, and for cat of
    such outputs)."""
    uncertain = set()  # nodes whose run-time layout may differ from their fake one
    for node in graph.nodes:
        if node.target in (aten.view.default, aten.reshape.default) and node.args[0] in uncertain:
            node.target = aten.reshape.default  # a view of a reshape that did not copy stays uncertain
            uncertain.add(node)
        elif _layout_is_ambiguous(node, uncertain):
            uncertain.add(node)


def _layout_is_ambiguous(node: fx.Node, uncertain: set) -> bool:
    if node.op != "call_function" or not isinstance(node.target, OpOverload):
        return False
    if node.target is aten.cat.default:  # the CPU kernel may follow a non-contiguous input's layout
        return any(a in uncertain or not a.meta["val"].is_contiguous() for a in node.all_input_nodes)
    out = node.meta.get("val")
    if not isinstance(out, torch.Tensor) or not (torch.Tag.pointwise in node.target.tags
                                                 or node.target._schema.name.endswith("_backward")):
        return False
    if _data_dependent(out) or any(_data_dependent(a.meta.get("val")) for a in node.all_input_nodes):
        return True  # sizes known only at run time (x[mask]): a reshape is right whatever the layout
    full_size = [a for a in node.all_input_nodes
                 if isinstance(a.meta.get("val"), torch.Tensor) and a.meta["val"].shape == out.shape]
    return any(a in uncertain for a in full_size) or len({a.meta["val"].stride() for a in full_size}) > 1


def _data_dependent(v) -> bool:
    """A fake tensor with a size or stride that is a symbol (an unbacked size such as x[mask]'s):
    comparing it would ask for a guard on data the capture does not have."""
    return isinstance(v, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in (*v.shape, *v.stride()))
