"""A user's private documents, loaded as fixed-shape privacy units of R rows of T tokens.

The privacy unit is what the user means by a record (DESIGN.md, "DP semantics"): one
document, or every document of one person (a patient, an author). A unit is held as R rows
of T tokens, ``ids`` / ``labels`` of shape (N, R, T); each row is its own causal sequence and
``CausalLMLoss`` sums a unit's token losses over its rows, so a unit is sampled as one example
and clipped as one example however many rows it has. Padding holds ``pad_id`` and is labelled
-100 (it contributes 0 to the loss), and so are the all-padding rows of units shorter than R.

Accepted inputs:

- a directory: every regular file under it, recursively, in order of relative path; hidden
  files and directories (names starting with '.') are left out, and so are non-regular files
  (FIFOs, sockets). A symlinked directory is followed (its files are named by the path
  through the link), once: a symlink to a directory that contains it (a loop) or to a
  directory already read under an earlier path is not followed, and is counted and named
  (``same_dir``). Each file is one document and one unit, named by its path relative to the
  directory. One file reached twice (a symlink to a file, or a hard link) is read once, under
  its first path, and counted (``same_file``): a second copy would be a second unit holding
  the same person's text. "First" is always the first in order of relative path.
- a ``.jsonl`` file: one JSON object per line with a string ``text`` and an optional unit key
  (``unit_key``, default ``"id"``: a string or an integer; an integer and its decimal string
  are the same unit) naming the unit. Documents sharing an id form ONE unit whose rows are each
  document's rows, in file order. Ids are compared as ``run_core.canonical_unit_id`` makes
  them (the unit's name too): Unicode NFKC (NFC vs NFD, fullwidth and compatibility forms
  fold together), case folded, invisible characters (zero-width spaces, soft hyphens, ...)
  removed, and whitespace runs (non-breaking spaces included) collapsed to one space and
  stripped: "Alice", " ALICE\t", "ａｌｉｃｅ" and "ali\u200bce" are one unit, and so are
  "alice\u00a0smith" and "alice  smith". Leading zeros are kept: "5" and "05" are two units
  (an id scheme may use both), while 5 and "5" are one. Ids are folded because merging two
  people into one unit only makes their guarantee conservative (each is protected as part of
  the larger unit), while splitting one person into k units silently costs them about k·ε.
  Either every line has the unit key or none does: a line without it in a file where other
  lines have it is an error naming the line. When no line has it, each line is its own unit,
  named ``line <k>`` (k counts from 1), unless a line has an id-like key (``ID``,
  ``user_id``, ...: another casing of the unit key, or a name ending in ``id``) or a
  person-like key (``author``, ``user``, ``email``, ``patient``, ``person``, ``name``,
  ``subject``, ``user_name``, ``author_email``, ...: a key that names a person), which is
  refused: pass that key as ``unit_key``, or ``unit_key=None`` to make each line its own unit
  on purpose. Blank lines are skipped; any other line that is not a JSON object with a string
  ``text`` (or whose id is neither a string nor an integer, null included, or is empty once
  canonical, or that repeats a key) is an error naming the line.
- a ``.txt`` file: one document per non-blank line (without its line ending), each its own
  unit named ``line <k>``.

Text is decoded as strict UTF-8 (a leading byte-order mark is dropped). A binary file of the
directory (not valid UTF-8, or over half NUL or other control characters) is skipped, counted
and named (``non_utf8``), never decoded lossily: a lossy decode would train on U+FFFD
replacement characters instead of the user's text and hide that the file was not what it seemed. A ``.jsonl`` or ``.txt`` input that is
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
import heapq
import json
import math
import os
import re
import shlex
from pathlib import Path
from typing import Callable, Sequence

import torch

from .errors import DataError
from .run_core import canonical_unit_id

ACCEPTED = "a directory of UTF-8 text files, a .jsonl file (one {\"text\": ..., \"id\": ...} object per line) " \
           "or a .txt file (one document per line)"


@dataclasses.dataclass
class Documents:
    """N privacy units of R rows of T tokens (see the module docstring).

    ``ids`` (N, R, T) long, padding ``pad_id``; ``labels`` is ``ids`` with -100 at every padding
    slot (labels, not ids, say where the tokens are: ``pad_id`` may be a real token). The per-unit
    lists count unit i's documents, tokens before truncation and tokens dropped by ``max_rows``.
    ``skipped`` counts the documents left out (``non_utf8``: binary, ``empty``, ``same_file``) and
    the symlinked directories not followed (``same_dir``); ``skipped_names`` names the first
    ``_NAMED`` of each (a relative path, or ``line k``); an eval/train split keeps both.
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
    unit_key: str | None = None  # the .jsonl field that named the units; None: a unit per file or line
    skipped_names: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # the first few of each

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

    num_documents = property(lambda self: sum(self.documents_per_unit))
    truncated_units = property(lambda self: sum(d > 0 for d in self.tokens_dropped_per_unit))
    tokens_dropped = property(lambda self: sum(self.tokens_dropped_per_unit))

    @property
    def tokens_total(self) -> int:
        return sum(self.tokens_total_per_unit)

    def pieces(self) -> list[list[list[int]]]:
        """Each unit as the token lists of its rows (padding left out): the pieces
        ``packing.pack_documents`` packs several units' of into one row."""
        return [[row[keep].tolist() for row, keep in zip(ids, labels != -100) if bool(keep.any())]
                for ids, labels in zip(self.ids, self.labels)]

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
                "skipped": dict(self.skipped), "skipped_names": {k: list(v) for k, v in self.skipped_names.items()},
                "source": self.source}

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
                         self.kind, self.unit_key, dict(self.skipped_names))

    def describe(self) -> str:
        what = "files" if self.kind == "directory" else "lines"
        s = self.skipped
        dirs = s.get("same_dir", 0)
        return (f"{self.num_units} units ({self.num_documents} documents), {self.num_tokens} tokens in "
                f"{self.num_rows} rows of {self.seq_len}, {self.rows_per_unit} rows per unit; {self.truncated_units} units "
                f"truncated ({self.tokens_dropped} tokens dropped); {s['non_utf8'] + s['empty'] + s['same_file']} "
                f"{what} skipped (binary or non-UTF-8: {s['non_utf8']}, empty: {s['empty']}, one file reached twice: "
                f"{s['same_file']})"
                + (f", {dirs} symlinked folder{'s' * (dirs != 1)} not followed" if dirs else "")
                + "".join(f"; {why}: {_listed(self.skipped_names[key], s[key])}"
                          for key, why in (("non_utf8", "binary or not UTF-8"), ("empty", "empty or under 2 tokens"),
                                           ("same_file", "read once already"),
                                           ("same_dir", "a symlink loop or a folder read once already"))
                          if self.skipped_names.get(key)))


_NAMED = 5  # skipped documents named per reason (the rest counted)


def _listed(names: list[str], count: int) -> str:
    return ", ".join(names) + (f" and {count - len(names)} more" if count > len(names) else "")


def _skip(skipped: dict, names: dict, reason: str, name: str) -> None:
    skipped[reason] += 1
    if len(names.setdefault(reason, [])) < _NAMED:
        names[reason].append(name)


# --- reading ---------------------------------------------------------------------------------

def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror or e}") from None


def _decode(data: bytes) -> str:
    """Strict UTF-8, a leading BOM dropped; raises UnicodeDecodeError."""
    return data.decode("utf-8-sig")


# C0 and C1 controls but tab, newlines, vertical tab and form feed. A file mostly of them is binary
# (4,096 NUL bytes are valid UTF-8); not one of them: a log with colour escapes stays a document.
_CONTROL = re.compile("[\x00-\x08\x0e-\x1f\x7f-\x9f]")


def _decode_or_fail(path: Path, data: bytes) -> str:
    try:
        return _decode(data)
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise DataError(f"{path}: not valid UTF-8 (line {line}, byte {e.start}); the file must be "
                       "UTF-8 text") from None


def _walk(root: Path, skipped: dict[str, int], names: dict[str, list[str]]) -> list[tuple[str, Path]]:
    """(relative posix path, path) of every non-hidden regular file under root, sorted.

    Directories are read in order of relative path (a heap), so the first path to reach a
    directory is the first in that order; a symlinked directory is followed unless it leads
    to a directory already read or to one that contains it (a loop), which is counted and named
    (``same_dir``)."""
    def fail(path, e: OSError):
        raise DataError(f"cannot list {e.filename or path}: {e.strerror or e}") from None

    found, seen, todo = [], set(), [("", root)]
    while todo:
        rel, d = heapq.heappop(todo)
        try:
            st = d.stat()  # follows a symlink: the directory itself
        except OSError as e:
            fail(d, e)
        if (st.st_dev, st.st_ino) in seen or (rel and d.is_symlink() and _contains(d.resolve(), d.parent.resolve())):
            _skip(skipped, names, "same_dir", rel)
            continue
        seen.add((st.st_dev, st.st_ino))
        try:
            with os.scandir(d) as it:
                entries = list(it)
        except OSError as e:
            fail(d, e)
        for entry in entries:
            if entry.name.startswith("."):
                continue
            r, p = f"{rel}/{entry.name}" if rel else entry.name, Path(d, entry.name)
            try:
                is_dir = entry.is_dir()  # follows symlinks; False for a broken one
            except OSError:
                is_dir = False
            if is_dir:
                heapq.heappush(todo, (r, p))
            elif p.is_file():
                found.append((r, p))
    found.sort(key=lambda f: f[0])
    return found


def _contains(outer: Path, inner: Path) -> bool:
    """Whether resolved ``inner`` is ``outer`` or lies under it."""
    return inner == outer or outer in inner.parents


def _lines(text: str):
    """(line number from 1, line without its ending); only \\n (and \\r\\n) end a line."""
    for k, line in enumerate(text.split("\n"), 1):
        yield k, line[:-1] if line.endswith("\r") else line


def _no_repeated_keys(pairs: list) -> dict:
    keys = [k for k, _ in pairs]
    repeated = sorted({k for k in keys if keys.count(k) > 1})
    if repeated:
        raise _RepeatedKey(repeated[0])
    return dict(pairs)


class _RepeatedKey(ValueError):
    pass


_ID_LIKE = re.compile(r"(^|[_\-\s.])id$|^uid$|^(user|author|person|patient|customer|client|owner|member|account|"
                      r"doc|document|record|subject)id$")


def _id_like(key: str, unit_key: str) -> bool:
    """A key that probably names a unit: another casing of ``unit_key``, ``user_id``, ``userId``, ``UID``..."""
    return (key.casefold() == unit_key.casefold() or bool(_ID_LIKE.search(key.casefold()))
            or bool(re.search(r"[a-z](Id|ID)$", key)))


# Words that, as a key or a word of one, name a person: a line carrying one probably belongs to
# that person, so training each line as its own unit would split them.
_PERSON_WORDS = frozenset({
    "author", "authors", "user", "users", "username", "email", "emails", "patient", "patients", "person",
    "persons", "people", "subject", "owner", "customer", "client", "member", "account", "sender",
    "recipient", "speaker", "writer", "creator", "contributor", "employee", "student", "participant",
    "respondent", "handle", "login", "fullname", "firstname", "lastname", "surname", "nickname",
    "displayname"})
# "name" names a person alone or with one of these ("first_name", "displayName"), not in "file_name".
_NAME_QUALIFIERS = frozenset({"first", "last", "full", "given", "family", "display", "nick", "real", "middle",
                              "maiden", "legal", "sur"})


def _person_like(key: str) -> bool:
    """A key that probably names a person: ``author``, ``user_name``, ``authorEmail``, ``e-mail``, ``name``..."""
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1 \2", key).casefold()  # camelCase -> words
    words = re.split(r"[^a-z0-9]+", re.sub(r"\be[-_ ]mail", "email", spaced))
    return (bool(_PERSON_WORDS.intersection(words))
            or ("name" in words and all(w in _NAME_QUALIFIERS for w in words if w and w != "name")))


def _unit_key_flag(key: str) -> str:
    return f"--unit-key {shlex.quote(key)}"


def _jsonl_documents(path: Path, unit_key: str | None):
    """(unit key, unit name, text) per non-blank line of a .jsonl file."""
    text = _decode_or_fail(path, _read(path))
    lines = []
    for k, line in _lines(text):
        if not line.strip():
            continue
        where = f"{path}:{k}"
        try:
            obj = json.loads(line, object_pairs_hook=_no_repeated_keys)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno}); each line must be one "
                           "JSON object") from None
        except _RepeatedKey as e:
            raise DataError(f"{where}: the key {json.dumps(str(e))} appears twice in one object; which value "
                           "names the unit (or holds the text) would be a guess") from None
        if not isinstance(obj, dict):
            raise DataError(f"{where}: expected a JSON object with a string \"text\", got {type(obj).__name__}")
        body = obj.get("text")
        if not isinstance(body, str):
            got = "no \"text\" field" if "text" not in obj else f"\"text\" is {type(body).__name__}"
            raise DataError(f"{where}: {got}; each line needs a string \"text\" field")
        if unit_key is not None and unit_key in obj:
            uid = obj[unit_key]
            if isinstance(uid, bool) or not isinstance(uid, (str, int)):
                raise DataError(f"{where}: {json.dumps(unit_key)} must be a string or an integer naming the privacy "
                               f"unit, got {json.dumps(uid)}")
            if not canonical_unit_id(uid):
                raise DataError(f"{where}: {json.dumps(unit_key)} is empty; it must name the privacy unit")
        lines.append((k, where, obj, body))
    keyed = [where for _, where, obj, _ in lines if unit_key is not None and unit_key in obj]
    if keyed and len(keyed) < len(lines):
        where = next(w for _, w, obj, _ in lines if unit_key not in obj)
        raise DataError(f"{where}: no {json.dumps(unit_key)} field, while other lines have one ({keyed[0]}): "
                       f"this line's document would become a unit of its own, apart from its person's other "
                       f"documents; give it its {json.dumps(unit_key)}")
    for k, where, obj, body in lines:
        if not keyed:
            keys = [key for key in obj if unit_key is not None and key != "text"]
            for kind, like in (("an id-like", [key for key in keys if _id_like(key, unit_key)]),
                               ("a person-like", [key for key in keys if _person_like(key)])):
                if like:
                    raise DataError(f"{where}: no {json.dumps(unit_key)} field but {kind} {json.dumps(like[0])}: if "
                                   f"it names the privacy unit pass it as the unit key ({_unit_key_flag(like[0])}); "
                                   "to make each line its own unit, pass --unit-key none")
            yield ("line", k), f"line {k}", body
            continue
        name = canonical_unit_id(obj[unit_key])
        yield ("id", name), name, body


def _txt_documents(path: Path):
    text = _decode_or_fail(path, _read(path))
    for k, line in _lines(text):
        if line.strip():
            yield ("line", k), f"line {k}", line


def _dir_documents(root: Path, skipped: dict[str, int], names: dict[str, list[str]]):
    seen = set()
    for rel, p in _walk(root, skipped, names):
        try:
            st = p.stat()  # follows a symlink: the file itself
        except OSError as e:
            raise DataError(f"cannot read {p}: {e.strerror or e}") from None
        if (st.st_dev, st.st_ino) in seen:
            _skip(skipped, names, "same_file", rel)
            continue
        seen.add((st.st_dev, st.st_ino))
        try:
            body = _decode(_read(p))
        except UnicodeDecodeError:
            body = None
        if body is None or 2 * len(_CONTROL.findall(body)) > len(body):
            _skip(skipped, names, "non_utf8", rel)
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
                   pad_id: int | None, unit_key: str | None = "id") -> Documents:
    """Load ``path`` (a directory, a .jsonl or a .txt file: see the module docstring) as
    :class:`Documents` of shape (N, R, T = seq_len), R = min(max_rows, most rows of any unit).
    ``encode(text) -> list[int]`` is the tokenizer; ``pad_id``: the id in padding slots, which
    are labelled -100 and come after every real token of their row, so any id does (None, as
    ``tok.pad_token_id`` is for Llama's and GPT-2's tokenizers: 0); ``unit_key``: the .jsonl
    field naming the unit (None: each line its own unit). Raises :class:`DataError` on user errors."""
    if pad_id is None:
        pad_id = 0
    if not isinstance(pad_id, int) or isinstance(pad_id, bool) or pad_id < 0:
        raise DataError(f"pad_id must be a token id (an int >= 0) or None, got {pad_id!r}")
    if seq_len < 2:
        raise DataError(f"the sequence length must be >= 2 (a next-token loss needs two tokens), got {seq_len}")
    if max_rows < 1:
        raise DataError(f"the rows per unit must be >= 1, got {max_rows}")
    p = Path(path)
    skipped, skipped_names = {"non_utf8": 0, "empty": 0, "same_file": 0, "same_dir": 0}, {}
    if p.is_dir():
        kind, docs = "directory", _dir_documents(p, skipped, skipped_names)
    elif not p.exists():
        raise DataError(f"no such file or directory: {path}; expected {ACCEPTED}")
    elif p.is_file() and p.suffix.lower() == ".jsonl":
        kind, docs = "jsonl", _jsonl_documents(p, unit_key)
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
            _skip(skipped, skipped_names, "empty", name)
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
        raise DataError(f"{path}: no usable document ({skipped['non_utf8']} skipped as binary or not UTF-8, "
                       f"{skipped['empty']} skipped as empty or under 2 tokens"
                       + (f", {skipped['same_dir']} symlinked folders not followed" if skipped['same_dir'] else "")
                       + f"); expected {ACCEPTED}")

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
    keyed = any(key[0] == "id" for key in units)
    return Documents(ids, labels, [u.name for u in order], T, [u.documents for u in order],
                     [u.tokens_total for u in order], [u.tokens_dropped for u in order], skipped,
                     str(path), kind, unit_key if keyed else None, skipped_names)
