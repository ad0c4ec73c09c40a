"""Reproduce torch's gloo worker-thread race with torch alone, and show one thread removes it.

torch's ProcessGroupGloo runs asynchronous collectives on two worker threads; each thread,
after finishing one, writes its name into the group's shared status
(``ProcessGroupGloo::runLoop``: ``pgStatus_->lastCompletedWorkName = opTypeToString(...)``)
outside the work lock. Two collectives that finish together race on that std::string: a double
free (AddressSanitizer: "attempting double-free ... in c10d::ProcessGroupGloo::runLoop", freed
by the other worker thread), seen as glibc's "malloc(): unaligned tcache chunk detected", a
segfault, or a heap corrupted in silence. longshield_fx's overlap pass keeps several
collectives in flight, so its 4-rank CI launches aborted now and then (issue 35).

This script uses nothing of longshield_fx: each launch starts 4 gloo ranks (torchrun) that
issue 16 functional all-gathers, compute a little, and wait for them, ``--iters`` times. It
runs ``--launches`` launches with torch's gloo (two worker threads) and as many with the same
gloo made with one worker thread (``ProcessGroupGloo._Options._threads = 1``, registered as a
backend: what ``longshield_fx._torch.serial_gloo`` does), and prints a table. Freed memory is
filled (``MALLOC_PERTURB_``) so that a race that corrupts shows as a crash.

    python benchmarks/stress_gloo_race.py --launches 10 --iters 3000

Measured (2-core CPU, torch 2.13): see docs/guides/distributed.md.
"""
from __future__ import annotations

import argparse
import datetime
import os
import re
import subprocess
import sys
import tempfile
import time

SIGNATURE = re.compile(r"malloc\(\)[^\n]*|free\(\)[^\n]*|double free[^\n]*|Fatal Python error[^\n]*|"
                       r"exitcode\s*:\s*-?\d+[^\n]*")


def rank_main(backend: str, iters: int) -> None:
    import torch
    import torch.distributed as dist

    if backend == "serial":
        def one_thread_gloo(store, rank, size, timeout):
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timeout
            options._devices = [dist.ProcessGroupGloo.create_default_device()]
            options._threads = 1
            return dist.ProcessGroupGloo(store, rank, size, options)

        dist.Backend.register_backend("serial_gloo", one_thread_gloo, devices=["cpu"])
    dist.init_process_group("serial_gloo" if backend == "serial" else "gloo",
                            timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    c10d, name = torch.ops._c10d_functional, dist.group.WORLD.group_name
    a = torch.randn(128, 128)
    for _ in range(iters):
        outs = [c10d.all_gather_into_tensor(torch.full((256 * (1 + i % 3),), float(rank)), world, name)
                for i in range(16)]
        for _ in range(4):  # the main thread computes while the workers finish
            a = torch.tanh(a @ a)
        for i, out in enumerate(outs):
            out = c10d.wait_tensor(out)
            assert bool((out.view(world, -1) == torch.arange(world)[:, None]).all()), "wrong all-gather"
    dist.destroy_process_group()


def launch(backend: str, iters: int) -> tuple[str, float]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1", MALLOC_PERTURB_="165")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", __file__,
           "--rank", backend, "--iters", str(iters)]
    start = time.time()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=900, check=False)
        log.seek(0)
        text = log.read()
    if proc.returncode == 0:
        return "ok", time.time() - start
    found = SIGNATURE.findall(text)
    return (found[0].strip() if found else f"exit {proc.returncode}"), time.time() - start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--launches", type=int, default=10)
    p.add_argument("--iters", type=int, default=3000)
    p.add_argument("--rank", default=None, help=argparse.SUPPRESS)  # set in the ranks torchrun starts
    a = p.parse_args()
    if a.rank:
        rank_main(a.rank, a.iters)
        return 0
    print(f"{'gloo worker threads':<22}{'launches':>9}{'crashed':>9}  first failure")
    for backend, label in (("gloo", "2 (torch's default)"), ("serial", "1")):
        results = [launch(backend, a.iters) for _ in range(a.launches)]
        failed = [r for r, _ in results if r != "ok"]
        print(f"{label:<22}{len(results):>9}{len(failed):>9}  {failed[0] if failed else '-'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
