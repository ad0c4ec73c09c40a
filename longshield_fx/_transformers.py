"""Fixed-shape forwards for Hugging Face modules whose eager forward has no static graph.

transformers runs most MoE experts through a pluggable ``experts_implementation``
(``batched_mm`` is fixed-shape, so it captures). A few experts classes ship only an eager
loop over the experts the batch hit (``nonzero`` + ``int(idx.item())``): the loop's length
is data, so no graph exists. For those, ``fixed_shape_experts`` swaps in, for the capture
only, a forward that computes the same sum with shapes fixed by (tokens, top-k), as
``batched_mm`` does: every (token, slot) pair gathers its expert's weights and the k results
are summed. Per-sample work stays exact: a token's gradient reaches only the experts it was
routed to, exactly as in the loop.

Classes are matched by module path and name, so transformers is never imported here.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn


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
        gate, up = torch.bmm(self.gate_up_proj[ids], x.unsqueeze(-1)).squeeze(-1).chunk(2, dim=-1)
        y = torch.bmm(self.down_proj[ids], (self.act_fn(gate) * up).unsqueeze(-1)).squeeze(-1)
        y = torch.where(routed.unsqueeze(-1), y, x)
    y = y * top_k_weights.reshape(-1, 1)
    return y.view(tokens, top_k, hidden).sum(dim=1).to(hidden_states.dtype)


_FIXED_SHAPE_FORWARDS = {
    ("transformers.models.longcat_flash.modeling_longcat_flash", "LongcatFlashExperts"):
        _longcat_flash_experts_forward,
}


@contextlib.contextmanager
def fixed_shape_experts(model: nn.Module):
    """Within the block, modules of a class in ``_FIXED_SHAPE_FORWARDS`` run the fixed-shape
    forward (an instance attribute, removed on exit)."""
    swapped = []
    for module in model.modules():
        cls = type(module)
        forward = _FIXED_SHAPE_FORWARDS.get((cls.__module__, cls.__name__))
        if forward is not None and "forward" not in vars(module):
            module.forward = forward.__get__(module)
            swapped.append(module)
    try:
        yield
    finally:
        for module in swapped:
            del module.forward


__all__ = ["fixed_shape_experts"]
