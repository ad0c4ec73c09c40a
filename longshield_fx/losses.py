"""Per-sample training objectives.

DP-SGD clips each sample's gradient, so the library needs the loss as a vector with one entry
per sample, not as a batch mean: the objective it differentiates is ``loss.sum()``, and a
sample's entry may depend on that sample only.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

from .errors import UnsupportedModelError


def _is_hf_model(model: nn.Module) -> bool:
    # A Hugging Face (or peft-wrapped) model can only exist if its package is already imported,
    # so checking sys.modules avoids making transformers or peft a dependency.
    transformers, peft = sys.modules.get("transformers"), sys.modules.get("peft")
    return (transformers is not None and isinstance(model, transformers.PreTrainedModel)) or \
        (peft is not None and isinstance(model, peft.PeftModel))


class CausalLMLoss(nn.Module):
    """Per-sample summed next-token cross-entropy of a causal LM.

    ``forward(input_ids, labels)`` returns a (B,) fp32 tensor whose entry i is the SUM over
    positions of the cross-entropy of sample i: ``logits[:, :-1]`` predict ``labels[:, 1:]``
    (HF convention: pass the input ids as labels, the shift happens here), and positions
    labelled -100 contribute 0. The training objective is the sum of this vector over samples;
    each entry depends on its own sample only, which is what per-sample clipping requires.
    Summing (rather than averaging) over tokens keeps a sample's weight independent of how
    many of its tokens are masked.

    ``lm`` is either the project's ``Llama`` (returns logits) or a Hugging Face causal LM such
    as ``LlamaForCausalLM`` / ``GPT2LMHeadModel`` (returns an output with ``.logits``; it is
    called with ``use_cache=False`` so no cache is built). It is kept as ``self.lm``, so
    parameter names are ``lm.<name>``. ``position_ids``, if given, are passed to ``lm``; they
    set positions only, never sequence boundaries: the whole row is one causal sequence.

    A sample may span several rows: with (B, R, T) inputs sample i is the R rows ``[i]`` (a
    long document split into rows, or all documents of one person), each row its own causal
    sequence, and entry i sums the token losses of all R rows. The rows are folded into the
    batch as (B*R, T) inside the graph, so the per-sample gradient and its clipping cover
    the whole unit. All-padding rows (labels -100) contribute exactly 0.
    """

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm
        self.is_hf = _is_hf_model(lm)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        B, rows = input_ids.shape[0], _rows(input_ids, labels)
        input_ids, labels = _fold(input_ids, rows), _fold(labels, rows)
        kwargs = {}
        if position_ids is not None:
            kwargs["position_ids"] = _fold(position_ids, rows)
            if self.is_hf:
                # Without an attention_mask, transformers 5 reads any position step other than +1
                # as the start of a new packed sequence and blocks attention across it; here
                # positions only place tokens (e.g. a shard's global positions), as in Llama.
                kwargs["attention_mask"] = torch.ones_like(input_ids)
        if self.is_hf:
            kwargs["use_cache"] = False
        out = self.lm(input_ids, **kwargs)
        logits = out if isinstance(out, torch.Tensor) else out.logits
        token_loss = _next_token_losses(logits, labels[:, 1:])
        return _per_sample(token_loss, B, rows)


class PackedCausalLMLoss(nn.Module):
    """Each row's summed next-token cross-entropy over packed documents (``compile(...,
    packed_units=U)``; ``pack_documents`` makes the batches).

    ``forward(input_ids, labels, position_ids, units)``, all (B, T): a row holds several
    documents; a segment (one document, or the part of one that fits the row) starts where
    the position does not follow the previous token's by one or the unit slot changes. A token
    attends only to its own segment's earlier tokens, and a token never predicts the first
    token of the next segment (that pair would carry one document's text into another's
    gradient), whatever the labels say. Returns (B,): the engine sums each unit's share of it.

    ``lm``: the reference ``Llama`` (given ``segment_ids``) or a Hugging Face causal LM, given
    the block-diagonal causal mask as a 4-D boolean ``attention_mask`` and the positions (its
    own detection of packed sequences from positions alone is not relied on).
    """

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm
        self.is_hf = _is_hf_model(lm)
        why = packing_refused(lm)
        if why:
            raise UnsupportedModelError(f"PackedCausalLMLoss: {why}")

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor,
                units: torch.Tensor) -> torch.Tensor:
        if not (input_ids.dim() == 2 and input_ids.shape == labels.shape == position_ids.shape == units.shape):
            raise ValueError(f"PackedCausalLMLoss: input_ids, labels, position_ids and units must all be (B, T), got "
                             f"{[tuple(t.shape) for t in (input_ids, labels, position_ids, units)]}")
        starts, segments = document_segments(position_ids, units)
        if self.is_hf:
            out = self.lm(input_ids, position_ids=position_ids, attention_mask=_document_mask(segments), use_cache=False)
            logits = out.logits
        else:
            logits = self.lm(input_ids, position_ids=position_ids, segment_ids=segments)
        targets = labels[:, 1:].masked_fill(starts[:, 1:], -100)
        token_loss = _next_token_losses(logits, targets)
        return token_loss.sum(dim=1)


class ShardedPackedCausalLMLoss(nn.Module):
    """The per-shard form of ``PackedCausalLMLoss`` used under context parallelism.

    ``forward(input_ids, shifted_labels, position_ids, segments, units)`` takes one cp rank's
    tokens, with what needs whole rows made before the sequence was cut (``runtime.parallel``):
    labels shifted over the full row with each segment's first token unpredicted, and each
    token's segment id (``document_segments``). Attention is the document op
    (``longshield::ring_attention`` with the segment ids), which the ``context_parallel`` pass
    gives the ring: the reference ``Llama`` calls it itself; a Hugging Face model attends
    through ``_hf_document_attention``, registered with transformers as
    ``capture_attention``, which the capture swaps in (``_fixed_shape_forwards.for_capture``; its own
    mask would be a (T, T) one that a shard cannot build). ``units`` is for the passes (each
    token's unit slot). Summing over cp ranks gives ``PackedCausalLMLoss``'s value.
    """

    def __init__(self, loss: PackedCausalLMLoss):
        super().__init__()
        self.lm = loss.lm
        self.is_hf = loss.is_hf
        if self.is_hf:
            from transformers import AttentionInterface
            AttentionInterface.register(_HF_DOCUMENT_ATTENTION, _hf_document_attention)
            self.capture_attention = _HF_DOCUMENT_ATTENTION

    def forward(self, input_ids, shifted_labels, position_ids, segments, units):
        if self.is_hf:
            logits = self.lm(input_ids, position_ids=position_ids, use_cache=False,
                             longshield_segments=segments).logits
        else:
            logits = self.lm(input_ids, position_ids=position_ids, segment_ids=segments)
        token_loss = F.cross_entropy(_at_least_fp32(logits).transpose(1, 2), shifted_labels, reduction="none",
                                     ignore_index=-100)
        return token_loss.sum(dim=1)


_HF_DOCUMENT_ATTENTION = "longshield_documents"


def _hf_document_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                           longshield_segments=None, **kwargs):
    """A transformers attention function: causal attention within each document (the segment ids
    the model passes on from its forward's ``longshield_segments``); transformers builds no mask
    for it. Anything it does not implement is refused by name."""
    where = type(module).__name__
    if longshield_segments is None:
        raise UnsupportedModelError(f"packed documents under context parallelism: {where} did not pass the "
                                    "segment ids on to its attention function")
    for what in ("sliding_window", "softcap", "s_aux"):
        if kwargs.get(what) is not None:
            raise UnsupportedModelError(f"packed documents under context parallelism: {where} attends with "
                                        f"{what}, which the document ring attention does not implement")
    if dropout:
        raise UnsupportedModelError(f"packed documents under context parallelism: {where} has attention dropout "
                                    f"{dropout}; set it to 0 (attention_dropout, attn_pdrop) or call model.eval()")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out, _ = torch.ops.longshield.ring_attention(query, key, value, scale, "", 1, 0, longshield_segments)
    return out.transpose(1, 2), None


def document_segments(position_ids: torch.Tensor, units: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(starts, segments), both (B, T), of packed rows: a segment starts where the position does not
    follow the previous token's by one or the unit slot changes; ``segments`` numbers them from 1
    along each row."""
    follows = (position_ids[:, 1:] == position_ids[:, :-1] + 1) & (units[:, 1:] == units[:, :-1])
    starts = torch.cat([torch.ones_like(follows[:, :1]), ~follows], dim=1)
    return starts, starts.cumsum(1)


def packed_predicted_tokens(labels: torch.Tensor, position_ids: torch.Tensor, units: torch.Tensor) -> int:
    """How many tokens ``PackedCausalLMLoss`` predicts in a packed batch: a labelled token that
    does not start a segment (a segment's first token has no earlier one of its document); the
    divisor of a mean token loss."""
    starts = document_segments(position_ids, units)[0]
    return int(((labels[:, 1:] != -100) & ~starts[:, 1:]).sum())


def _document_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) bool: query t may attend key s iff s <= t and both have the same segment id
    (block-diagonal causal attention over packed documents)."""
    T = segment_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=segment_ids.device).tril()
    same = segment_ids.unsqueeze(2) == segment_ids.unsqueeze(1)
    return (same & causal).unsqueeze(1)


def packing_refused(lm: nn.Module) -> str | None:
    """Why ``lm`` cannot run packed documents, or None. A Hugging Face model must attend with
    SDPA, which applies the 4-D boolean mask as a mask: eager attention adds a mask to the scores
    (True as +1: nothing masked), other kernels may drop it."""
    if not _is_hf_model(lm):
        return None
    attention = getattr(lm.config, "_attn_implementation", None)
    if attention != "sdpa":
        return (f"packed documents need a Hugging Face model with attn_implementation='sdpa' (this one attends with "
                f"{attention!r}, which would not keep the documents of a row apart); load it with "
                "attn_implementation='sdpa', or train on unpacked batches (CausalLMLoss, CLI --no-pack)")
    return None


def _at_least_fp32(logits: torch.Tensor) -> torch.Tensor:
    """Logits for the softmax: low-precision ones upcast to fp32, fp64 ones kept (not rounded down)."""
    return logits if logits.dtype == torch.float64 else logits.float()


def _next_token_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(B, T-1) cross-entropy of (B, T, V) logits, position t against ``targets[:, t]`` (the next
    token's, -100: none).

    Traced (the capture of a DP step), over the class dim of (B, V, T-1): the batch dim leads in
    every intermediate tensor, where flattening to (B*T, V) would merge it with the sequence dim.
    Run eagerly (evaluation, a non-private step), over the (B*T, V) rows of every position (the
    last one's target -100), a view of the logits: the same values to float rounding, and on a
    CPU 1.6x (V = 256) to 6x (V = 4096) faster, forward and backward, than a softmax over strided
    classes."""
    if torch.compiler.is_compiling():
        return F.cross_entropy(_at_least_fp32(logits[:, :-1]).transpose(1, 2), targets, reduction="none",
                               ignore_index=-100)
    every = F.pad(targets, (0, 1), value=-100)
    return F.cross_entropy(_at_least_fp32(logits).flatten(0, 1), every.flatten(), reduction="none",
                           ignore_index=-100).view(every.shape)[:, :-1]


def _fold(t: torch.Tensor, rows: int) -> torch.Tensor:
    return t.flatten(0, 1) if rows else t


def _per_sample(token_loss: torch.Tensor, B: int, rows: int) -> torch.Tensor:
    per_row = token_loss.sum(dim=1)
    return per_row.reshape(B, -1).sum(dim=1) if rows else per_row


def _rows(input_ids: torch.Tensor, labels: torch.Tensor) -> int:
    """1 for (B, R, T) batches (fold the R rows of a sample into the batch), 0 for (B, T)."""
    if input_ids.dim() not in (2, 3) or labels.shape != input_ids.shape:
        raise ValueError(f"CausalLMLoss: input_ids and labels must both be (B, T) or (B, R, T), got "
                         f"{tuple(input_ids.shape)} and {tuple(labels.shape)}")
    return input_ids.dim() - 2


class ShardedCausalLMLoss(nn.Module):
    """The per-shard form of ``CausalLMLoss`` used under context parallelism.

    ``forward(input_ids, shifted_labels, position_ids)`` takes one cp rank's tokens with
    labels ALREADY shifted over the full sequence (the next token may live on another
    rank) and the tokens' global positions; it returns the per-sample sum of this shard's
    token losses. Summing over cp ranks gives ``CausalLMLoss``'s value. It shares ``lm``
    with the wrapped loss, so parameter names and tensors are the same.
    """

    def __init__(self, loss: CausalLMLoss):
        super().__init__()
        self.lm = loss.lm
        self.is_hf = loss.is_hf

    def forward(self, input_ids, shifted_labels, position_ids):
        B, rows = input_ids.shape[0], _rows(input_ids, shifted_labels)
        input_ids, shifted_labels = _fold(input_ids, rows), _fold(shifted_labels, rows)
        kwargs = {"position_ids": _fold(position_ids, rows)}
        if self.is_hf:
            kwargs.update(use_cache=False, attention_mask=torch.ones_like(input_ids))
        out = self.lm(input_ids, **kwargs)
        logits = _at_least_fp32(out if isinstance(out, torch.Tensor) else out.logits)
        token_loss = F.cross_entropy(logits.transpose(1, 2), shifted_labels, reduction="none", ignore_index=-100)
        return _per_sample(token_loss, B, rows)


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """labels[..., 1:] with -100 appended: position t predicts token t+1, the last nothing."""
    return torch.cat([labels[..., 1:], torch.full_like(labels[..., :1], -100)], dim=-1)
