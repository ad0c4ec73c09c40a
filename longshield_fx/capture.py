"""Capture forward + backward of a loss module as one aten-level FX graph.

The captured graph is flat: ``gm(*params, *buffers, *inputs, loss_cotangent)`` returns
``(per_sample_loss, *grads)`` with one grad per trainable parameter, in
``CapturedGraph.param_names`` order. Frozen parameters (``requires_grad=False``) are
inputs like buffers and get no gradient and no per-sample work.

The route (see ../shared/TORCH_NOTES.md): dynamo captures the module with node metadata
preserved, so forward nodes carry ``nn_module_stack`` and backward nodes
``fwd_nn_module_stack``; aot-autograd then exports the joint graph (both private torch
APIs, called through ``longshield_fx._torch``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx
from torch import nn

from ._torch import descriptors as d, export_joint
from .errors import UnsupportedModelError


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

    def gather_args(self, model: nn.Module, batch, cotangent, *, dtype=None) -> list:
        """The flat argument list for ``gm`` from the live model and a batch."""
        args = []
        for kind, key in self.inputs:
            if kind in ("param", "buffer"):
                t = model.get_parameter(key) if kind == "param" else model.get_buffer(key)
                t = t.detach()
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
    gm, fake_mode = export_joint(model, example_batch)
    return _flatten(gm, fake_mode, trainable)


def _flatten(gm: fx.GraphModule, fake_mode, trainable: set[str]) -> CapturedGraph:
    """Give the joint graph flat inputs and outputs ``(loss, *grads)``."""
    BufferAOTInput, GradAOTOutput, ParamAOTInput = d.BufferAOTInput, d.GradAOTOutput, d.ParamAOTInput
    PlainAOTInput, PlainAOTOutput, TangentAOTInput = d.PlainAOTInput, d.PlainAOTOutput, d.TangentAOTInput

    graph = gm.graph
    inputs: list[tuple[str, object]] = []
    for ph in graph.find_nodes(op="placeholder"):
        desc = ph.meta.get("desc")
        if isinstance(desc, ParamAOTInput):
            inputs.append(("param", desc.target))
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
            if desc.grad_of.target in trainable and out is not None:
                grads[desc.grad_of.target] = out
        elif isinstance(desc, PlainAOTOutput):
            loss = out
        elif desc is not None and not isinstance(desc, GradAOTOutput):
            mutated.append(str(desc))
    param_names = [key for kind, key in inputs if kind == "param" and key in trainable]
    missing = [n for n in param_names if n not in grads]
    if missing:
        raise UnsupportedModelError(
            f"capture: trainable parameters {missing} get no gradient from the loss; "
            "freeze them (requires_grad=False) or use them in the forward")
    # Frozen parameters: the aot export already gives them no gradient (None output).
    graph._codegen = fx.graph.CodeGen()
    output.args = ((loss, *[grads[n] for n in param_names]),)
    output.meta.pop("desc", None)
    graph.eliminate_dead_code()
    gm.recompile()
    return CapturedGraph(gm, fake_mode, inputs, param_names, dict(grads), mutated)
