"""One training job: what to run (JobConfig), what each rank measured (RankResult),
the job's figures (Summary), and the backends a job can run on (BACKENDS).

Backends:
    auto, verbs, shm, tcp, ...    rdmatensor's providers (rdmatensor.providers.REGISTRY, baselines
                                  such as grpc included), trained by runner.run_rank
    hvd, hvd-python               rdmatensor's Horovod API (import tf_plugin as hvd), Horovod's tape
                                  example: by default (native ops on one host), and on the Python
                                  path (RDMATENSOR_TF_OPS=python); hvd_runner.py
    tf-grpc                       TensorFlow's own MultiWorkerMirroredStrategy (tf_baseline.py)
    horovod                       real Horovod (gloo), started by its horovodrun (horovod_baseline.py)
    none                          the same ranks training with no communication at all: the
                                  compute floor every other backend is measured against
    sync                          that floor plus one meeting of the workers per step (4 bytes
                                  over shm): the floor of any synchronous all-reduce

Both runners build their RankResult here and the launcher summarizes and
compares them here, so every backend reports the same figures. This module
does not import TensorFlow.
"""
from __future__ import annotations

import dataclasses
import importlib
import statistics
from dataclasses import dataclass, field

from rdmatensor.providers import REGISTRY
from rdmatensor.session.context import COPY_PURPOSES

from rdmatensor.runner.cores import BINDINGS
from ..errors import JobError
from . import models

MODES = ("allreduce", "ps")


@dataclass(frozen=True)
class Backend:
    name: str
    kind: str                     # rdmatensor | hvd | tensorflow | horovod | none
    about: str
    modes: tuple[str, ...]
    entry: str                    # "module:function" running one rank: (cluster, JobConfig, token) -> RankResult
    threads: bool = True          # can its ranks share one process (runner.run_threads)?

    def run_rank(self, cluster, config: "JobConfig", token: str | None = None) -> "RankResult":
        module, function = self.entry.split(":")
        return getattr(importlib.import_module(module), function)(cluster, config, token)


def _backends() -> dict[str, Backend]:
    table = {"auto": Backend("auto", "rdmatensor", "rdmatensor, the provider chosen by auto", MODES,
                             "tf_plugin.training.runner:run_rank")}
    for name, provider in REGISTRY.items():
        table[name] = Backend(name, "rdmatensor", f"rdmatensor over {name}: {provider.description}", MODES,
                              "tf_plugin.training.runner:run_rank")
    table["hvd"] = Backend("hvd", "hvd", "rdmatensor's Horovod API, DistributedGradientTape as it runs by default "
                           "(on one host over shm: the native ops, no Python in the step)", ("allreduce",),
                           "tf_plugin.training.hvd_runner:run_rank", threads=False)
    table["hvd-python"] = Backend("hvd-python", "hvd", "rdmatensor's Horovod API on the Python path "
                                  "(RDMATENSOR_TF_OPS=python: a numpy_function per bucket, the ring on a "
                                  "Python thread)", ("allreduce",), "tf_plugin.training.hvd_runner:run_rank",
                                  threads=False)
    table["tf-grpc"] = Backend("tf-grpc", "tensorflow", "TensorFlow's own MultiWorkerMirroredStrategy (gRPC ring)",
                               ("allreduce",), "tf_plugin.training.tf_baseline:run_rank", threads=False)
    table["horovod"] = Backend("horovod", "horovod", "real Horovod 0.28.1 (TensorFlow ops, gloo, CPU), "
                               "started by horovodrun: make horovod-reference", ("allreduce",),
                               "tf_plugin.training.horovod_baseline:run_rank", threads=False)
    table["none"] = Backend("none", "none", "no communication: the compute floor", MODES,
                            "tf_plugin.training.runner:run_rank")
    table["sync"] = Backend("sync", "none", "no communication but one meeting of the workers per step: "
                            "the floor of a synchronous all-reduce", ("allreduce",),
                            "tf_plugin.training.runner:run_rank")
    return table


BACKENDS = _backends()


@dataclass(frozen=True)
class JobConfig:
    """A training job. `batch` is the global batch, split evenly over the workers;
    `image_size` applies to the keras.applications models; `in_graph` runs the
    all-reduce inside the step's tf.function (ranks in separate processes only);
    `fusion` all-reduces every gradient of a dtype as one bucket; `bind_to` is
    rdmatensor-run's --bind-to for ranks in separate processes (core: each on
    its own cores; horovodrun's ranks too, so that every backend runs alike);
    `paired` times the floor and the sync floor inside the provider's own job,
    step by step in turn (runner.py; the provider's counters leave the
    meetings' 4-byte writes out)."""
    mode: str = "allreduce"
    model: str = "mlp"
    provider: str = "auto"
    workers: int = 2
    ps: int = 0
    steps: int = 20
    seed: int = 0
    batch: int = 64
    lr: float = 0.05
    timeout: float = 120.0
    in_graph: bool = False
    fusion: bool = True
    image_size: int = 32
    bind_to: str = "core"
    paired: bool = False

    def __post_init__(self):
        if self.mode not in MODES:
            raise JobError(f"mode {self.mode!r}: choose one of {', '.join(MODES)}")
        if self.model not in models.MODELS:
            raise JobError(f"model {self.model!r}: choose one of {', '.join(models.MODELS)}")
        backend = BACKENDS.get(self.provider)
        if backend is None:
            raise JobError(f"provider {self.provider!r}: choose one of {', '.join(BACKENDS)}")
        if self.mode not in backend.modes:
            raise JobError(f"provider {self.provider!r} ({backend.about}) has no {self.mode} mode")
        if self.workers < 1:
            raise JobError(f"workers {self.workers}: need at least one")
        if (self.mode == "ps") != (self.ps > 0) or self.ps < 0:
            raise JobError(f"ps {self.ps}: the ps mode needs at least one parameter server, "
                           "the allreduce mode none")
        if self.steps < 2:
            raise JobError(f"steps {self.steps}: need at least 2 (the first one traces and is not timed)")
        if self.batch < self.workers or self.batch % self.workers:
            raise JobError(f"batch {self.batch} (global) does not split evenly over {self.workers} workers")
        if self.lr <= 0 or self.timeout <= 0:
            raise JobError(f"lr {self.lr} and timeout {self.timeout} must be positive")
        if self.bind_to not in BINDINGS:
            raise JobError(f"bind_to {self.bind_to!r}: choose one of {', '.join(BINDINGS)}")
        if self.paired and (backend.kind not in ("rdmatensor", "hvd") or self.mode != "allreduce"
                            or self.workers < 2):
            raise JobError(f"paired with provider {self.provider!r}, mode {self.mode}, {self.workers} worker(s): "
                           "a paired job times the floors beside an rdmatensor provider's all-reduce "
                           "(or its Horovod API's) of at least 2 workers")
        if self.paired and self.steps < 4:
            raise JobError(f"steps {self.steps}: a paired job needs at least 4 (one to trace, then a cycle "
                           "of floor, sync floor and provider)")
        if self.model in models.APPLICATIONS and self.image_size < models.MIN_IMAGE_SIZE:
            raise JobError(f"image_size {self.image_size}: {self.model} needs at least {models.MIN_IMAGE_SIZE}")

    @property
    def backend(self) -> Backend:
        return BACKENDS[self.provider]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, doc: dict) -> "JobConfig":
        unknown = set(doc) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise JobError(f"unknown job field(s) {sorted(unknown)}")
        return cls(**doc)


@dataclass
class RankResult:
    """What one rank measured. Per-step figures cover the timed steps (all but the
    first, which traces); None where the backend cannot measure a figure."""
    rank: int
    role: str                               # worker | ps
    provider: str                           # the provider actually used (auto resolved)
    losses: list[float] = field(default_factory=list)      # a worker's loss, one per step
    step_seconds: list[float] = field(default_factory=list)
    setup_seconds: float = 0.0
    comm_seconds: float | None = None
    bytes_sent_per_step: float | None = None
    writes_per_step: float | None = None
    session_copies_per_step: float | None = None
    plugin_copies_per_step: float | None = None
    zero_copy_per_step: float | None = None
    dynamic: int = 0                        # session counters over the whole job
    fallbacks: int = 0
    grows: int = 0
    note: str = ""
    overlap: float | None = None            # share of the ring's time while backprop still ran
    ring_cpu_seconds: float | None = None   # CPU the communication thread used over the timed steps
    paired_seconds: dict | None = None      # a paired job's floor steps: {"none": [...], "sync": [...]}
    # per step: copies by purpose, the session's (gather, array, frame: into staging) and the
    # plugin's (copied, forwarded, fused: the ring's), and the bytes the session copied
    copies_by_purpose: dict | None = None
    bytes_copied_per_step: float | None = None

    @property
    def timed_steps(self) -> int:
        return len(self.step_seconds)

    @property
    def seconds(self) -> float:
        return sum(self.step_seconds)

    @classmethod
    def from_session(cls, cluster, losses, step_seconds, setup_seconds, comm_seconds, before: dict,
                     after: dict, tally_before: dict, tally_after: dict,
                     overlap: float | None = None, ring_cpu_seconds: float | None = None) -> "RankResult":
        """A rank trained over an rdmatensor session: stats() and Meter tallies around the timed steps."""
        timed = max(len(step_seconds), 1)

        def per_step(start, end, key):
            return (end[key] - start[key]) / timed

        plugin = ("copied", "forwarded", "fused")
        copies = sum(per_step(tally_before, tally_after, k) for k in plugin)
        by_purpose = {p: per_step(before, after, f"copies_{p}") for p in COPY_PURPOSES if f"copies_{p}" in after}
        by_purpose.update((k, per_step(tally_before, tally_after, k)) for k in plugin)
        return cls(cluster.rank, cluster.task_type, after["provider"], list(losses), list(step_seconds),
                   setup_seconds, comm_seconds, per_step(before, after, "bytes_sent"),
                   per_step(before, after, "writes"), per_step(before, after, "copies"), copies,
                   per_step(tally_before, tally_after, "zero_copy"),
                   after["dynamic"], after["fallbacks"], after["grows"], overlap=overlap,
                   ring_cpu_seconds=ring_cpu_seconds,
                   copies_by_purpose={k: v for k, v in by_purpose.items() if v},
                   bytes_copied_per_step=per_step(before, after, "bytes_copied") if "bytes_copied" in after else None)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, doc: dict) -> "RankResult":
        return cls(**doc)


def _total(values):
    """Sum, or None when a figure was not measured by this backend."""
    values = list(values)
    return None if any(v is None for v in values) else sum(values)


@dataclass
class Summary:
    """One job's figures from its ranks' results (see summarize)."""
    config: JobConfig
    provider_used: str
    workers: int
    ps: int
    timed_steps: int
    steps_per_s: float
    median_step_ms: float
    setup_seconds: float
    bytes_per_step: float | None
    writes_per_step: float | None
    copies_per_step: float | None           # includes the grpc baseline's (de)serialization copies
    zero_copy_ingest_per_step: float | None
    comm_ms_per_step: float | None          # per worker
    comm_fraction: float | None
    overlap: float | None                   # workers' mean share of ring time overlapping backprop
    ring_cpu_ms_per_step: float | None      # workers' mean CPU used by the communication thread
    dynamic: int
    fallbacks: int
    grows: int
    losses: list[float]                     # the global loss per step: mean over the workers' shards
    wall_seconds: float = 0.0               # set by the launcher: start to results, setup included
    paired: dict | None = None              # a paired job's floors, step by step (see paired())
    copies_by_purpose: dict | None = None   # summed over the ranks (see RankResult)
    bytes_copied_per_step: float | None = None

    @property
    def provider(self) -> str:
        return self.config.provider

    @property
    def final_loss(self) -> float | None:
        return self.losses[-1] if self.losses else None

    def to_dict(self) -> dict:
        doc = dataclasses.asdict(self)
        doc["config"] = self.config.to_dict()
        doc["final_loss"] = self.final_loss
        return doc


def summarize(config: JobConfig, results: list[RankResult]) -> Summary:
    """A job's figures. A step's time is its slowest worker's (ranks wait for each
    other in every step except on `none`, where the slowest rank still bounds
    the job); steps/s counts the timed steps over the slowest worker's time."""
    workers = [r for r in results if r.role == "worker"]
    if not workers:
        raise JobError("no worker results to summarize")
    timed = min(w.timed_steps for w in workers)
    per_step = [max(w.step_seconds[k] for w in workers) for k in range(timed)]
    seconds = max(w.seconds for w in workers)
    losses = [sum(w.losses[k] for w in workers) / len(workers) for k in range(min(len(w.losses) for w in workers))]
    comm = _total(w.comm_seconds for w in workers)
    copies = _total(v for r in results for v in (r.session_copies_per_step, r.plugin_copies_per_step))
    return Summary(
        config=config, provider_used=results[0].provider, workers=len(workers), ps=len(results) - len(workers),
        timed_steps=timed, steps_per_s=timed / seconds if seconds else 0.0,
        median_step_ms=1e3 * statistics.median(per_step) if per_step else 0.0,
        setup_seconds=max(r.setup_seconds for r in results),
        bytes_per_step=_total(r.bytes_sent_per_step for r in results),
        writes_per_step=_total(r.writes_per_step for r in results),
        copies_per_step=copies,
        zero_copy_ingest_per_step=_total(r.zero_copy_per_step for r in results),
        comm_ms_per_step=None if comm is None else 1e3 * comm / len(workers) / max(timed, 1),
        comm_fraction=None if comm is None or not seconds else comm / len(workers) / seconds,
        overlap=_mean(w.overlap for w in workers),
        ring_cpu_ms_per_step=_mean(None if w.ring_cpu_seconds is None else
                                   1e3 * w.ring_cpu_seconds / max(w.timed_steps, 1) for w in workers),
        dynamic=sum(r.dynamic for r in results), fallbacks=sum(r.fallbacks for r in results),
        grows=sum(r.grows for r in results), losses=losses, paired=paired(workers),
        copies_by_purpose=_by_purpose(results), bytes_copied_per_step=_total(r.bytes_copied_per_step for r in results))


def _by_purpose(results: list[RankResult]) -> dict | None:
    if any(r.copies_by_purpose is None for r in results):
        return None
    out: dict = {}
    for r in results:
        for k, v in r.copies_by_purpose.items():
            out[k] = out.get(k, 0.0) + v
    return out


def paired(workers: list[RankResult]) -> dict | None:
    """A paired job's figures: per kind (`none`, `sync`, the provider, and any other
    kind timed beside them, as the Python path beside `hvd`) the median of its
    steps' times (each step's slowest worker's), and the provider's share of each
    floor as the median over cycles of floor step / provider step, the steps of
    one cycle having run within a few steps of each other; for another kind X,
    `X_of_floor`, `X_of_sync` likewise and `of_X` (X's step / the provider's).
    None for a job that is not paired."""
    if any(w.paired_seconds is None for w in workers):
        return None
    runs = {kind: [w.paired_seconds[kind] for w in workers] for kind in workers[0].paired_seconds}
    runs["provider"] = [w.step_seconds for w in workers]
    cycles = min(len(s) for ranks in runs.values() for s in ranks)
    if not cycles:
        return None
    per = {kind: [max(s[i] for s in ranks) for i in range(cycles)] for kind, ranks in runs.items()}

    def share(a, b):
        return statistics.median(x / y for x, y in zip(per[a], per[b], strict=True))

    doc = {"cycles": cycles, **{f"{kind}_ms": 1e3 * statistics.median(v) for kind, v in per.items()},
           "of_floor": share("none", "provider"), "of_sync": share("sync", "provider"),
           "sync_of_floor": share("none", "sync")}
    for kind in per.keys() - {"none", "sync", "provider"}:
        doc.update({f"{kind}_of_floor": share("none", kind), f"{kind}_of_sync": share("sync", kind),
                    f"of_{kind}": share(kind, "provider")})
    return doc


def _mean(values):
    """Mean of the measured values, None when none was measured."""
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


@dataclass
class Row:
    provider: str
    summary: Summary
    efficiency: float | None      # floor (none) median step time / this median step time
    ratio: float | None           # this steps/s over the baseline's
    vs_horovod: float | None = None   # this steps/s over real Horovod's, when it ran
    of_sync: float | None = None  # sync floor median step time / this median step time, when sync ran


def compare(summaries: list[Summary]) -> tuple[str | None, list[Row]]:
    """Rows side by side: the scaling efficiency against `none` and against
    `sync` (when they ran), steps/s over the baseline: TensorFlow's own
    strategy (tf-grpc), else rdmatensor's gRPC baseline, whichever ran in the
    same run; and steps/s over real Horovod's, when it ran."""
    by = {s.provider: s for s in summaries}
    baseline = next((b for b in ("tf-grpc", "grpc") if b in by), None)

    def over(other: str, s: Summary, steps: bool = True) -> float | None:
        if other not in by:
            return None
        if steps:
            return s.steps_per_s / by[other].steps_per_s if by[other].steps_per_s else None
        return by[other].median_step_ms / s.median_step_ms if s.median_step_ms else None

    return baseline, [Row(s.provider, s, over("none", s, steps=False), over(baseline, s) if baseline else None,
                          over("horovod", s), over("sync", s, steps=False)) for s in summaries]


@dataclass
class Spread:
    """One figure over rounds: its median, lowest and highest (None: never measured)."""
    median: float | None
    low: float | None
    high: float | None

    @classmethod
    def of(cls, values) -> "Spread":
        values = [v for v in values if v is not None]
        if not values:
            return cls(None, None, None)
        return cls(statistics.median(values), min(values), max(values))


@dataclass
class Combined:
    """A provider's figures over every round that ran it; each ratio is taken
    within its own round (the machine drifts between rounds), then combined."""
    provider: str
    rounds: int
    steps_per_s: Spread
    median_step_ms: Spread
    efficiency: Spread
    ratio: Spread
    vs_horovod: Spread
    of_sync: Spread


def combine(rounds: list[list[Row]]) -> list[Combined]:
    """Each provider's rows of several rounds (compare() of each), in first-seen order."""
    rows: dict[str, list[Row]] = {}
    for one in rounds:
        for row in one:
            rows.setdefault(row.provider, []).append(row)
    return [Combined(p, len(rs), Spread.of(r.summary.steps_per_s for r in rs),
                     Spread.of(r.summary.median_step_ms for r in rs), Spread.of(r.efficiency for r in rs),
                     Spread.of(r.ratio for r in rs), Spread.of(r.vs_horovod for r in rs),
                     Spread.of(r.of_sync for r in rs)) for p, rs in rows.items()]
