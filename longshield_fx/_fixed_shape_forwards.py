"""Fixed-shape forwards for Hugging Face modules whose eager forward has no static graph.

transformers runs most MoE experts through a pluggable ``experts_implementation``
(``batched_mm`` is fixed-shape, so it captures). A few experts classes ship only an eager
loop over the experts the batch hit (``nonzero`` + ``int(idx.item())``: LongCat-Flash), or a
sort of the batch's (token, slot) pairs by expert split into groups of data-dependent sizes
(``tolist()`` of the per-expert counts: JetMoE): the loop's length or the split's sizes are
data, so no graph exists. For those, ``fixed_shape_experts`` swaps in, for the capture only,
methods that compute the same sums with shapes fixed by (tokens, top-k), as ``batched_mm``
does: every (token, slot) pair gathers its expert's weights and the k results are summed.
Per-sample work stays exact: a token's output, and its gradient, reach only the experts it
was routed to, exactly as in the eager module (there is no capacity limit, so no token
depends on another's routing). X-MOD's language adapters, experts chosen per row by a
language id, gather each language's rows with a boolean mask over the batch (rows moved
along the batch dimension); their stand-in keeps every row in place.

Classes are matched by module path and name, so transformers is never imported here.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn


def _slot_linear(weight, x, expert_ids):
    """``F.linear(x[i], weight[expert_ids[i]])`` for every row i: one gathered batched matmul."""
    return torch.bmm(weight[expert_ids], x.unsqueeze(-1)).squeeze(-1)


def _longcat_flash_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """LongCat-Flash's experts: ``num_routed_experts`` gated MLPs plus "zero" experts (ids at
    or above it) that return their input unchanged; slot outputs are weighted and summed."""
    tokens, hidden = hidden_states.shape
    top_k = top_k_index.shape[-1]
    x = hidden_states.repeat_interleave(top_k, dim=0)  # (tokens * k, hidden), slot-major per token
    expert_ids = top_k_index.reshape(-1)
    if self.gate_up_proj is None:
        y = x
    else:
        routed = expert_ids < self.num_routed_experts
        # A zero-expert slot still runs (fixed shapes) on a clamped id; `where` sends its
        # output, and so its gradient, nowhere.
        ids = expert_ids.clamp(max=self.num_routed_experts - 1)
        gate, up = _slot_linear(self.gate_up_proj, x, ids).chunk(2, dim=-1)
        y = _slot_linear(self.down_proj, self.act_fn(gate) * up, ids)
        y = torch.where(routed.unsqueeze(-1), y, x)
    y = y * top_k_weights.reshape(-1, 1)
    return y.view(tokens, top_k, hidden).sum(dim=1).to(hidden_states.dtype)


def _jetmoe_route(router, x):
    """JetMoE's top-k gating without its sort-and-group: (expert ids (tokens * k,) slot-major
    per token, gates (tokens, k), router logits), the same softmax over the top-k logits."""
    logits = router.layer(x).float()
    top_k_logits, top_k_indices = logits.topk(router.top_k, dim=1)
    gates = torch.softmax(top_k_logits, dim=1).type_as(x)
    return top_k_indices.reshape(-1), gates, logits


def _jetmoe_moe_forward(self, layer_input):
    """JetMoE's MLP experts: each token's k experts (gated MLPs), weighted by the gates and summed."""
    bsz, length, hidden = layer_input.shape
    x = layer_input.reshape(-1, hidden)
    expert_ids, gates, _ = _jetmoe_route(self.router, x)
    h = _slot_linear(self.input_linear.weight, x.repeat_interleave(self.router.top_k, dim=0), expert_ids)
    gate, up = h.chunk(2, dim=-1)
    y = _slot_linear(self.output_linear.weight, self.activation(gate) * up, expert_ids)
    y = y.view(-1, self.router.top_k, hidden) * gates.unsqueeze(-1)
    return y.sum(dim=1).view(bsz, length, hidden) + self.bias


def _jetmoe_moa_map(self, layer_input):
    """JetMoE's attention experts, first half: each token's k query projections, (B, T, k, d);
    the routing (ids, gates) goes to ``reduce`` in place of the eager sort's topology."""
    bsz, length, hidden = layer_input.shape
    x = layer_input.reshape(-1, hidden)
    expert_ids, gates, logits = _jetmoe_route(self.router, x)
    q = _slot_linear(self.input_linear.weight, x.repeat_interleave(self.top_k, dim=0), expert_ids)
    return q.view(bsz, length, self.top_k, -1), logits, (expert_ids, gates)


def _jetmoe_moa_reduce(self, layer_input, topo_info):
    """Second half: each (token, slot)'s output projection by its expert, weighted by the gate
    and summed over the k slots."""
    bsz, length, k, d = layer_input.shape
    expert_ids, gates = topo_info
    y = _slot_linear(self.output_linear.weight, layer_input.reshape(-1, d), expert_ids)
    y = y.view(-1, k, self.input_size) * gates.unsqueeze(-1)
    return y.sum(dim=1).view(bsz, length, self.input_size) + self.bias


def _xmod_lang_adapter(self, lang_ids, hidden_states):
    """X-MOD's language adapters: each row through its own language's adapter. The eager
    method gathers each language's rows (a boolean mask over the batch: a data-dependent
    number of rows) and writes the adapter's output back into the same rows; here every
    adapter runs on every row and ``where`` keeps each row's own, so no row moves. The
    adapters are small bottleneck MLPs, but this runs all of them on every row."""
    if not self.ln_before_adapter:
        residual = hidden_states
    if self.adapter_layer_norm is not None:
        hidden_states = self.adapter_layer_norm(hidden_states)
    elif self.adapter_reuse_layer_norm:
        hidden_states = self.LayerNorm(hidden_states)
    if self.ln_before_adapter:
        residual = hidden_states
    row_language = lang_ids.view(-1, *[1] * (hidden_states.dim() - 1))
    adapted = torch.zeros_like(hidden_states)
    for language, adapter in enumerate(self.adapter_modules.values()):
        adapted = torch.where(row_language == language, adapter(hidden_states), adapted)
    return self.dropout(adapted) + residual


# (module path, class name) -> {method name: its fixed-shape stand-in}
_FIXED_SHAPE_METHODS = {
    ("transformers.models.longcat_flash.modeling_longcat_flash", "LongcatFlashExperts"):
        {"forward": _longcat_flash_experts_forward},
    ("transformers.models.jetmoe.modeling_jetmoe", "JetMoeMoE"): {"forward": _jetmoe_moe_forward},
    ("transformers.models.jetmoe.modeling_jetmoe", "JetMoeMoA"):
        {"map": _jetmoe_moa_map, "reduce": _jetmoe_moa_reduce},
    ("transformers.models.xmod.modeling_xmod", "XmodOutput"): {"lang_adapter": _xmod_lang_adapter},
}


@contextlib.contextmanager
def fixed_shape_experts(model: nn.Module):
    """Within the block, modules of a class in ``_FIXED_SHAPE_METHODS`` run the fixed-shape
    methods (instance attributes, removed on exit), and every Hugging Face config that picks
    another ``experts_implementation`` (transformers' default ``grouped_mm`` sorts the batch's
    tokens by expert; ``eager`` loops over the experts hit) picks ``batched_mm``, the same sums
    in fixed shapes."""
    swapped = []
    for module in model.modules():
        cls = type(module)
        methods = _FIXED_SHAPE_METHODS.get((cls.__module__, cls.__name__), {})
        if methods and not any(name in vars(module) for name in methods):
            for name, method in methods.items():
                setattr(module, name, method.__get__(module))
            swapped.append((module, methods))
    configs = {id(c): c for c in (getattr(m, "config", None) for m in model.modules())
               if getattr(c, "_experts_implementation", "batched_mm") not in (None, "batched_mm")}
    chosen = {key: config._experts_implementation for key, config in configs.items()}
    for config in configs.values():
        config._experts_implementation = "batched_mm"
    try:
        yield
    finally:
        for module, methods in swapped:
            for name in methods:
                delattr(module, name)
        for key, config in configs.items():
            config._experts_implementation = chosen[key]


@contextlib.contextmanager
def for_capture(model: nn.Module):
    """The swaps of a capture: ``fixed_shape_experts``, and, where ``model`` names a
    ``capture_attention`` (an attention function registered with transformers), every Hugging
    Face config inside it attends with that function (restored on exit)."""
    name = getattr(model, "capture_attention", None)
    configs = {} if name is None else {id(c): c for c in (getattr(m, "config", None) for m in model.modules())
                                       if hasattr(c, "_attn_implementation")}
    chosen = {key: config._attn_implementation for key, config in configs.items()}
    for config in configs.values():
        config._attn_implementation = name
    try:
        with fixed_shape_experts(model):
            yield
    finally:
        for key, config in configs.items():
            config._attn_implementation = chosen[key]


__all__ = ["fixed_shape_experts", "for_capture"]
