"""The locked-memory check before verbs registers memory (verbs/rc.py), with the
real RLIMIT_MEMLOCK lowered in a child process: past the limit, without
CAP_IPC_LOCK, one line names the limit, the size and the fix; within it, or
with the capability (root's), nothing. Registration itself needs an RDMA
device (the VM); the kernel's own refusal there is a bare ENOMEM."""
import os
import resource
import subprocess
import sys

import pytest

CHILD = '''
import mmap, resource, sys
import numpy as np
from rdmatensor.errors import VerbsError
from rdmatensor.providers.verbs.rc import check_locked_memory
limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_MEMLOCK, (limit, limit))
for size in map(int, sys.argv[2:]):
    try:
        check_locked_memory(np.frombuffer(mmap.mmap(-1, size), np.uint8))     # page-aligned
        print(size, "ok")
    except VerbsError as exc:
        print(size, "refused:", exc)
'''
MIB = 1 << 20


def _check(limit: int, sizes: list[int], ipc_lock: bool) -> dict[int, str]:
    prefix = []
    if os.geteuid() == 0 and not ipc_lock:      # root without the capability, as a user is
        prefix = ["setpriv", "--bounding-set=-ipc_lock", "--inh-caps=-ipc_lock", "--"]
    run = subprocess.run(prefix + [sys.executable, "-c", CHILD, str(limit), *map(str, sizes)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return {int(size): rest for size, rest in (line.split(" ", 1) for line in run.stdout.splitlines())}


def test_past_the_limit_one_line_names_it_and_the_fix():
    page = resource.getpagesize()
    out = _check(8 * MIB, [16 * MIB, 1 * MIB, 8 * MIB, 8 * MIB + 1], ipc_lock=False)
    assert out[1 * MIB] == "ok" and out[8 * MIB] == "ok"
    refused = out[16 * MIB]
    assert refused.startswith("refused: registering 16 MiB for RDMA needs 16 MiB of locked memory"), refused
    for said in ("limit of 8 MiB", "RLIMIT_MEMLOCK", "ulimit -l unlimited", "/etc/security/limits.conf",
                 "docker run --ulimit memlock=-1"):
        assert said in refused, refused
    assert out[8 * MIB + 1].startswith(f"refused: registering {8 * 1024 + 1} KiB for RDMA needs "
                                       f"{(8 * MIB + page) // 1024} KiB of locked memory"), out  # pages, as the kernel


@pytest.mark.skipif(os.geteuid() != 0, reason="only root holds CAP_IPC_LOCK here")
def test_cap_ipc_lock_is_not_held_to_the_limit():
    assert _check(8 * MIB, [16 * MIB], ipc_lock=True) == {16 * MIB: "ok"}
