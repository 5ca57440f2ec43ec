"""SoftRoCE (rdma_rxe): on the host where its kernel allows, else in qemu VMs.

    host.py           rdma_rxe on the host itself, where the running kernel has it
    vm.py             a command run on real SoftRoCE in one or two qemu VMs
    initramfs.py      the tiny initramfs that boots the distribution kernel there (cached)
    guest_init.sh     inside a VM: the network, an rxe device, the command, its status
"""
from .host import down, status, up
from .vm import VmResult, run

__all__ = ["up", "down", "status", "run", "VmResult"]
