"""Build (and cache) the tiny initramfs that boots the distribution kernel in a VM.

The initramfs only has to reach the host's root filesystem: busybox plus the
modules for virtio, 9p and overlayfs. Everything else (rdma_rxe, pyverbs,
perftest, the project and its virtualenv) comes from the host's root, mounted
read-only over 9p with a tmpfs overlay, so the guest runs exactly what is
installed on the host.
"""
from __future__ import annotations

import glob
import gzip
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import SoftRoceError

# Modules needed before the root filesystem is reachable, in any order:
# dependencies are resolved from modules.dep.
BOOT_MODULES = ("virtio_pci", "virtio_net", "9pnet_virtio", "9p", "overlay")

STAGE1_INIT = r"""#!/bin/busybox sh
# Stage 1: mount the host root (read-only 9p) under a tmpfs overlay, then hand
# over to the project's stage-2 script inside it.
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
# Job parameters ride on the kernel command line as rdt_NAME=VALUE.
for w in $(cat /proc/cmdline); do case "$w" in rdt_*=*) export "$w";; esac; done
for m in $(cat /modules.order); do insmod "/modules/$m" || echo "stage1: insmod $m failed"; done
mkdir -p /lower /rw /newroot
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=524288,cache=loose hostroot /lower \
  || { echo "stage1: cannot mount host root"; poweroff -f; }
mount -t tmpfs -o mode=0755 tmpfs /rw
mkdir -p /rw/upper /rw/work
mount -t overlay overlay -o lowerdir=/lower,upperdir=/rw/upper,workdir=/rw/work /newroot \
  || { echo "stage1: cannot mount overlay"; poweroff -f; }
mkdir -p "/newroot$rdt_job"
mount -t 9p -o trans=virtio,version=9p2000.L,msize=524288,cache=none job "/newroot$rdt_job" \
  || { echo "stage1: cannot mount job directory"; poweroff -f; }
# Extra host directories shared writable at the same path: rdt_shares=a,b
n=0
for d in $(echo "${rdt_shares:-}" | tr ',' ' '); do
  mkdir -p "/newroot$d"
  mount -t 9p -o trans=virtio,version=9p2000.L,msize=524288,cache=none "share$n" "/newroot$d" \
    || echo "stage1: cannot mount shared directory $d"
  n=$((n + 1))
done
mount --move /proc /newroot/proc
mount --move /sys /newroot/sys
mount --move /dev /newroot/dev
exec switch_root /newroot /bin/sh "$rdt_stage2"
"""


@dataclass(frozen=True)
class Kernel:
    release: str
    image: Path

    @property
    def modules_dir(self) -> Path:
        return Path("/lib/modules") / self.release


def find_kernel() -> Kernel:
    """The newest installed distribution kernel that ships rdma_rxe."""
    candidates = []
    for image in glob.glob("/boot/vmlinuz-*"):
        release = image.split("vmlinuz-", 1)[1]
        if list((Path("/lib/modules") / release).glob("kernel/drivers/infiniband/sw/rxe/rdma_rxe.ko*")):
            candidates.append(Kernel(release, Path(image)))
    if not candidates:
        raise SoftRoceError(
            "no kernel image with rdma_rxe found under /boot and /lib/modules: "
            "install linux-image-amd64 (make setup does)")
    return max(candidates, key=lambda k: _version_key(k.release))


def _version_key(release: str):
    return [int(p) if p.isdigit() else p for p in re.split(r"[.\-]", release)]


def _module_deps(kernel: Kernel) -> dict[str, list[str]]:
    deps = {}
    for line in (kernel.modules_dir / "modules.dep").read_text().splitlines():
        path, _, rest = line.partition(":")
        deps[path] = rest.split()
    return deps


def _module_name(path: str) -> str:
    return os.path.basename(path).split(".ko")[0].replace("-", "_")


def boot_module_paths(kernel: Kernel) -> list[str]:
    """Relative module paths in load order (dependencies first)."""
    deps = _module_deps(kernel)
    by_name = {_module_name(p): p for p in deps}
    order: list[str] = []

    def visit(path: str) -> None:
        if path in order:
            return
        for dep in reversed(deps[path]):
            visit(dep)
        order.append(path)

    for name in BOOT_MODULES:
        if name not in by_name:
            continue  # built into this kernel
        visit(by_name[name])
    return order


def _busybox() -> Path:
    # busybox-static installs a statically linked /bin/busybox; a dynamic one
    # would not run in an initramfs without its libraries.
    path = Path("/bin/busybox")
    if not path.exists():
        raise SoftRoceError("no busybox found: install busybox-static (make setup does)")
    return path


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "rdmatensor"


def initramfs_for(kernel: Kernel) -> Path:
    """Path of the cached initramfs for this kernel, building it if needed.

    The cache key covers the kernel release and image, the module files and
    the stage-1 script, so a kernel upgrade or a change here rebuilds it.
    """
    modules = boot_module_paths(kernel)
    busybox = _busybox()
    key = hashlib.sha256()
    key.update(STAGE1_INIT.encode())
    for path in [kernel.image, busybox] + [kernel.modules_dir / m for m in modules]:
        st = path.stat()
        key.update(f"{path}:{st.st_size}:{st.st_mtime_ns}".encode())
    target = cache_dir() / f"initramfs-{kernel.release}-{key.hexdigest()[:16]}.cpio.gz"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="rdmatensor-initramfs-") as tmp:
        root = Path(tmp)
        for d in ("bin", "modules", "proc", "sys", "dev", "lower", "rw", "newroot"):
            (root / d).mkdir()
        shutil.copy2(busybox, root / "bin" / "busybox")
        order = []
        for rel in modules:
            name = os.path.basename(rel)
            shutil.copy2(kernel.modules_dir / rel, root / "modules" / name)
            order.append(name)
        (root / "modules.order").write_text("\n".join(order) + "\n")
        init = root / "init"
        init.write_text(STAGE1_INIT)
        init.chmod(0o755)
        files = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
        cpio = subprocess.run(["cpio", "--quiet", "-o", "-H", "newc"], cwd=root,
                              input="\n".join(files).encode(), capture_output=True)
        if cpio.returncode != 0:
            raise SoftRoceError(f"cpio failed building the initramfs: {cpio.stderr.decode().strip()}")
        # a partial file of its own: two runs starting at once (the test suites do) each build one
        fd, partial = tempfile.mkstemp(prefix=target.name + ".", suffix=".partial", dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as raw, gzip.open(raw, "wb", compresslevel=6) as f:
                f.write(cpio.stdout)
            os.chmod(partial, 0o644)
            os.replace(partial, target)
        except BaseException:
            os.unlink(partial)
            raise
    return target
