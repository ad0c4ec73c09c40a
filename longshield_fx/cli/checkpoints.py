"""Checkpoints of ``longshield-fx train``: writing one (atomically, into the run ledger), finding
the newest complete one, and refusing one written by a different run.

Checkpoints are SECRET: they hold the sampler's sampling key (which units each step sampled).
The engine's noise key is never saved: a resumed engine draws a fresh one.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

import torch

from .common import CLIError, say

CHECKPOINT_FORMAT = 2  # 2: the secret sampling stream (no noise key), one row per document
_CKPT_RE = re.compile(r"^ckpt-(\d{8})\.pt$")


def _fsync_dir(path: Path):
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_save(obj, path: Path, before_replace=None):
    """torch.save to a temp file in the same folder, fsync, then os.replace: a reader sees the
    old file or the complete new one, never a partial one (the temp name never matches ckpt-*.pt).
    ``before_replace`` is called once the temp file is whole, before it takes its name."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        if before_replace is not None:
            before_replace()
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints in ``folder``, newest first (temp files never match)."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _CKPT_RE.match(p.name)) and p.is_file()]
    return sorted(found, reverse=True)


def resolve_resume(resume: str) -> tuple[Path, Path]:
    """(run dir, checkpoints dir) from --resume DIR (the run's --out or its checkpoints/ folder)."""
    d = Path(resume)
    if not d.is_dir():
        raise CLIError(f"--resume: no such directory: {resume}")
    if list_checkpoints(d) and d.name == "checkpoints":
        return d.parent, d
    if checkpoint_dir(d).is_dir():
        return d, checkpoint_dir(d)
    if list_checkpoints(d):
        return d, d
    raise CLIError(f"--resume: no checkpoint (ckpt-<step>.pt) in {resume} or {checkpoint_dir(d)}")


def load_latest(folder: Path) -> tuple[dict, Path]:
    skipped = []
    for _, path in list_checkpoints(folder):
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - a damaged file: fall back to an older one
            skipped.append(f"{path.name} ({type(e).__name__})")
            continue
        if isinstance(state, dict) and state.get("format") == CHECKPOINT_FORMAT and state.get("complete"):
            if skipped:
                say(f"warning: skipped unreadable checkpoint(s) {', '.join(skipped)}", file=sys.stderr)
            return state, path
        skipped.append(f"{path.name} (not a longshield-fx checkpoint)")
    raise CLIError(f"--resume: no complete checkpoint in {folder}" + (f"; unreadable: {', '.join(skipped)}" if skipped else ""))


def _flatten(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def signature_diff(saved: dict, now: dict) -> list[str]:
    """'key: X in the checkpoint, Y now' for every differing (flattened) key, in signature order."""
    a, b = _flatten(saved), _flatten(now)
    missing = object()

    def fmt(v, other):
        if v is missing:
            return "unset"
        if isinstance(v, float) and isinstance(other, float) and f"{v:.6g}" != f"{other:.6g}":
            return f"{v:.6g}"
        return repr(v)

    diffs = []
    for key in list(b) + [k for k in a if k not in b]:
        va, vb = a.get(key, missing), b.get(key, missing)
        if va != vb:
            diffs.append(f"{key}: {fmt(va, vb)} in the checkpoint, {fmt(vb, va)} now")
    return diffs


def jsonable(obj):
    return json.loads(json.dumps(obj, default=str))


# Flags that may change between the sessions of one run: where and how often it writes, what it logs,
# and the layout it runs on (a checkpoint resumes on any world size).
PER_SESSION = {"out", "resume", "save_every", "keep_checkpoints", "eval_every", "log_private_stats", "device",
               "cp", "fsdp", "fork"}


def saved_flags(args) -> dict:
    """The run's flags, as a checkpoint keeps them for ``--resume DIR``."""
    skip = {"func", "command", "argv"} | PER_SESSION
    return jsonable({k: v for k, v in vars(args).items() if k not in skip})


def save_checkpoint(job, step: int) -> None:
    """Rank 0 writes ckpt-<step>.pt atomically and keeps the newest --keep-checkpoints. With
    --fsdp every rank first writes its shards into the DCP folder ckpt-<step>.dcp/, which the
    .pt file (written last: a checkpoint is complete when it exists) names."""
    import torch.distributed as dist

    import longshield_fx as lf

    folder = checkpoint_dir(job.run_dir)
    if job.fsdp:
        dcp_name = f"ckpt-{step:08d}.dcp"
        # The ledger is written once the shards are (before the .pt that names them, below): a save
        # cut by a kill leaves a DCP folder no load reads, whose steps a restart redraws freely.
        lf.save_checkpoint(folder / dcp_name, job.engine, job.opt, job.batches, run_dir=None)
        dist.barrier()
        held = {"dcp": dcp_name, "model": None, "optimizer": None, "sampler": None, "engine": None}
    elif job.rank0:
        held = {"model": job.model.state_dict(), "optimizer": job.opt.state_dict(),
                "sampler": job.batches.state_dict(), "engine": job.engine.state_dict()}
    if not job.rank0:
        return
    state = {  # SECRET: the sampler's state holds the sampling key
        "format": CHECKPOINT_FORMAT, "complete": True, "step": step, "signature": job.signature,
        "args": saved_flags(job.args),
        **held, "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state() if job.device.type == "cuda" else None,
        "tokens": job.tokens_seen, "elapsed_s": job.elapsed_before + (time.time() - job.t_loop),
    }
    # Into the ledger once the file is whole and before it takes its name: a save cut by a kill is
    # a temp file no load reads, and a restart redraws its steps freely.
    atomic_save(state, folder / f"ckpt-{step:08d}.pt",
                before_replace=lambda: job.ledger.record(job.engine, job.batches, "checkpoint"))
    for _, old in list_checkpoints(folder)[job.args.keep_checkpoints:]:
        old.unlink(missing_ok=True)
        shutil.rmtree(old.with_suffix(".dcp"), ignore_errors=True)
