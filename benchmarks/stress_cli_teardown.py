"""Stress the end of a 4-rank CLI run beside concurrent ones (not run in CI).

``tests/cli/test_train.py::test_torchrun_fsdp_checkpoint_saved_on_4_ranks_resumes_on_2`` once
failed in CI because one rank aborted at the end of its run (``terminate called without an active
exception``, no Python frame on the main thread: the interpreter was finalizing), after every
step had run. This script runs that launch (4 ranks, ``--cp 2 --fsdp dp,cp``, a DCP checkpoint and
a held-out evaluation every step) ``--runs`` times while ``--beside`` copies of it run over and
over next to it, and prints a table: launches, failures, each failure's signature.

    python benchmarks/stress_cli_teardown.py --runs 200 --beside 1

What was found (``longshield_fx._torch.destroy_process_groups``): the groups' gloo threads outlived
``destroy_process_group`` into interpreter finalization on every rank, kept by the meshes
(``DeviceMesh._pg_registry``) and by ``torch.distributed.nn.functional``'s default arguments
(imported by DCP after the default group existed). The CLI now joins them before ``main`` returns
(checked by ``tests/runtime/test_parallel.py::test_a_run_ends_with_every_gloo_thread_joined_before_the_interpreter_finalizes``).

Before the fix the abort did not come back here: 0 of 65 launches, 2 or 3 side by side (2-core CPU,
2026-11-27). After it (commit ee4db92), ``--runs 80 --beside 1`` stopped at 73 launches, 0 failed;
the 73 launches beside it all reached rank 0's summary (their exit codes were not kept), 3661 s. The
rest of the 200, ``--runs 127 --beside 1`` at 4d58cd4 (same teardown, ``nice 10``, core dumps on):
127 launches, 0 failed; 128 launches beside them, 0 failed; 5431 s.
"""
from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from stress_dcp_resume import stress

from longshield_fx.cli.corpus import stdlib_files

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["train", "--steps", "3", "-T", "64", "--save-every", "1", "--max-files", "60", "--expected-batch-size", "5",
        "--physical-batch-size", "2", "--insecure-seed", "3", "--accountant", "rdp", "--sigma", "0.5",
        "--max-rows", "2", "--eval-fraction", "0.25", "--eval-every", "1", "--log-private-stats", "--no-pack",
        "--cp", "2", "--fsdp", "dp,cp"]


def launch(out: Path, data: Path, env: dict) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", "-m", "longshield_fx",
           *ARGS, "--data", str(data), "--out", str(out)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, check=False)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=200)
    p.add_argument("--beside", type=int, default=1, help="concurrent copies of the launch, relaunched in a loop")
    p.add_argument("--keep", default=None, help="folder for the failing launches' output (default: a temp dir)")
    a = p.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1", PYTHONPATH=str(ROOT))
    work = Path(tempfile.mkdtemp(prefix="stress-cli-"))
    keep = Path(a.keep) if a.keep else work / "failures"
    keep.mkdir(parents=True, exist_ok=True)
    data = work / "data"  # the user's documents: 60 files of Python's standard library
    data.mkdir()
    for i, f in enumerate(stdlib_files(60)):
        shutil.copy(f, data / f"{i:02d}_{f.name}.txt")
    failures, beside_runs = stress(a.runs, a.beside, keep, "launch", lambda i: launch(work / f"run{i}", data, env),
                                   lambda k, j: launch(work / f"beside{k}-{j}", data, env))
    beside_failed = sum(n for sig, n in beside_runs.items() if sig != "ok")
    print("| launches | failed | launches beside | of them failed |\n|---|---|---|---|")
    print(f"| {a.runs} | {sum(failures.values())} | {sum(beside_runs.values())} | {beside_failed} |")
    for sig, n in (failures + collections.Counter({s: n for s, n in beside_runs.items() if s != "ok"})).most_common():
        print(f"\n{n} x `{sig}`")
    print(f"\nfailing launches' output: {keep}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
