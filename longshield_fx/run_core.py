"""A private run's book-keeping, shared by every front door (``longshield-fx train`` and
``audit``, ``longshield_fx.hf.DPTrainer`` / ``DPSFTTrainer``, and the engine-loop helpers
``save_checkpoint`` / ``load_checkpoint``): what a unit is, how δ and σ are chosen, what the
release file says, and the run ledger that keeps a run's history in its folder.

One copy of each rule, so the front doors cannot drift apart:

- ``canonical_unit_id``: when two unit ids name the same person.
- ``default_delta`` / ``DELTA_RULE`` and ``calibrated_sigma``: δ from N, σ from the target ε
  (computed on rank 0 and broadcast).
- ``privacy_record`` / ``write_privacy_record``: privacy.json, the release file.
- ``RunLedger``: every step whose update left the process, appended and fsync'd before it
  leaves; loading a state older than the ledger's newest step is refused unless the caller
  forks, and a fork's ε composes every step in the ledger.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import unicodedata
from collections import Counter
from pathlib import Path

__all__ = ["DELTA_RULE", "LEDGER", "PRIVACY_FILE", "SAMPLE_RATE_CHOSEN", "SAMPLE_RATE_DERIVED", "RollbackRefused",
           "RunLedger", "calibrated_sigma", "canonical_unit_id", "default_delta", "privacy_record", "stream_digest",
           "write_privacy_record"]


# Characters that render as nothing: a unit id typed or pasted with one is the same person's.
_INVISIBLE = re.compile("[\u00ad\u180e\u200b-\u200f\u2060-\u2064\ufeff]")


def canonical_unit_id(uid: str | int) -> str:
    """The unit an id names: an integer's decimal string; text NFKC-normalised (fullwidth and
    compatibility forms folded), case-folded, invisible characters removed, whitespace runs
    (non-breaking spaces included) collapsed to one space and stripped.

    Folding only ever merges ids: two people merged into one unit are each protected as part of
    the larger unit (conservative), while one person split into k units silently costs them
    about k·ε. Leading zeros are kept: "5" and "05" stay two units (an id scheme may use both).

    >>> canonical_unit_id(" ＡＬＩＣＥ\\u00a0 Smith\\u200b") == canonical_unit_id("alice smith") == "alice smith"
    True
    >>> canonical_unit_id(5) == canonical_unit_id("5") != canonical_unit_id("05")
    True
    """
    if isinstance(uid, bool):
        raise TypeError("a unit id is a string or an integer, not a bool")
    if isinstance(uid, int):
        return str(uid)
    text = unicodedata.normalize("NFKC", str(uid))
    text = unicodedata.normalize("NFKC", text.casefold())  # casefold can leave a non-NFKC string
    return " ".join(_INVISIBLE.sub("", text).split())


DELTA_RULE = "the largest power of ten <= min(1e-5, N^-1.1)"


def default_delta(num_units: int) -> float:
    """δ = the largest power of ten ≤ min(1e-5, N^-1.1): well below 1/N (Ponomareva et al. 2023,
    "How to DP-fy ML", recommend δ ≪ 1/N), so a mechanism that releases one whole record with
    probability δ leaks far less than one record in expectation (N·δ ≤ N^-0.1). A power of ten,
    because δ is published with ε and N is private: δ then tells N's order of magnitude at most."""
    return 10.0 ** math.floor(math.log10(min(1e-5, float(num_units) ** -1.1)) + 1e-12)


# --- σ ----------------------------------------------------------------------------------------

def calibrated_sigma(target_epsilon: float, delta: float, sample_rate: float, steps: int, accountant: str) -> float:
    """The smallest σ whose ε after ``steps`` steps at ``sample_rate`` is ≤ ``target_epsilon`` at
    ``delta``: computed on rank 0 and broadcast, so every rank of a run adds noise of one scale."""
    from .runtime.calibration import calibrate_noise_on_rank_0

    return calibrate_noise_on_rank_0(target_epsilon, delta, sample_rate, steps, method=accountant)


# --- privacy.json -----------------------------------------------------------------------------

PRIVACY_FILE = "privacy.json"
SAMPLE_RATE_CHOSEN = "chosen: public"
SAMPLE_RATE_DERIVED = ("derived: the expected batch size E over the number of units N, which is private and not "
                       "written here (q and E together give N; choosing the sample rate publishes q as a choice "
                       "instead)")


def privacy_record(engine, *, delta: float, delta_given: bool, unit: str, sample_rate: float,
                   sample_rate_chosen: bool, model, insecure_seed: int | None, not_covered: str, final: bool,
                   **extra) -> dict:
    """privacy.json: the guarantee of ``engine``'s model as trained so far, a model-card fragment.
    ``final``: the run's release (else a checkpoint's copy, which says so). ``extra``: fields of
    one front door (its settings), written after the common ones."""
    from importlib.metadata import version

    config, accountant = engine.config, engine.accountant
    record = {
        "epsilon": engine.epsilon(delta), "delta": delta, "accountant": f"{config.accountant.upper()} (dp-accounting)",
        "delta_rule": "given" if delta_given else DELTA_RULE,
        "privacy_unit": unit,
        "mechanism": "DP-SGD: Poisson sampling of units, per-unit gradient clipping, Gaussian noise",
        "sample_rate": sample_rate, "sample_rate_source": SAMPLE_RATE_CHOSEN if sample_rate_chosen else SAMPLE_RATE_DERIVED,
        "noise_multiplier": config.noise_multiplier, "steps": accountant.steps,
        "max_grad_norm": config.max_grad_norm, "clipping": config.clipping,
        "trained_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "privacy_void": insecure_seed is not None, "insecure_seed": insecure_seed,
        "release": "final" if final else ("a checkpoint's copy: the guarantee of this checkpoint's model as trained so "
                                          "far, NOT the run's final release"),
        "fork": _fork_summary(accountant),
        "not_covered": not_covered,
        "library": f"longshield_fx {version('longshield_fx')}",
    }
    record.update(extra)
    return record


def _fork_summary(accountant) -> dict | None:
    elsewhere = accountant.released_elsewhere
    if not elsewhere:
        return None
    return {"steps_released_by_other_branches": len(elsewhere),
            "epsilon_covers": "every step in the run ledger: this branch's and the other branches' (a batch redrawn "
                              "with fresh noise counts as the same subsampled batch released twice; a batch of another "
                              "sampling stream as a draw of its own)"}


def write_privacy_record(folder, record: dict) -> Path:
    """``folder``/privacy.json, replaced atomically."""
    path = Path(folder) / PRIVACY_FILE
    tmp = path.with_name(f".{PRIVACY_FILE}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, path)
    return path


# --- the run ledger ---------------------------------------------------------------------------

LEDGER = "privacy_ledger.jsonl"


class RollbackRefused(ValueError):
    """Loading a state older than the run ledger's newest released step (the message says how to fork)."""


class RunLedger:
    """The history of a private run, kept in its folder (``privacy_ledger.jsonl``): one line per
    step whose update left the process (into a checkpoint, an evaluation, a log of the released
    gradient, the final model), appended, flushed and fsync'd before it leaves. A line holds the
    step, σ, q, the branch that took it and a digest of its sampling stream (never the key).

    Loading a state older than the ledger's newest step (``admit``) is refused unless the caller
    forks. A fork's accountant composes every step in the ledger: a step redrawn from the same
    sampling stream is the same subsampled batch released again with fresh noise (both releases
    together: one Poisson-sampled Gaussian step at σ/√2), a step of another stream an independent
    draw. Steps a process took but never let out (lost in a crash before any save or release)
    are not in the ledger: nothing of them was released, and a restart redraws them freely.

    ``folders``: the run's folder first, then folders that hold the same run's history (the run a
    resume continued from, in another folder): every line goes to each, and each is read.
    Nothing protects a run whose folders are deleted: a ledger is the run's memory.
    """

    def __init__(self, *folders) -> None:
        self.paths = [Path(f) / LEDGER for f in dict.fromkeys(str(Path(f)) for f in folders if f is not None)]

    def records(self) -> list[dict]:
        """Every step line of every folder's ledger, once each (a line cut by a kill is skipped)."""
        seen = {}
        for path in self.paths:
            try:
                text = path.read_text()
            except FileNotFoundError:
                continue
            for line in text.splitlines():
                try:
                    rec = json.loads(line)
                    key = (rec["branch"], int(rec["step"]))
                except (ValueError, KeyError, TypeError):
                    continue
                seen.setdefault(key, rec)
        return sorted(seen.values(), key=lambda r: (int(r["step"]), r["branch"]))

    def newest(self) -> int:
        return max((int(r["step"]) for r in self.records()), default=0)

    def record(self, engine, sampler=None, why: str = "saved") -> int:
        """Append the steps ``engine``'s branch took since the last record (``why``: what lets
        them out); returns how many. Call it before the update leaves the process."""
        branch, taken = engine.ledger_branch, engine.accountant.steps
        if taken <= branch.recorded:
            return 0
        stream = stream_digest(sampler.state_dict() if sampler is not None else None)
        lines = "".join(json.dumps({"step": step, "sigma": s, "q": q, "branch": branch.id, "stream": stream,
                                    "why": why}) + "\n"
                        for step, (s, q) in enumerate(engine.accountant.step_parameters(branch.recorded + 1, taken),
                                                      branch.recorded + 1))
        for path in self.paths:
            _append_lines(path, lines)
        added, branch.recorded = taken - branch.recorded, taken
        return added

    def admit(self, state: dict | None, *, fork: bool, fork_hint: str, where: str) -> list:
        """Check a state about to be loaded (an engine ``state_dict``, or None for a fresh start)
        against the ledger; returns what other branches released, for
        ``Engine.load_state_dict(released_elsewhere=...)``: the ledger's lines the state's own
        history does not count, merged with the state's own account of other branches (each entry
        as often as the larger of the two counts it: a ledger that lost lines never lowers ε).
        Raises ``RollbackRefused`` for an older state unless ``fork``; the ledger's lines are
        copied into every folder of this ledger."""
        records = self.records()
        accountant = (state or {}).get("accountant", {"history": []})
        steps = sum(int(n) for _, _, n in accountant["history"])
        self.refuse_older(steps, max((int(r["step"]) for r in records), default=0), fork=fork, where=where,
                          what="this state" if state is not None else "this run, starting over,", fork_hint=fork_hint)
        self.sync(records)
        stream = stream_digest((state or {}).get("sampler"))
        kept: dict[int, int] = {}  # step -> lines of it the state's own history already counts
        elsewhere = []
        for rec in records:
            step = int(rec["step"])
            if rec.get("stream") == stream and state is not None:
                if step <= steps and kept.get(step, 0) == 0:
                    kept[step] = 1
                    continue
                elsewhere.append((step, float(rec["sigma"]), float(rec["q"])))
            else:
                elsewhere.append((None, float(rec["sigma"]), float(rec["q"])))
        own = Counter((None if e[0] is None else int(e[0]), float(e[1]), float(e[2]))
                      for e in accountant.get("released_elsewhere", ()))
        return list((Counter(elsewhere) | own).elements())

    def refuse_older(self, step: int, newest: int | None = None, *, fork: bool, where: str, what: str,
                     fork_hint: str) -> None:
        """Raise ``RollbackRefused`` (one line: the newer step, the way out) when ``step`` is older
        than the ledger's ``newest`` step (default: read), unless ``fork``."""
        newest = self.newest() if newest is None else newest
        if step < newest and not fork:
            raise RollbackRefused(
                f"{where}: the run ledger {self.paths[0]} records step {newest}, released, and {what} is at step "
                f"{step}: continuing would redraw released steps with fresh noise and under-report ε; nothing was "
                f"changed. Continue from the newest checkpoint, pass a new output folder, or {fork_hint} to fork (ε "
                "then covers every step in the ledger, both branches)")

    def sync(self, records: list[dict] | None = None) -> None:
        """Copy into every folder's ledger the lines it lacks of ``records`` (default: all)."""
        records = self.records() if records is None else records
        for path in self.paths:
            held = {(r["branch"], int(r["step"])) for r in RunLedger(path.parent).records()}
            missing = [r for r in records if (r["branch"], int(r["step"])) not in held]
            if missing:
                _append_lines(path, "".join(json.dumps(r) + "\n" for r in missing))


def _append_lines(path: Path, lines: str) -> None:
    """Append ``lines`` to the ledger ``path``, flushed and fsync'd, on a line of their own: a line
    cut by a kill (no newline at its end) stays the one line ``records`` skips, instead of taking
    the first new line with it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as f:
        if f.tell() > 0:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                lines = "\n" + lines
        f.write(lines.encode())
        f.flush()
        os.fsync(f.fileno())


def stream_digest(sampler_state: dict | None) -> str:
    """A sampling stream's name in the ledger: a digest of its secret key (which it does not
    reveal), so that a redraw of a step is known to be the same subsampled batch."""
    if sampler_state is None:
        return "no sampler"
    key = bytes(sampler_state["stream"]["key"])
    return hashlib.sha256(b"longshield_fx run ledger\0" + key).hexdigest()[:32]
