"""A user's private documents, loaded as fixed-shape privacy units of R rows of T tokens.

The privacy unit is what the user means by a record (DESIGN.md, "DP semantics"): one
document, or every document of one person (a patient, an author). A unit is held as R rows
of T tokens, ``ids`` / ``labels`` of shape (N, R, T); each row is its own causal sequence and
``CausalLMLoss`` sums a unit's token losses over its rows, so a unit is sampled as one example
and clipped as one example however many rows it has. Padding holds ``pad_id`` and is labelled
-100 (it contributes 0 to the loss), and so are the all-padding rows of units shorter than R.

Accepted inputs:

- a directory: every regular file under it, recursively, in order of relative path; hidden
  files and directories (names starting with '.') are left out, and so are symlinked
  directories and non-regular files (FIFOs, sockets). Each file is one document and one unit,
  named by its path relative to the directory.
- a ``.jsonl`` file: one JSON object per line with a string ``text`` and an optional ``id``
  (a string or an integer; an integer and its decimal string are the same unit) naming the
  unit. Documents sharing an id form ONE unit whose rows are each document's rows, in file
  order; a line without ``id`` is its own unit, named ``line <k>`` (k counts from 1). Blank
  lines are skipped; any other line that is not a JSON object with a string ``text`` (or whose
  ``id`` is neither a string nor an integer, null included) is an error naming the line.
- a ``.txt`` file: one document per non-blank line (without its line ending), each its own
  unit named ``line <k>``.

Text is decoded as strict UTF-8 (a leading byte-order mark is dropped). A file of the
directory that is not valid UTF-8 is skipped and counted (``non_utf8``), never decoded
lossily: a lossy decode would train on U+FFFD replacement characters instead of the user's
text and hide that the file was not what it seemed. A ``.jsonl`` or ``.txt`` input that is
not UTF-8 is an error (its lines cannot be told apart reliably).

Each document is tokenized with the caller's ``encode`` and cut into rows of T tokens, its
last row padded; rows never straddle two documents. A document of fewer than 2 tokens has no
next-token pair and is skipped (``empty``). A unit keeps at most ``max_rows`` rows: the rows
past that are dropped, and the truncated units and dropped tokens are counted so the caller
can report them. R = min(max_rows, most rows of any unit), so short data do not pay for
all-padding rows. Each row is a fresh causal sequence, so its first token is context only:
a document of n tokens cut into k rows has n-k predicted tokens, not n-1.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Callable, Sequence

import torch

from .errors import DataError

ACCEPTED = "a directory of UTF-8 text files, a .jsonl file (one {\"text\": ..., \"id\": ...} object per line) " \
           "or a .txt file (one document per line)"


@dataclasses.dataclass
class Documents:
    """N privacy units of R rows of T tokens (see the module docstring).

    ``ids`` (N, R, T) long, padding ``pad_id``; ``labels`` is ``ids`` with -100 at every
    padding slot (labels, not ids, say where the tokens are: ``pad_id`` may be a real token).
    The per-unit lists count, for unit i, its documents, its tokens before truncation and the
    tokens dropped by ``max_rows``. ``skipped`` counts the documents left out of the whole
    load (``non_utf8``, ``empty``); an eval/train split keeps the load's counts.
    """

    ids: torch.Tensor
    labels: torch.Tensor
    units: list[str]
    seq_len: int
    documents_per_unit: list[int]
    tokens_total_per_unit: list[int]
    tokens_dropped_per_unit: list[int]
    skipped: dict[str, int]
    source: str
    kind: str  # "directory", "jsonl" or "txt"

    @property
    def num_units(self) -> int:
        return int(self.ids.shape[0])

    @property
    def rows_per_unit(self) -> int:
        return int(self.ids.shape[1])

    @property
    def num_rows(self) -> int:
        """Rows holding at least one token (all-padding rows are not counted)."""
        return int((self.labels != -100).any(dim=-1).sum())

    @property
    def num_tokens(self) -> int:
        """Tokens kept (after truncation)."""
        return int((self.labels != -100).sum())

    @property
    def num_documents(self) -> int:
        return sum(self.documents_per_unit)

    @property
    def truncated_units(self) -> int:
        return sum(d > 0 for d in self.tokens_dropped_per_unit)

    @property
    def tokens_dropped(self) -> int:
        return sum(self.tokens_dropped_per_unit)

    @property
    def tokens_total(self) -> int:
        return sum(self.tokens_total_per_unit)

    def dataset(self):
        from torch.utils.data import TensorDataset

        return TensorDataset(self.ids, self.labels)

    def stats(self) -> dict:
        slots = self.ids.numel()
        return {"documents": self.num_documents, "units": self.num_units, "rows": self.num_rows,
                "rows_per_unit": self.rows_per_unit, "seq_len": self.seq_len,
                "tokens_kept": self.num_tokens, "tokens_total": self.tokens_total,
                "truncated_units": self.truncated_units, "tokens_dropped": self.tokens_dropped,
                "padding_fraction": round(1 - self.num_tokens / slots, 6) if slots else 0.0,
                "skipped": dict(self.skipped), "source": self.source}

    def split(self, eval_fraction: float, seed: int) -> tuple["Documents", "Documents"]:
        """(train, eval) by whole units: a shuffle seeded by ``seed`` (``torch.Generator``), eval
        takes round(F*N) units, at least 1, leaving train at least 1. Both keep file order and
        the same R, so one compiled (B, R, T) graph serves both."""
        n = self.num_units
        if not (isinstance(eval_fraction, (int, float)) and math.isfinite(eval_fraction)
                and 0 < eval_fraction < 1):
            raise DataError(f"the eval fraction must be between 0 and 1 (exclusive), got {eval_fraction}")
        if n < 2:
            raise DataError(f"cannot split {n} unit(s) of {self.source} into train and eval: "
                           "each needs at least 1 unit")
        n_eval = min(max(1, round(eval_fraction * n)), n - 1)
        g = torch.Generator().manual_seed(int(seed))
        perm = torch.randperm(n, generator=g)
        eval_idx, train_idx = perm[:n_eval].sort().values, perm[n_eval:].sort().values
        return self._subset(train_idx), self._subset(eval_idx)

    def _subset(self, idx: torch.Tensor) -> "Documents":
        pick = idx.tolist()
        return Documents(self.ids[idx].clone(), self.labels[idx].clone(), [self.units[i] for i in pick],
                         self.seq_len, [self.documents_per_unit[i] for i in pick],
                         [self.tokens_total_per_unit[i] for i in pick],
                         [self.tokens_dropped_per_unit[i] for i in pick], dict(self.skipped), self.source,
                         self.kind)

    def describe(self) -> str:
        what = "files" if self.kind == "directory" else "lines"
        s = self.skipped
        return (f"{self.num_units} units ({self.num_documents} documents), {self.num_tokens} tokens in "
                f"{self.num_rows} rows of {self.seq_len}, {self.rows_per_unit} rows per unit; {self.truncated_units} units "
                f"truncated ({self.tokens_dropped} tokens dropped); {sum(s.values())} {what} skipped "
                f"(non-UTF-8: {s['non_utf8']}, empty: {s['empty']})")


# --- reading ---------------------------------------------------------------------------------

def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror or e}") from None


def _decode(data: bytes) -> str:
    """Strict UTF-8, a leading BOM dropped; raises UnicodeDecodeError."""
    return data.decode("utf-8-sig")


def _decode_or_fail(path: Path, data: bytes) -> str:
    try:
        return _decode(data)
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise DataError(f"{path}: not valid UTF-8 (line {line}, byte {e.start}); the file must be "
                       "UTF-8 text") from None


def _walk(root: Path) -> list[tuple[str, Path]]:
    """(relative posix path, path) of every non-hidden regular file under root, sorted."""
    def fail(e: OSError):
        raise DataError(f"cannot list {e.filename}: {e.strerror or e}")

    found = []
    for dirpath, dirnames, filenames in os.walk(root, onerror=fail):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            p = Path(dirpath, name)
            if not name.startswith(".") and p.is_file():
                found.append((p.relative_to(root).as_posix(), p))
    found.sort(key=lambda f: f[0])
    return found


def _lines(text: str):
    """(line number from 1, line without its ending); only \\n (and \\r\\n) end a line."""
    for k, line in enumerate(text.split("\n"), 1):
        yield k, line[:-1] if line.endswith("\r") else line


def _jsonl_documents(path: Path):
    """(unit key, unit name, text) per non-blank line of a .jsonl file."""
    text = _decode_or_fail(path, _read(path))
    for k, line in _lines(text):
        if not line.strip():
            continue
        where = f"{path}:{k}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno}); each line must be one "
                           "JSON object") from None
        if not isinstance(obj, dict):
            raise DataError(f"{where}: expected a JSON object with a string \"text\", got {type(obj).__name__}")
        body = obj.get("text")
        if not isinstance(body, str):
            got = "no \"text\" field" if "text" not in obj else f"\"text\" is {type(body).__name__}"
            raise DataError(f"{where}: {got}; each line needs a string \"text\" field")
        if "id" in obj:
            uid = obj["id"]
            if isinstance(uid, bool) or not isinstance(uid, (str, int)):
                raise DataError(f"{where}: \"id\" must be a string or an integer naming the privacy unit, got "
                               f"{json.dumps(uid)}; leave \"id\" out to make the line its own unit")
            yield ("id", str(uid)), str(uid), body
        else:
            yield ("line", k), f"line {k}", body


def _txt_documents(path: Path):
    text = _decode_or_fail(path, _read(path))
    for k, line in _lines(text):
        if line.strip():
            yield ("line", k), f"line {k}", line


def _dir_documents(root: Path, skipped: dict[str, int]):
    for rel, p in _walk(root):
        try:
            body = _decode(_read(p))
        except UnicodeDecodeError:
            skipped["non_utf8"] += 1
            continue
        yield ("file", rel), rel, body


@dataclasses.dataclass
class _Unit:
    name: str
    chunks: list[tuple[int, torch.Tensor]]  # (first row, kept tokens) of each document
    rows: int = 0
    documents: int = 0
    tokens_total: int = 0
    tokens_dropped: int = 0


def load_documents(path, encode: Callable[[str], Sequence[int]], seq_len: int, max_rows: int,
                   pad_id: int) -> Documents:
    """Load ``path`` (a directory, a .jsonl or a .txt file: see the module docstring) as
    :class:`Documents` of shape (N, R, T = seq_len), R = min(max_rows, most rows of any unit).
    ``encode(text) -> list[int]`` is the tokenizer. Raises :class:`DataError` on user errors."""
    if seq_len < 2:
        raise DataError(f"the sequence length must be >= 2 (a next-token loss needs two tokens), got {seq_len}")
    if max_rows < 1:
        raise DataError(f"the rows per unit must be >= 1, got {max_rows}")
    p = Path(path)
    skipped = {"non_utf8": 0, "empty": 0}
    if p.is_dir():
        kind, docs = "directory", _dir_documents(p, skipped)
    elif not p.exists():
        raise DataError(f"no such file or directory: {path}; expected {ACCEPTED}")
    elif p.is_file() and p.suffix.lower() == ".jsonl":
        kind, docs = "jsonl", _jsonl_documents(p)
    elif p.is_file() and p.suffix.lower() == ".txt":
        kind, docs = "txt", _txt_documents(p)
    else:
        raise DataError(f"{path}: unsupported input{' ' + repr(p.suffix) if p.suffix else ''}; expected {ACCEPTED}")

    T, units = seq_len, {}
    for key, name, body in docs:
        tokens = encode(body)
        del body
        tokens = torch.as_tensor(tokens if isinstance(tokens, (list, tuple)) else list(tokens), dtype=torch.long)
        n = int(tokens.numel())
        if n < 2:
            skipped["empty"] += 1
            continue
        u = units.get(key)
        if u is None:
            u = units[key] = _Unit(name, [])
        keep_rows = min(-(-n // T), max_rows - u.rows)
        keep = min(n, keep_rows * T)
        u.documents += 1
        u.tokens_total += n
        u.tokens_dropped += n - keep
        if keep:
            u.chunks.append((u.rows, tokens[:keep].clone() if keep < n else tokens))
            u.rows += keep_rows
        del tokens

    if not units:
        raise DataError(f"{path}: no usable document ({skipped['non_utf8']} skipped as not UTF-8, "
                       f"{skipped['empty']} skipped as empty or under 2 tokens); expected {ACCEPTED}")

    order = list(units.values())  # first appearance in file order
    N, R = len(order), min(max_rows, max(u.rows for u in order))
    ids = torch.full((N, R, T), pad_id, dtype=torch.long)
    labels = torch.full((N, R, T), -100, dtype=torch.long)
    for i, u in enumerate(order):
        flat_ids, flat_labels = ids[i].view(-1), labels[i].view(-1)
        for row, chunk in u.chunks:
            flat_ids[row * T: row * T + chunk.numel()] = chunk
            flat_labels[row * T: row * T + chunk.numel()] = chunk
        u.chunks = []  # free each unit's tokens as soon as they are in place
    return Documents(ids, labels, [u.name for u in order], T, [u.documents for u in order],
                     [u.tokens_total for u in order], [u.tokens_dropped for u in order], skipped,
                     str(path), kind)
