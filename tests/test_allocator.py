"""``_allocator.keep_freed_memory``: set once per process on glibc, and left alone where the
environment chose glibc's malloc settings itself."""
import os
import platform
import subprocess
import sys

import pytest

CHECK = "from longshield_fx._allocator import keep_freed_memory as k; print(k(), k())"


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
@pytest.mark.parametrize("setting, expected", [({}, "True True"), ({"MALLOC_MMAP_THRESHOLD_": "65536"}, "False False"),
                                               ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}, "False False")])
def test_set_on_glibc_unless_the_environment_chose(setting, expected):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", CHECK], env={**env, **setting}, capture_output=True, text=True,
                         check=True).stdout.split()
    assert " ".join(out) == expected
