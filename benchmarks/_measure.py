"""Shared measuring helpers for the benchmark scripts: fresh processes, RSS peaks, medians."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Peak resident memory above the level at entry, sampled every 0.2 ms in a thread.

    Run with MALLOC_MMAP_THRESHOLD_ small (``fresh_process`` sets it) so freed tensors go
    back to the OS and RSS follows live memory.
    """

    def __enter__(self):
        self.base = rss_bytes()
        self.peak = self.base
        self._stop = False
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop:
            self.peak = max(self.peak, rss_bytes())
            time.sleep(0.0002)

    def __exit__(self, *exc):
        self._stop = True
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())
        self.bytes = self.peak - self.base


def steady_state_malloc() -> None:
    """Switch glibc to the mmap / trim thresholds (32 / 64 MiB) its dynamic tuning settles at.

    ``fresh_process`` starts workers with a 64 KiB mmap threshold so that RSS follows live
    memory for ``PeakRSS``; but then every new tensor page is a page fault, which a long
    training run does not pay and which penalises whichever configuration allocates more
    (recomputation most of all). Time steps after calling this and one untimed step that grows
    the heap. No-op without glibc.
    """
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 64 << 20)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        pass


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def fresh_process(script: str, *args: str, timeout: int = 1800) -> dict:
    """Run ``script --worker args`` in a new interpreter; it prints one JSON line last."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, script, "--worker", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    if proc.returncode != 0 or not lines:
        reason = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": reason[:120]}
    return json.loads(lines[-1])


def median(xs):
    return statistics.median(xs)
