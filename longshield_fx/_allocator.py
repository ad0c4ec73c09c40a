"""glibc malloc tuned for a training step on the CPU: freed memory is reused, not returned.

A step allocates the same large temporaries every time (activations, per-unit products, their
norms' blocks). glibc serves a block above its mmap threshold (128 KiB, raised on the fly up
to 32 MiB) with a fresh mapping and unmaps it when freed, and hands the top of its heap back
to the kernel once more than its trim threshold is free: then the next step touches fresh
pages, and the kernel zeroes each one in a page fault. On a 2-core CPU that was 10-25% of a
packed DP step (the per-unit products are many such blocks), 5-10% of an unpacked or eager
one. ``keep_freed_memory`` fixes the thresholds at 32 MiB (mmap: a block below it comes from
the heap) and 1 GiB (trim), once per process; the process's resident memory stays near its
peak, as it would under CUDA's caching allocator. Elsewhere than glibc it does nothing, nor
where the environment sets glibc's malloc (``MALLOC_*_`` variables or ``glibc.malloc`` tunables):
a process that chose how its memory is returned (a resident-set measurement) keeps its choice.
"""
from __future__ import annotations

import ctypes
import functools
import os
import platform

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


@functools.cache
def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds (see the module docstring); True if they were set."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    if any(k.startswith("MALLOC_") for k in os.environ) or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, 32 * 2 ** 20)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 2 ** 30))
