"""The embedded corpus: this machine's Python standard library sources, one row per document.

The privacy unit is the document (one stdlib file): its first T bytes form one row, padding
labelled -100, so a document is sampled as one row and clipped as one sample whatever its
length; the truncation is reported. Nothing is downloaded.
"""
from __future__ import annotations

import dataclasses
import sysconfig
from pathlib import Path

import torch

from .common import CLIError


def stdlib_files(max_files: int | None = None) -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts)
    return files[:max_files] if max_files else files


@dataclasses.dataclass
class Corpus:
    """One row per document (a stdlib file): the privacy unit is the document.

    ``ids`` (N, T) holds each document's first T bytes, padded with byte 0; ``labels`` is
    ``ids`` with -100 at the padding, so padding positions contribute 0 to ``CausalLMLoss``
    (causal attention: the padding after a document never reaches its real tokens). A
    document is therefore sampled as one row and clipped as one sample, whatever its length;
    bytes past T are not used (``truncated`` documents, ``bytes_used`` of ``bytes_total``).
    """

    ids: torch.Tensor
    labels: torch.Tensor
    lengths: list[int]  # bytes of each document (before truncation)
    seq_len: int
    skipped: int  # files with fewer than 2 bytes (no next-token pair): not in the corpus

    @property
    def num_documents(self) -> int:
        return len(self.lengths)

    num_units = num_documents  # one document, one privacy unit

    @property
    def truncated(self) -> int:
        return sum(n > self.seq_len for n in self.lengths)

    @property
    def bytes_total(self) -> int:
        return sum(self.lengths)

    @property
    def bytes_used(self) -> int:
        return sum(min(n, self.seq_len) for n in self.lengths)

    @property
    def fraction_used(self) -> float:
        return self.bytes_used / self.bytes_total

    def dataset(self):
        from torch.utils.data import TensorDataset

        return TensorDataset(self.ids, self.labels)

    def stats(self) -> dict:
        return {"documents": self.num_documents, "truncated_documents": self.truncated,
                "bytes_used": self.bytes_used, "bytes_total": self.bytes_total,
                "bytes_used_fraction": round(self.fraction_used, 6), "skipped_files_under_2_bytes": self.skipped}


def stdlib_corpus(seq_len: int, max_files: int | None = None) -> Corpus:
    """One row per standard-library .py file (sorted by path): its first ``seq_len`` bytes,
    padded (label -100) when shorter. Files of fewer than 2 bytes are left out."""
    rows, lengths, skipped = [], [], 0
    for f in stdlib_files(max_files):
        data = f.read_bytes()
        if len(data) < 2:
            skipped += 1
            continue
        lengths.append(len(data))
        rows.append(data[:seq_len])
    if not rows:
        raise CLIError("the corpus has no document of 2 bytes or more; raise --max-files")
    ids = torch.zeros(len(rows), seq_len, dtype=torch.long)
    labels = torch.full((len(rows), seq_len), -100, dtype=torch.long)
    for i, data in enumerate(rows):
        row = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        ids[i, :len(data)] = row
        labels[i, :len(data)] = row
    return Corpus(ids, labels, lengths, seq_len, skipped)


PRIVACY_UNIT = "per document (add/remove one document)"
NOT_COVERED = "not_covered_by_dp"
