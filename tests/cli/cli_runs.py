"""Helpers the CLI tests share: launching the CLI in a fresh process and reading a run's files."""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
# Small corpus and sequences: a step of the tiny model takes well under a second.
FAST = ["--max-files", "60", "--expected-batch-size", "6", "--physical-batch-size", "4"]
SHORT = ["train", "--steps", 12, "-T", 128, "--save-every", 2, *FAST]
PYTHON_M = [sys.executable, "-m", "longshield_fx"]


def env() -> dict:
    out = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    out.pop("LONGSHIELD_FX_DEBUG", None)
    # One thread per process: the shapes are tiny, and spinning OpenMP threads make the runs
    # much slower when the machine is shared (and torchrun sets the same).
    out.setdefault("OMP_NUM_THREADS", "1")
    return out


def run_cli(*args, cwd, timeout=300, launcher=None):
    cmd = (launcher or PYTHON_M) + [str(a) for a in args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env(), check=False)


def run_in_process(argv, cwd) -> subprocess.CompletedProcess:
    """``longshield-fx ARGV`` in this process (no interpreter start-up), its output captured."""
    from longshield_fx import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.chdir(cwd), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main([str(a) for a in argv])
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def reported_epsilon(stdout: str) -> tuple[float, str]:
    m = re.search(r"privacy: ε = ([0-9.]+)(.*)", stdout)
    assert m, stdout
    return float(m.group(1)), m.group(2)


def train_losses(rows: list[dict]) -> list:
    return [r["not_covered_by_dp"]["train_loss"] for r in rows]


def load_state(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def assert_bit_identical(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k, x in a.items():
        assert x.dtype == b[k].dtype and torch.equal(x, b[k]), k


def metric_rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def printed_deprecations(caught) -> list[str]:
    """The deprecation warnings of ``warnings.catch_warnings(record=True)`` that Python's default
    filters print (FutureWarning always; DeprecationWarning only from __main__, never ours)."""
    return [f"{w.category.__name__}: {w.message}" for w in caught
            if issubclass(w.category, FutureWarning) or "deprecat" in str(w.message).lower()
            and not issubclass(w.category, (DeprecationWarning, PendingDeprecationWarning))]
