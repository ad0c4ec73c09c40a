"""The training set as the engine's batches: the rows of each privacy unit, and the physical
batches of a sampled logical batch, collated and padded to one shape."""
from __future__ import annotations

import torch


class UnitBatchesMixin:
    """A base of ``DPTrainerMixin``: the rows of the sampled units as physical batches. Reads the
    trainer's ``_rows``, ``_collate``, ``_units``, ``_seq_len``, ``_pad_id`` and ``_sampler``
    (``DPTrainerMixin._setup``)."""

    def _document(self, i: int) -> list[int]:
        """Row ``i``'s token ids, one document for packing (which trains every token: labels = ids);
        a right-padded row (``attention_mask`` 1s, then 0s) without its padding."""
        row = self._rows[i]
        ids = [int(t) for t in row["input_ids"]]
        if "attention_mask" in row:
            mask = [int(m) for m in row["attention_mask"]]
            if mask != sorted(mask, reverse=True) or not set(mask) <= {0, 1}:
                raise ValueError(f"DPTrainer: packing (PrivacyArguments.pack_seq_len) reads an attention_mask as "
                                 f"right padding (1s, then 0s), and row {i}'s is not; tokenize with "
                                 "tokenizer.padding_side = 'right', or without padding (packing needs none)")
            ids = ids[:sum(mask)]
        if "labels" in row and [int(t) for t in row["labels"]][:len(ids)] != ids:
            raise ValueError(f"DPTrainer: packing (PrivacyArguments.pack_seq_len) trains every token of a document, "
                             f"but row {i}'s labels differ from its input_ids; leave pack_seq_len unset to keep "
                             "the labels")
        return ids

    def _logical_batches(self):
        while True:
            yield from self._sampler

    def _physical(self, samples: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, labels) of the sampled rows, (B, T); or with a unit column, of the sampled
        units, (B, R, T), each unit's rows first and then rows of padding (labels -100)."""
        if self._units is None:
            return self._collated(samples.tolist())
        members = [self._units[u] for u in samples.tolist()]
        ids, labels = self._collated([i for rows in members for i in rows])
        R = max(len(rows) for rows in self._units)
        out_ids = ids.new_full((len(members), R, ids.shape[1]), self._pad_id)
        out_labels = labels.new_full((len(members), R, ids.shape[1]), -100)
        k = 0
        for b, rows in enumerate(members):
            out_ids[b, :len(rows)], out_labels[b, :len(rows)] = ids[k:k + len(rows)], labels[k:k + len(rows)]
            k += len(rows)
        return out_ids, out_labels

    def _collated(self, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, labels) of dataset ``rows``, collated and right-padded to the longest row of
        the training set, ``self._seq_len``: every physical batch has that one length. A collator
        that pads further (``pad_to_multiple_of``) adds columns of padding past it, which are cut."""
        batch = self._collate([self._rows[i] for i in rows])
        if "labels" not in batch:
            raise ValueError("DPTrainer: the collated batch has no 'labels'; copy input_ids to labels (as "
                             "group_texts does) or use DataCollatorForLanguageModeling(tokenizer, mlm=False)")
        ids, labels = torch.as_tensor(batch["input_ids"]), torch.as_tensor(batch["labels"])
        mask = batch.get("attention_mask")
        if mask is not None:
            mask = torch.as_tensor(mask)
            if bool((mask[:, 1:] > mask[:, :-1]).any()):
                raise ValueError("DPTrainer: a row is left-padded (attention_mask 0 before 1); the loss reads rows "
                                 "as causal sequences from their first position: set tokenizer.padding_side = "
                                 "'right'")
            labels = labels.masked_fill(mask == 0, -100)
        T = self._seq_len
        if ids.shape[1] > T:
            # Past the longest training row a collator can only have padded (pad_to_multiple_of): the
            # columns cut predict nothing (labels -100) and attend to nothing that is kept.
            real = labels[:, T:] != -100
            if mask is not None:
                real |= mask[:, T:] != 0
            if bool(real.any()):
                raise ValueError(f"DPTrainer: the collator returned rows of {ids.shape[1]} tokens with a real token "
                                 f"(attention_mask 1 or a label other than -100) past token {T}, the length of the "
                                 "longest training row; every physical batch is cut to that length, so the collator "
                                 "may add padding only (right-padded, labels -100): do not let it add or lengthen "
                                 "rows")
            ids, labels = ids[:, :T].contiguous(), labels[:, :T].contiguous()  # the capture guards strides
        pad = T - ids.shape[1]
        if pad > 0:
            ids = torch.nn.functional.pad(ids, (0, pad), value=self._pad_id)
            labels = torch.nn.functional.pad(labels, (0, pad), value=-100)
        return ids.to(self.args.device), labels.to(self.args.device)


def unit_rows(dataset, column: str) -> list[list[int]]:
    """The row indices of each unit (in order of first appearance), from ``column``. Values name
    units through ``run_core.canonical_unit_id``, as the CLI's unit keys do: 'alice', ' ALICE' and
    'ａｌｉｃｅ' are one unit, 5 and "5" one, "5" and "05" two (folding only merges, which is
    conservative; a person split over k spellings would cost about k·ε)."""
    import numbers

    from ..run_core import canonical_unit_id

    try:
        keys = dataset[column] if hasattr(dataset, "column_names") else [row[column] for row in dataset]
    except (KeyError, TypeError):
        raise ValueError(f"DPTrainer: PrivacyArguments.unit_column={column!r} is not a column of the training "
                         "set") from None
    groups: dict = {}
    for i, key in enumerate(keys):
        if isinstance(key, numbers.Integral) and not isinstance(key, bool):
            key = int(key)  # numpy's integers too
        elif not isinstance(key, str):
            raise ValueError(f"DPTrainer: row {i} of the training set has {column}={key!r} "
                             f"({type(key).__name__}); the values of PrivacyArguments.unit_column={column!r} "
                             "name privacy units and must be strings or integers: give the row its unit's id "
                             "or drop it")
        name = canonical_unit_id(key)
        if not name:
            raise ValueError(f"DPTrainer: row {i} of the training set has an empty {column}={key!r} (blank once "
                             f"whitespace and invisible characters are removed); give the row its unit's id")
        groups.setdefault(name, []).append(i)
    return list(groups.values())


def pad_token_id(tokenizer, model) -> int:
    """The token id of padding: the tokenizer's pad or EOS token, else the model config's, else 0."""
    for source in (tokenizer, getattr(model, "config", None)):
        for name in ("pad_token_id", "eos_token_id"):
            value = getattr(source, name, None)
            if isinstance(value, int):
                return value
    return 0
