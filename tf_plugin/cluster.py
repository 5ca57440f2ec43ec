"""Who is who: the cluster from TF_CONFIG, and the rank of every task.

TensorFlow's convention is kept as is:

    TF_CONFIG = {"cluster": {"worker": ["host:port", ...], "ps": ["host:port", ...]},
                 "task": {"type": "worker", "index": 0}}

A "chief", if present, is worker 0 (TensorFlow's chief is a worker that also
does bookkeeping). Ranks: workers first (0..N-1), then parameter servers
(N..N+M-1). Each task's address is its rdmatensor control address.

This module does not import TensorFlow: the launcher uses it too.
"""
from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass

MODES = ("ps", "allreduce")


@dataclass(frozen=True)
class Cluster:
    workers: tuple[str, ...]
    ps: tuple[str, ...] = ()
    task_type: str = "worker"
    task_index: int = 0

    def __post_init__(self):
        if not self.workers:
            raise ValueError("a cluster needs at least one worker")
        if self.task_type not in ("worker", "ps"):
            raise ValueError(f"task type {self.task_type!r}: expected worker or ps")
        count = len(self.workers) if self.task_type == "worker" else len(self.ps)
        if not 0 <= self.task_index < count:
            raise ValueError(f"task {self.task_type}:{self.task_index} is not in the cluster "
                             f"({count} {self.task_type} tasks)")

    @classmethod
    def from_tf_config(cls, text: str | None = None) -> "Cluster":
        """Parse TF_CONFIG (the environment variable when `text` is None)."""
        text = os.environ.get("TF_CONFIG") if text is None else text
        if not text:
            raise ValueError("TF_CONFIG is not set")
        doc = json.loads(text)
        spec, task = doc.get("cluster", {}), doc.get("task", {})
        workers = list(spec.get("chief", [])) + list(spec.get("worker", []))
        kind, index = task.get("type", "worker"), int(task.get("index", 0))
        if kind == "chief":
            kind, index = "worker", 0
        elif kind == "worker" and spec.get("chief"):
            index += len(spec["chief"])
        return cls(tuple(workers), tuple(spec.get("ps", [])), kind, index)

    @classmethod
    def local(cls, workers: int, ps: int = 0, host: str = "127.0.0.1") -> "Cluster":
        """A cluster on this machine with free ports (task: worker 0)."""
        ports = free_ports(workers + ps, host)
        addrs = tuple(f"{host}:{p}" for p in ports)
        return cls(addrs[:workers], addrs[workers:])

    def task(self, task_type: str, index: int) -> "Cluster":
        return Cluster(self.workers, self.ps, task_type, index)

    def tasks(self) -> list["Cluster"]:
        """One view of this cluster per task, in rank order."""
        return ([self.task("worker", i) for i in range(len(self.workers))]
                + [self.task("ps", i) for i in range(len(self.ps))])

    def to_tf_config(self) -> str:
        cluster = {"worker": list(self.workers)}
        if self.ps:
            cluster["ps"] = list(self.ps)
        return json.dumps({"cluster": cluster, "task": {"type": self.task_type, "index": self.task_index}})

    @property
    def num_workers(self) -> int:
        return len(self.workers)

    @property
    def num_ps(self) -> int:
        return len(self.ps)

    @property
    def rank(self) -> int:
        return self.task_index if self.task_type == "worker" else len(self.workers) + self.task_index

    @property
    def is_worker(self) -> bool:
        return self.task_type == "worker"

    @property
    def worker_ranks(self) -> list[int]:
        return list(range(len(self.workers)))

    @property
    def ps_ranks(self) -> list[int]:
        return list(range(len(self.workers), len(self.workers) + len(self.ps)))

    def peers(self) -> dict[int, str]:
        """Control address of every rank."""
        return dict(enumerate(self.workers + self.ps))


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
