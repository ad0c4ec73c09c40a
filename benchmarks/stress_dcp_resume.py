"""Stress the 4 -> 2 rank DCP resume beside concurrent 4-rank launches (not run in CI).

The resume launch of ``tests/runtime/test_parallel.py::test_a_sharded_run_saved_on_4_ranks_resumes_on_2``
once aborted in 2 of 40 launches with glibc's ``malloc(): unaligned tcache chunk detected`` while
other torchrun jobs ran beside it (issue 35). This script saves the checkpoints once (4 ranks,
``cp_worker.py OUT dcp_save``), then runs the 2-rank resume ``--runs`` times while ``--beside``
4-rank save launches run over and over next to it, and prints a table: launches, failures, and
each failure's signature (the first line naming an abort, a signal or an error).

    python benchmarks/stress_dcp_resume.py --runs 200 --beside 1 [--env MALLOC_PERTURB_=165 ...]

The cause was torch's gloo worker-thread race (``benchmarks/results/gloo_race.md``); since the
workers make their groups with ``serial_gloo`` (one worker thread) and the resume worker tears
down normally (``destroy_process_group``, no ``os._exit``): 40 resumes beside 47 4-rank save
launches, freed memory filled (``--env MALLOC_PERTURB_=165``), 0 failed (2-core CPU, 2026-11-26); in
one run of ``--runs 200 --beside 1 --env MALLOC_PERTURB_=165`` at 81f6051, 200 resumes beside 209
4-rank save launches, 0 failed of either (other test runs beside it, 9716 s, 2026-11-27).
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "runtime" / "cp_worker.py"
SIGNATURE = re.compile(r"malloc\(\)[^\n]*|free\(\)[^\n]*|double free[^\n]*|terminate called[^\n]*|"
                       r"Fatal Python error[^\n]*|ERROR: AddressSanitizer[^\n]*|Segmentation fault[^\n]*|"
                       r"exitcode\s*:\s*-?\d+[^\n]*")


def launch(nproc: int, args: list[str], env: dict) -> subprocess.CompletedProcess:
    Path(args[0]).mkdir(parents=True, exist_ok=True)  # the worker's output folder
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(WORKER), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, check=False)


def signature(proc: subprocess.CompletedProcess) -> str:
    found = SIGNATURE.findall(proc.stdout + proc.stderr)
    return found[0].strip() if found else f"exit {proc.returncode}"


def stress(runs: int, beside: int, keep: Path, what: str, run_one, run_beside):
    """``run_one(i)`` for i < ``runs`` while ``beside`` threads call ``run_beside(k, j)`` over and
    over; each returns a finished process. Returns (failures, beside's outcomes), Counters of
    signatures ("ok" for beside's successes); a failing run's output goes to ``keep``."""
    stop = threading.Event()
    beside_runs = collections.Counter()

    def keep_busy(k: int):
        j = 0
        while not stop.is_set():
            j += 1
            proc = run_beside(k, j)
            beside_runs["ok" if proc.returncode == 0 else signature(proc)] += 1

    threads = [threading.Thread(target=keep_busy, args=(k,), daemon=True) for k in range(beside)]
    for t in threads:
        t.start()
    failures = collections.Counter()
    start = time.time()
    for i in range(runs):
        proc = run_one(i)
        if proc.returncode != 0:
            failures[signature(proc)] += 1
            (keep / f"{what}{i}.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
        print(f"\r{i + 1}/{runs} {what}s, {sum(failures.values())} failed, {time.time() - start:.0f} s",
              end="", file=sys.stderr, flush=True)
    stop.set()
    for t in threads:
        t.join()
    print(file=sys.stderr)
    return failures, beside_runs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=200)
    p.add_argument("--beside", type=int, default=1, help="concurrent 4-rank save launches, relaunched in a loop")
    p.add_argument("--env", action="append", default=[], metavar="K=V", help="extra environment for the resumes")
    p.add_argument("--keep", default=None, help="folder for the failing launches' output (default: a temp dir)")
    a = p.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1", PYTHONPATH=str(ROOT))
    resume_env = dict(env, **dict(kv.split("=", 1) for kv in a.env))
    work = Path(tempfile.mkdtemp(prefix="stress-dcp-"))
    keep = Path(a.keep) if a.keep else work / "failures"
    keep.mkdir(parents=True, exist_ok=True)
    saved = launch(4, [str(work / "save"), "dcp_save"], env)
    if saved.returncode != 0:
        print(saved.stderr[-3000:], file=sys.stderr)
        return 1
    failures, beside_runs = stress(
        a.runs, a.beside, keep, "resume",
        lambda i: launch(2, [str(work / f"resume{i}"),
                             f"--resume={work / 'save' / 'dcp'},{work / 'save' / 'dcp_noisy'}"], resume_env),
        lambda k, i: launch(4, [str(work / f"beside{k}"), "dcp_save"], env))
    beside_failed = sum(n for sig, n in beside_runs.items() if sig != "ok")
    print("| resumes | failed | launches beside | of them failed | environment |\n|---|---|---|---|---|")
    print(f"| {a.runs} | {sum(failures.values())} | {sum(beside_runs.values())} | {beside_failed} | "
          f"{' '.join(a.env) or '-'} |")
    for sig, n in failures.most_common():
        print(f"\n{n} x `{sig}`")
    print(f"\nfailing launches' output: {keep}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
