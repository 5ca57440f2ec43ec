"""Host-side checks that need no RDMA: the CLI, host SoftRoCE errors, the initramfs."""
import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from rdmatensor import softroce
from rdmatensor.errors import SoftRoceError
from rdmatensor.providers import REGISTRY
from rdmatensor.softroce import initramfs


def rdmatensor(*args):
    return subprocess.run([sys.executable, "-m", "rdmatensor", *args], capture_output=True, text=True)


def test_devices_json_lists_every_provider():
    res = rdmatensor("devices", "--json")
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout)
    assert set(info["providers"]) == set(REGISTRY)
    for name, p in info["providers"].items():
        assert isinstance(p["viable"], bool) and p["reason"], name
    assert info["providers"]["tcp"]["viable"]


def test_vm_without_command_is_a_clear_error():
    res = rdmatensor("softroce", "vm")
    assert res.returncode == 2
    assert "give the command to run after --" in res.stderr


def test_vm_rejects_bad_arguments():
    assert rdmatensor("softroce", "vm", "--hosts", "9", "--", "true").returncode == 2
    assert rdmatensor("softroce", "vm", "--hosts", "0", "--", "true").returncode == 2
    with pytest.raises(SoftRoceError, match="hosts must be between 1 and 8"):
        softroce.run(["true"], hosts=9)
    with pytest.raises(SoftRoceError, match="rails must be 1, or 2 with two hosts or more"):
        softroce.run(["true"], hosts=1, rails=2)
    with pytest.raises(SoftRoceError, match="mtu"):
        softroce.run(["true"], mtu=100)
    with pytest.raises(SoftRoceError, match="cannot share"):
        softroce.run(["true"], shares=["/nonexistent-dir"])


@pytest.mark.skipif(Path("/sys/module/rdma_rxe").exists(), reason="this kernel has rdma_rxe")
def test_host_softroce_up_without_rxe_names_the_vm():
    with pytest.raises(SoftRoceError, match="softroce vm"):
        softroce.up("lo")
    res = rdmatensor("softroce", "up", "--netdev", "lo")
    assert res.returncode == 2 and "softroce vm" in res.stderr


def test_host_softroce_up_rejects_unknown_netdev():
    with pytest.raises(SoftRoceError, match="no network interface named"):
        softroce.up("no-such-if0")


def test_initramfs_modules_load_dependencies_first():
    kernel = initramfs.find_kernel()
    order = initramfs.boot_module_paths(kernel)
    names = [initramfs._module_name(p) for p in order]
    for needed in ("9p", "9pnet_virtio", "overlay", "virtio_net"):
        assert needed in names
    deps = initramfs._module_deps(kernel)
    for i, path in enumerate(order):
        for dep in deps[path]:
            assert dep in order[:i], f"{dep} must load before {path}"


def test_initramfs_is_cached_and_complete(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    kernel = initramfs.find_kernel()
    first = initramfs.initramfs_for(kernel)
    mtime = first.stat().st_mtime_ns
    assert initramfs.initramfs_for(kernel) == first
    assert first.stat().st_mtime_ns == mtime, "a cached initramfs must not be rebuilt"
    listing = subprocess.run(["cpio", "-t", "--quiet"], input=gzip.decompress(first.read_bytes()),
                             capture_output=True, check=True).stdout.decode().split()
    assert "init" in listing and "bin/busybox" in listing
    assert any(name.startswith("modules/9p.ko") for name in listing)
