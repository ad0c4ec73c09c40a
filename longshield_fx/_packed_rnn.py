"""``PackedSequence`` RNNs in fixed shapes, for the capture only.

A ``PackedSequence`` interleaves the samples' steps by time (``batch_sizes`` says how many
samples are still running at each step), so its shapes are the batch's lengths: no graph
with fixed shapes holds it, and dynamo refuses ``pack_padded_sequence`` outright. While
capturing, the packing functions and the recurrent layers that read a packed input compute
the same values on the padded batch instead:

- ``pack_padded_sequence(x, lengths, ...)`` returns a ``MaskedPacked``: the padded (B, T, ...)
  tensor, batch first, and each sample's length. Samples stay in their rows: sorting by
  length (``enforce_sorted=False``) is a permutation the packed form undoes on the way out,
  so it changes no value; the check ``enforce_sorted=True`` makes in eager (lengths must be
  sorted) is data and is not made.
- ``nn.RNN/GRU/LSTM`` and Opacus's ``DPRNN/DPGRU/DPLSTM`` fed one run every direction over all
  T steps, and at a step past a sample's length keep that sample's state as it was
  (``where(t < length, new, old)``). A forward direction so ends on the state of the sample's
  last step; a reverse direction starts, from its initial state, at that last step: the
  packed recurrence, sample by sample, with no value read from the padding. Outputs past a
  sample's length are 0; ``h_n`` (``c_n``) is in the batch's row order, as eager returns it.
- ``pad_packed_sequence`` writes ``padding_value`` past each length. Its time dimension is the
  padded input's T (or ``total_length``), not the longest length in the batch (data); pass
  ``total_length=x.shape[1]`` to get the same shape in eager.

Each sample's loss and gradients are then those of the sample run alone, packed (the tests
compare with that, per sample). The capture swaps the layers' ``forward`` on the instances
(instance attributes, removed on exit, as ``_fixed_shape_forwards.fixed_shape_experts`` does); the
packing functions are traced as these by ``_torch.export_joint``.
"""
from __future__ import annotations

import contextlib
import sys

import torch
import torch.nn.functional as F
from torch import nn


class MaskedPacked:
    """A packed batch while capturing: ``padded`` (B, T, ...) and ``lengths`` (B,)."""

    def __init__(self, padded: torch.Tensor, lengths: torch.Tensor):
        self.padded, self.lengths = padded, lengths


def pack_padded_sequence(input, lengths, batch_first=False, enforce_sorted=True):
    padded = input if batch_first else input.transpose(0, 1)
    return MaskedPacked(padded, torch.as_tensor(lengths, device=padded.device))


def pad_packed_sequence(sequence, batch_first=False, padding_value=0.0, total_length=None):
    x, lengths = sequence.padded, sequence.lengths
    x = torch.where(_steps_kept(x, lengths), x, padding_value)
    if total_length is not None:
        if total_length < x.shape[1]:
            raise ValueError(f"pad_packed_sequence: total_length {total_length} is shorter than the padded "
                             f"input's {x.shape[1]} steps")
        x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, total_length - x.shape[1]), value=padding_value)
    return (x if batch_first else x.transpose(0, 1)), lengths


def _steps_kept(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """(B, T, 1, ...) booleans: step t of sample b is one of its own (t < lengths[b])."""
    steps = torch.arange(x.shape[1], device=x.device)
    kept = steps[None, :] < lengths.to(x.device)[:, None]
    return kept.reshape(*kept.shape, *[1] * (x.dim() - 2))


def _opacus_rnn_base():
    module = sys.modules.get("opacus.layers.dp_rnn")  # never imported here: only a model that has one loaded it
    return getattr(module, "DPRNNBase", None)


def _is_packable_rnn(module: nn.Module) -> bool:
    base = _opacus_rnn_base()
    return isinstance(module, nn.RNNBase) or (base is not None and isinstance(module, base))


def _torch_step(module: nn.RNNBase, layer: int, direction: int):
    """One step of torch's layer ``layer``, direction ``direction``: (x, state) -> state, with the
    state (h,) or (h, c) and h first; the same equations as torch's cells."""
    sfx = f"_l{layer}" + ("_reverse" if direction else "")
    w_ih, w_hh = getattr(module, "weight_ih" + sfx), getattr(module, "weight_hh" + sfx)
    b_ih, b_hh = (getattr(module, "bias_ih" + sfx), getattr(module, "bias_hh" + sfx)) if module.bias else (None, None)
    w_hr = getattr(module, "weight_hr" + sfx) if getattr(module, "proj_size", 0) else None
    mode = module.mode

    def step(x, state):
        gi, gh = F.linear(x, w_ih, b_ih), F.linear(state[0], w_hh, b_hh)
        if mode == "GRU":
            (ir, iz, i_n), (hr, hz, h_n) = gi.chunk(3, -1), gh.chunk(3, -1)
            r, z = torch.sigmoid(ir + hr), torch.sigmoid(iz + hz)
            n = torch.tanh(i_n + r * h_n)
            return ((1 - z) * n + z * state[0],)
        if mode == "LSTM":
            i, f, g, o = (gi + gh).chunk(4, -1)
            c = torch.sigmoid(f) * state[1] + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
            return (h if w_hr is None else F.linear(h, w_hr), c)
        return ((torch.tanh if mode == "RNN_TANH" else torch.relu)(gi + gh),)

    return step


def _opacus_step(module: nn.Module, layer: int, direction: int):
    """One step of Opacus's cell, with its dropout on every step's h (as its forward_layer has)."""
    cell = module.cells[module.num_directions * layer + direction]

    def step(x, state):
        out = cell(x, state) if module.has_cell_state else (cell(x, state[0]),)
        h = module.dropout_layer(out[0]) if module.dropout else out[0]
        return (h, *out[1:])

    return step


def _initial_states(module, hx, B: int, like: torch.Tensor, directions: int) -> list[tuple]:
    """Per (layer, direction): (h,) or (h, c), from ``hx`` (L*P, B, ...) or zeros."""
    cell_state = module.mode == "LSTM" if isinstance(module, nn.RNNBase) else module.has_cell_state
    h_size = getattr(module, "proj_size", 0) or module.hidden_size
    count = module.num_layers * directions
    if hx is None:
        h = like.new_zeros(count, B, h_size)
        hx = (h, like.new_zeros(count, B, module.hidden_size)) if cell_state else h
    parts = hx if cell_state else (hx,)
    return [tuple(p[i] for p in parts) for i in range(count)]


def masked_rnn_forward(module: nn.Module, packed: MaskedPacked, hx=None):
    """``module(packed, hx)`` on the padded batch, each sample's state kept past its length."""
    torch_layer = isinstance(module, nn.RNNBase)
    directions = 2 if module.bidirectional else 1
    x, lengths = packed.padded, packed.lengths
    B, T = x.shape[:2]
    kept = _steps_kept(x[..., :1], lengths)  # (B, T, 1)
    states = _initial_states(module, hx, B, x, directions)
    finals = []
    for layer in range(module.num_layers):
        outs = []
        for direction in range(directions):
            step = (_torch_step if torch_layer else _opacus_step)(module, layer, direction)
            state, ys = states[layer * directions + direction], [None] * T
            for t in (reversed(range(T)) if direction else range(T)):
                new, keep = step(x[:, t], state), kept[:, t]
                state = tuple(torch.where(keep, n, s) for n, s in zip(new, state))
                ys[t] = torch.where(keep, new[0], 0.0)
            outs.append(torch.stack(ys, 1))
            finals.append(state)
        x = torch.cat(outs, -1)
        if torch_layer and module.dropout and module.training and layer < module.num_layers - 1:
            x = F.dropout(x, module.dropout, True)
    h_n = torch.stack([s[0] for s in finals])
    hidden = (h_n, torch.stack([s[1] for s in finals])) if len(finals[0]) > 1 else h_n
    return MaskedPacked(x, lengths), hidden


def _forward_of(module: nn.Module):
    original = type(module).forward.__get__(module)

    def forward(input, *args, **kwargs):
        if isinstance(input, MaskedPacked):
            return masked_rnn_forward(module, input, *args, **kwargs)
        return original(input, *args, **kwargs)

    return forward


@contextlib.contextmanager
def packed_rnns(model: nn.Module):
    """Within the block, every recurrent layer of ``model`` also takes a ``MaskedPacked``."""
    swapped = [m for m in model.modules() if _is_packable_rnn(m) and "forward" not in vars(m)]
    for m in swapped:
        m.forward = _forward_of(m)
    try:
        yield
    finally:
        for m in swapped:
            del m.forward


__all__ = ["MaskedPacked", "masked_rnn_forward", "pack_padded_sequence", "pad_packed_sequence", "packed_rnns"]
