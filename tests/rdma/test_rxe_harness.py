"""On a real RDMA device (SoftRoCE in the VM here): the device is up, pyverbs
registers numpy memory, a one-sided write lands intact, perftest runs."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench.perftest import run_write_bw
from rdmatensor.devices import list_devices
from rdmatensor.errors import RdmaTensorError

pytestmark = pytest.mark.rdma
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rdma_write.py"


def test_device_listed_active_with_roce_v2_gid(rdma_port):
    dev, port = rdma_port
    assert dev.name in [d.name for d in list_devices()]
    assert port.state == "ACTIVE"
    assert port.roce_v2_gid() is not None or port.link_layer == "InfiniBand"
    out = subprocess.run(["ibv_devices"], capture_output=True, text=True, check=True).stdout
    assert dev.name in out
    cli = subprocess.run([sys.executable, "-m", "rdmatensor", "devices", "--json"],
                         capture_output=True, text=True, check=True)
    info = json.loads(cli.stdout)
    assert info["providers"]["verbs"]["viable"], info["providers"]["verbs"]


@pytest.mark.parametrize("dtype", [np.uint8, np.float16, np.float32, np.int64, np.complex128])
def test_register_numpy_buffers(rdma_port, dtype):
    from rdmatensor.providers.verbs.pyverbs_endpoint import RcEndpoint
    arr = np.arange(4099, dtype=dtype)
    with RcEndpoint() as ep:
        mr = ep.register(arr)
        region = ep.remote_region(arr, mr)
        assert region.addr == arr.ctypes.data
        assert region.length == arr.nbytes == mr.length
        assert mr.rkey != 0
        with pytest.raises(RdmaTensorError, match="C-contiguous"):
            ep.register(np.zeros((8, 8), dtype=dtype)[:, ::2])
    ep.close()  # idempotent


@pytest.mark.parametrize("size", [1, 4096 + 3, 4 << 20])
def test_write_with_imm_lands_byte_identical(rdma_port, size):
    port = 18700 + size % 97
    out = subprocess.run([sys.executable, str(EXAMPLE), "local", "--size", str(size),
                          "--port", str(port), "--seed", str(size)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    server, client = (json.loads(line) for line in out.stdout.splitlines())
    assert server["side"] == "server" and client["side"] == "client"
    expected = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    import hashlib
    assert server["sha256"] == client["sha256"] == hashlib.sha256(expected).hexdigest()
    assert server["imm"] == client["imm"] == 0x5EED0001
    assert server["bytes"] == size


def test_perftest_write_bw_runs_and_parses(rdma_port):
    dev, port = rdma_port
    gid = port.roce_v2_gid()
    result = run_write_bw(dev.name, gid.index if gid else 0, 1 << 20, iterations=100)
    assert result.size == 1 << 20 and result.iterations == 100
    assert result.mb_per_s > 0
    print(f"ib_write_bw {dev.name} 1 MiB: {result.mb_per_s:.1f} MB/s")
