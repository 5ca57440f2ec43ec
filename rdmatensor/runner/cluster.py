"""Who is who: the cluster from TF_CONFIG (or Slurm), and the rank of every task.

TensorFlow's convention is kept as is:

    TF_CONFIG = {"cluster": {"worker": ["host:port", ...], "ps": ["host:port", ...]},
                 "task": {"type": "worker", "index": 0}}

A "chief", if present, is worker 0 (TensorFlow's chief is a worker that also
does bookkeeping). Ranks: workers first (0..N-1), then parameter servers
(N..N+M-1). Each task's address is its rdmatensor control address.

Under Slurm (`srun`), `Cluster.from_slurm()` reads the step's environment
the way `tf.distribute.cluster_resolver.SlurmClusterResolver` does, so both
agree on every address: nodes sorted by name, each node's tasks on
consecutive ports from `port_base` (8888), jobs taken in name order ("ps"
before "worker") from that list. `python -m rdmatensor.runner.cluster --slurm`
prints the TF_CONFIG of the calling task.

This module does not import TensorFlow: the launcher uses it too.
"""
from __future__ import annotations

import json
import os
import random
import re
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
    def from_slurm(cls, ps: int = 0, port_base: int = 8888, env=None) -> "Cluster":
        """The calling Slurm task's view of its step: `ps` of the tasks are parameter
        servers, the rest workers (SLURM_PROCID, SLURM_STEP_NODELIST,
        SLURM_STEP_TASKS_PER_NODE; the job-wide variables outside a step)."""
        env = os.environ if env is None else env

        def var(*names):
            for name in names:
                if env.get(name):
                    return env[name]
            raise ValueError(f"{names[0]} is not set: not inside a Slurm job step (srun)?")

        hosts = expand_hostlist(var("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"))
        counts = expand_tasks_per_node(var("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"))
        if len(counts) != len(hosts):
            raise ValueError(f"Slurm lists {len(hosts)} node(s) but tasks for {len(counts)}")
        addrs = [f"{h}:{port_base + i}" for h, n in sorted(zip(hosts, counts, strict=True)) for i in range(n)]
        proc = int(var("SLURM_PROCID"))
        if not 0 <= ps < len(addrs):
            raise ValueError(f"{ps} parameter server(s) leave no worker among {len(addrs)} Slurm tasks")
        if not 0 <= proc < len(addrs):
            raise ValueError(f"SLURM_PROCID {proc} is not one of the step's {len(addrs)} tasks")
        kind, index = ("ps", proc) if proc < ps else ("worker", proc - ps)
        return cls(tuple(addrs[ps:]), tuple(addrs[:ps]), kind, index)

    @classmethod
    def from_env(cls) -> "Cluster":
        """TF_CONFIG when set (rdmatensor-run, Kubeflow's TFJob), else the Slurm step."""
        if os.environ.get("TF_CONFIG") or not os.environ.get("SLURM_PROCID"):
            return cls.from_tf_config()
        return cls.from_slurm()

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

    def peers(self) -> dict[int, str]:
        """Control address of every rank."""
        return dict(enumerate(self.workers + self.ps))


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` ports free on `host`, below the kernel's ephemeral range: no outgoing
    connection or data listener (port 0) can take one between this check and
    the control server's bind."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    ports: list[int] = []
    port = random.randint(20000, max(20001, low - 4 * n - 1))
    while len(ports) < n:
        port = port + 1 if port + 1 < low else 20000
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        ports.append(port)
    return ports


_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list: "node[01-03,7],gpu1" -> node01 node02 node03 node7 gpu1."""
    hosts, depth, start = [], 0, 0
    for i, ch in enumerate(text + ","):
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            hosts += _expand_one(text[start:i].strip())
            start = i + 1
    if depth or not hosts:
        raise ValueError(f"malformed Slurm host list {text!r}")
    return hosts


def _expand_one(item: str) -> list[str]:
    m = re.match(r"^([^\[\]]*)\[([^\[\]]+)\](.*)$", item)
    if not m:
        if not item or "[" in item or "]" in item:
            raise ValueError(f"malformed Slurm host name {item!r}")
        return [item]
    head, ranges, tail = m.groups()
    out = []
    for part in ranges.split(","):
        r = _RANGE.match(part.strip())
        if not r:
            raise ValueError(f"malformed range {part!r} in Slurm host list item {item!r}")
        lo, hi = r.group(1), r.group(2) or r.group(1)
        out += [f"{head}{k:0{len(lo)}d}" for k in range(int(lo), int(hi) + 1)]
    return [h for rest in (_expand_one(tail) if tail else [""]) for h in (o + rest for o in out)]


def expand_tasks_per_node(text: str) -> list[int]:
    """Slurm's tasks per node: "2(x3),1" -> [2, 2, 2, 1]."""
    out = []
    for part in text.split(","):
        m = re.match(r"^\s*(\d+)(?:\(x(\d+)\))?\s*$", part)
        if not m:
            raise ValueError(f"malformed Slurm tasks-per-node list {text!r}")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def main(argv=None) -> int:
    import argparse
    p = argparse.ArgumentParser(prog="python -m rdmatensor.runner.cluster",
                                description="print this task's TF_CONFIG")
    p.add_argument("--slurm", action="store_true", help="from the Slurm step's environment")
    p.add_argument("--ps", type=int, default=0, help="tasks that are parameter servers (Slurm)")
    p.add_argument("--port-base", type=int, default=8888, help="first port on each node (Slurm)")
    args = p.parse_args(argv)
    try:
        cluster = (Cluster.from_slurm(args.ps, args.port_base) if args.slurm else Cluster.from_tf_config())
    except ValueError as exc:
        p.error(str(exc))
    print(cluster.to_tf_config())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
