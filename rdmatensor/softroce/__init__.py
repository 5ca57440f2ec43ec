"""SoftRoCE (rdma_rxe): on the host where its kernel allows, else in qemu VMs."""
from .host import down, status, up
from .vm import VmResult, run

__all__ = ["up", "down", "status", "run", "VmResult"]
