"""The step-time model: what one synchronous data-parallel training step costs
on a cluster, from a few constants per link and a model's gradient list.

    rdmatensor-bench fit --json docs/step-model/constants-host.json
    rdmatensor-bench predict --model resnet50_224 --ranks 64 --ranks-per-host 8 --link 100gbit --compute-ms 250

Constants (fitted by bench/step_fit.py from rdmatensor-bench's own
micro-benchmarks, or given for a fabric: --link, --latency, perftest output)

    α   latency of one write: from the write leaving to the receiver seeing it,
        past the fixed costs below (s)
    β   inverse bandwidth of one rail, one direction (s/byte); R rails: β/R
        (large writes are striped over the rails, rdmatensor/providers/verbs/rails.py)
    β₂  inverse bandwidth per direction while both directions run at once
        (s/byte): what every rank of a ring sees, writing to its right and
        receiving from its left in the same step. A NIC is full duplex (β₂ = β,
        what --link and perftest give); over shm and loopback tcp the bytes
        are moved by the ranks' own cores (a memcpy; the kernel's copies on
        both ends), and a core that sends and receives at once does both
        directions' work
    c   per-tensor cost: the fixed CPU cost of issuing one write, and again of
        receiving one (assumed equal: the fit cannot tell them apart) (s)
    r   the ring's own bookkeeping per bucket and step on the host (cutting
        chunks, reading a bucket through its members, leases; tf_plugin's
        executor/ring.py), past its writes, receives and streaming calls (s)
    γ   reduction: seconds per byte of a chunk summed (a + b, times 1/N, into
        the output: rdmatensor.streaming.add, as the ring runs it), and γ₀ per
        call (one call per gradient a chunk covers)
    δ   seconds per byte copied out of a receive slot (the all-gather's copy),
        and δ₀ per call
    The reduction's rates are measured twice: one core alone, and every core
    of the host at once (the ranks of a host sum and copy in the same step,
    on one memory bus); a ring with more than one rank on a host uses the
    second.

The fit reads four micro-benchmarks, each a linear function of (α, β, c, β₂):

    lat    half a round trip of s bytes:          α + s·β + 2c   (a write, a receive)
    bw     a write of s bytes, many in flight:        s·β +  c   (the slower side)
    step   n tensors, S bytes in all, then an ack: 2α + S·β + (n + 3)c
           (n writes while the receiver keeps up on its own core, the last one's
           receive, the ack's write and receive)
    duplex both ranks write s bytes to each other, then wait for the other's:
                                                  α + s·β₂ + 2c

and takes each constant from the point that determines it: α from the
smallest latency point, β from the step of the most bytes (large writes
issued with send_many, as the ring issues them), c from the step of the most
tensors within the 128 writes a receiver takes in flight (more wait for
credits, which the model does not count), β₂ from the largest duplex point
(four equations, solved exactly); every other point is a check, its residual reported. (γ, γ₀) and
(δ, δ₀) likewise from timing streaming.add and streaming.copy alone: the
per-byte rate from the largest size (out of cache, as a large bucket's
chunks are), the per-call cost from the smallest. Last, r from one ring
point: tf_plugin's ring over 2 ranks of 96 single-gradient buckets of 64
bytes, what the formula below leaves of its time, per bucket and step.

Flat ring all-reduce of one bucket of S bytes (m gradients) over N ranks
(tf_plugin's ring: layout.ring_bounds cuts it into N chunks; reduce-scatter
N-1 steps, then all-gather N-1 steps). Each step every rank writes one chunk
of S/N bytes to its right neighbour and receives one from its left; all
ranks move at once, so a step lasts as long as its slowest hop (with H > 1
hosts: a cross-host hop, one ring flow per host NIC in each direction when
ranks are numbered by host):

    steps        2(N-1)
    bytes sent   2(N-1)/N·S per rank (exactly 2(N-1)·S over all ranks)
    time         2(N-1)·(α + 2c + r) + 2(N-1)/N·S·β₂ + (N-1)/N·S·(γ + δ)
                 + (N-1)·((1 + (m-1)/N)·γ₀ + δ₀)

(N-1 chunks summed in the reduce-scatter, one streaming.add per gradient a
chunk covers; N-1 copied out in the all-gather, one streaming.copy each.)
Eagerly (RingAllReduce.allreduce_arrays) all B buckets advance in lockstep:
one latency per step for all of them, B·(2c + r) per step. Inside a training step
(overlap, below) the communication thread runs each bucket's ring alone.

Hierarchical all-reduce (HOROVOD_HIERARCHICAL_ALLREDUCE; layout.Hierarchy):
H hosts of L ranks. Reduce-scatter among a host's L ranks over the local link,
then the L rings of the ranks at the same local position across the H hosts
(each over S/L bytes, all L sharing the host's NIC: S/H bytes per NIC per
step), then the host's all-gather:

    local   2(L-1)·(α_l + 2c_l + r_l) + 2(L-1)/L·S·β₂_l + (L-1)/L·S·(γ + δ)
    cross   2(H-1)·(α_x + 2c_x + r_x) + 2(H-1)/H·S·β₂_x + (H-1)/H·(S/L)·(γ + δ)

(plus the calls, as above). Only 2(H-1) latencies cross hosts against 2(N-1)
for the flat ring; the bytes across a host's NIC are 2(H-1)/H·S against the
flat ring's 2(N-1)/N·S.

Broadcast (tf_plugin's collectives.broadcast): the root writes every tensor
to each of the other N-1 ranks, then every rank's byte comes back:
(N-1)·B·c + 2(α + 2c) + max((L-1)·S·β_l, (N-L)·S·β_x/[H>1]). All-gather
(collectives.allgather): every rank writes its S_own bytes to the N-1 others
directly (the bytes of a ring all-gather, (N-1)/N of the gathered total, in
one step instead of N-1), every rank sending and receiving at once:
(N-1)·B·c + α + 2c + max((L-1)·S_own·β₂_l, L·(N-L)·S_own·β₂_x) + N·S_own·δ
(the concatenation).

Fusion buckets: the gradient list goes through tf_plugin's own
layout.buckets_of (threshold: --fusion-threshold, else
RDMATENSOR_FUSION_THRESHOLD / HOROVOD_FUSION_THRESHOLD, else 64 MiB).

Overlap with backprop (an ASSUMPTION, with its parameter): a step computes
for C seconds; backprop is the last fraction f of it (--backprop-fraction,
default 2/3: a backward pass costs about twice a forward one); gradients
become ready evenly over backprop in reverse variable order (the last layer's
first), so bucket k is ready at (1-f)·C + f·C·(p_k+1)/V, p_k the backprop
position of its last member, V the number of gradients. One communication
thread reduces buckets in order, each as soon as it is ready and the previous
one is done; the step ends when compute and the last bucket are both done.
Scaling efficiency = C / step time. Without overlap (--no-overlap): C plus
the eager lockstep all-reduce.

What bounds a step: the largest of compute (C) and the all-reduce's latency,
bandwidth, per-tensor and reduction totals.

Left out: the parameter-server exchange (a different pattern: every worker's
bytes converge on the shards' NICs; tf_plugin/graph/ps_step.py); compression;
stragglers, congestion, NCCL or any GPU path within a host; the time to copy
gradients off a GPU.
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

GBIT = 1e9 / 8                   # bytes/s in one Gbit/s
DEFAULT_BACKPROP = 2 / 3
TERMS = ("latency", "bandwidth", "per_tensor", "reduction")


# ------------------------------------------------------------------ inputs
@dataclass(frozen=True)
class Link:
    alpha: float                 # s
    beta: float                  # s/byte, one rail, one direction
    per_tensor: float            # s per write (and per receive)
    rails: int = 1
    source: str = ""
    duplex_beta: float | None = None     # s/byte per direction, both at once; None: beta (full duplex)
    ring_step: float = 0.0       # s per bucket per ring step: the ring's own bookkeeping on the host

    @property
    def beta_eff(self) -> float:
        return self.beta / self.rails

    @property
    def duplex_eff(self) -> float:
        """Inverse bandwidth per direction while every rank sends and receives (a ring's step)."""
        return (self.beta if self.duplex_beta is None else self.duplex_beta) / self.rails

    def describe(self) -> str:
        gbits = 8 / self.beta / 1e9 if self.beta else float("inf")
        rails = f" x {self.rails} rails" if self.rails > 1 else ""
        duplex = ("" if self.duplex_beta is None or self.duplex_beta == self.beta else
                  f" ({8 / self.duplex_beta / 1e9:.3g} Gbit/s each way when both run at once)")
        return (f"{gbits:.3g} Gbit/s{rails}{duplex}, latency {self.alpha * 1e6:.3g} us, per tensor "
                f"{self.per_tensor * 1e6:.3g} us, ring bookkeeping {self.ring_step * 1e6:.3g} us per bucket and step "
                f"({self.source})")


@dataclass(frozen=True)
class Reduce:
    add: float                   # s per byte of summed output
    copy: float                  # s per byte copied out of a slot
    source: str = ""
    add_call: float = 0.0        # s per streaming.add call
    copy_call: float = 0.0       # s per streaming.copy call


@dataclass
class Terms:
    latency: float = 0.0
    bandwidth: float = 0.0
    per_tensor: float = 0.0
    reduction: float = 0.0

    @property
    def total(self) -> float:
        return self.latency + self.bandwidth + self.per_tensor + self.reduction

    def __add__(self, other: "Terms") -> "Terms":
        return Terms(*(getattr(self, t) + getattr(other, t) for t in TERMS))


def parse_rate(text: str) -> float:
    """Bytes per second from '100gbit', '25Gb/s', '25gbps', '12.5GB/s', '800MB/s'
    (a capital B is bytes, anything else bits)."""
    m = re.fullmatch(r"\s*([\d.]+)\s*([kKmMgGtT]?)\s*([A-Za-z/]*)\s*", text)
    unit = m[3].removesuffix("/s").removesuffix("/sec").removesuffix("ps") if m else ""
    if not m or unit not in ("", "b", "bit", "bits", "B", "byte", "bytes"):
        raise ValueError(f"bad rate {text!r}: use e.g. 100gbit, 25Gb/s, 12.5GB/s")
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m[2].lower()]
    return float(m[1]) * scale / (1 if unit.startswith("B") else 8)


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """Bytes from '0', '8', '4K', '64M' (as rdmatensor-bench's sizes, 0 allowed: no fusion)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1] if t and t[-1] in _UNITS else ""
    try:
        value = int(t[:-1] if unit else t) * _UNITS[unit]
    except (ValueError, KeyError):
        raise ValueError(f"bad size {text!r}: use e.g. 8, 4K, 64M") from None
    if value < 0:
        raise ValueError(f"bad size {text!r}: expected bytes >= 0")
    return value


def parse_tensors(text: str) -> list[int]:
    """Tensor sizes from 'COUNTxSIZE,...' (as rdmatensor-bench step's --step-tensors)."""
    out = []
    for part in text.split(","):
        count, _, size = part.partition("x")
        try:
            out += [parse_size(size)] * int(count)
        except ValueError:
            raise ValueError(f"bad tensors {part!r}: use COUNTxSIZE, e.g. 8x4K") from None
    return out


def parse_time(text: str) -> float:
    """Seconds from '2us', '2µs', '1.5ms', '500ns', '0.001s'."""
    m = re.fullmatch(r"\s*([\d.]+)\s*(ns|us|µs|ms|s)?\s*", text)
    if not m:
        raise ValueError(f"bad time {text!r}: use e.g. 2us, 500ns, 1.5ms")
    return float(m[1]) * {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, None: 1.0}[m[2]]


def link_from_perftest(bw_text: str | None, lat_text: str | None, fallback: Link) -> Link:
    """α and β from ib_write_bw / ib_write_lat output (bench/perftest.py parses
    them): β from the bandwidth row's average, α from the latency row's typical
    one-way time less its bytes' transfer and the write and receive costs, never
    below zero. What they do not give comes from `fallback`."""
    from .perftest import parse_write_bw, parse_write_lat
    beta, alpha, why = fallback.beta, fallback.alpha, []
    if bw_text:
        bw = parse_write_bw(bw_text)
        beta, why = 1 / (bw.mb_per_s * 1e6), why + [f"ib_write_bw {bw.mb_per_s:.0f} MB/s at {bw.size} B"]
    if lat_text:
        lat = parse_write_lat(lat_text)
        alpha = max(0.0, lat.typical_us * 1e-6 - lat.size * beta)
        why.append(f"ib_write_lat {lat.typical_us} us at {lat.size} B")
    # a NIC is full duplex: both directions at β (the fallback's β₂ described its own link)
    return Link(alpha, beta, fallback.per_tensor, fallback.rails, "perftest: " + ", ".join(why), None,
                fallback.ring_step)


# ------------------------------------------------------------------ constants
def load_constants(path) -> dict:
    return json.loads(Path(path).read_text())


def link_of(constants: dict, name: str, rails: int = 1) -> Link:
    c = constants["links"][name]
    return Link(c["alpha_s"], c["beta_s_per_byte"], c["per_tensor_s"], rails, f"fitted: {name}",
                c.get("duplex_beta_s_per_byte"), c.get("ring_step_s", 0.0))


def naive_link_of(constants: dict, name: str) -> Link:
    c = constants["links"][name]["naive"]
    return Link(c["alpha_s"], c["beta_s_per_byte"], 0.0, 1, f"naive: {name}")


def reduce_of(constants: dict, shared: bool = True) -> Reduce:
    """The fitted reduction rates: with `shared`, as measured with every core of the
    host summing (and copying) at once, when the fit measured that; else one core alone."""
    r = constants["reduction"]
    if shared and "shared" in r:
        s = r["shared"]
        return Reduce(s["add_s_per_byte"], s["copy_s_per_byte"], "fitted, every core at once",
                      r.get("add_call_s", 0.0), r.get("copy_call_s", 0.0))
    return Reduce(r["add_s_per_byte"], r["copy_s_per_byte"], "fitted, one core",
                  r.get("add_call_s", 0.0), r.get("copy_call_s", 0.0))


NO_REDUCE = Reduce(0.0, 0.0, "none")


# ------------------------------------------------------------------ formulas
def ring_bytes_per_rank(size: int, ranks: int) -> float:
    """Bytes each rank sends in a ring all-reduce of `size` bytes."""
    return 2 * (ranks - 1) / ranks * size


def _live(sizes, tensors) -> tuple[list[int], list[int]]:
    """The non-empty buckets' sizes and gradient counts (1 each when not given)."""
    tensors = [1] * len(sizes) if tensors is None else list(tensors)
    if len(tensors) != len(sizes):
        raise ValueError(f"{len(sizes)} bucket sizes but {len(tensors)} gradient counts")
    live = [(s, m) for s, m in zip(sizes, tensors, strict=True) if s]
    return [s for s, _ in live], [m for _, m in live]


def reduction_calls(tensors, ranks: int, red: Reduce) -> float:
    """The fixed cost of the ring's reduction calls: per bucket of m gradients, N-1
    chunks summed, each one streaming.add per gradient it covers (about 1 + (m-1)/N),
    and N-1 chunks copied out, one streaming.copy each."""
    n = ranks
    return sum((n - 1) * ((1 + (m - 1) / n) * red.add_call + red.copy_call) for m in tensors)


def ring_allreduce(sizes, ranks: int, link: Link, red: Reduce, lockstep: bool = False, tensors=None) -> Terms:
    """A flat ring all-reduce of buckets of `sizes` bytes (`tensors` gradients
    each, default 1) over `ranks` ranks on `link` (the slowest hop): each
    bucket's ring alone, one after another, or with `lockstep` all buckets'
    step k together (one latency per step). Every rank sends and receives in
    every step: the bytes move at the link's duplex rate."""
    sizes, tensors = _live(sizes, tensors)
    n, b, total = ranks, len(sizes), float(sum(sizes))
    if n < 2 or not b:
        return Terms()
    steps = 2 * (n - 1)
    return Terms(latency=steps * link.alpha * (1 if lockstep else b),
                 bandwidth=steps / n * total * link.duplex_eff,
                 per_tensor=steps * b * (2 * link.per_tensor + link.ring_step),
                 reduction=(n - 1) / n * total * (red.add + red.copy) + reduction_calls(tensors, n, red))


def hierarchical_allreduce(sizes, hosts: int, per_host: int, cross: Link, local: Link, red: Reduce,
                           lockstep: bool = False, tensors=None) -> Terms:
    """Reduce-scatter in each host, L rings across the H hosts over S/L bytes each
    (sharing the host's NIC), all-gather in each host."""
    sizes, tensors = _live(sizes, tensors)
    if hosts < 2 or per_host < 2:
        return ring_allreduce(sizes, hosts * per_host, cross if hosts > 1 else local, red, lockstep, tensors)
    h, per, b, total = hosts, per_host, len(sizes), float(sum(sizes))
    lat = (1 if lockstep else b)
    inner = Terms(latency=2 * (per - 1) * local.alpha * lat,
                  bandwidth=2 * (per - 1) / per * total * local.duplex_eff,
                  per_tensor=2 * (per - 1) * b * (2 * local.per_tensor + local.ring_step),
                  reduction=(per - 1) / per * total * (red.add + red.copy) + reduction_calls(tensors, per, red))
    # across hosts each ring's chunk is one piece of this host's output: one call per chunk
    outer = Terms(latency=2 * (h - 1) * cross.alpha * lat,
                  bandwidth=2 * (h - 1) / h * total * cross.duplex_eff,
                  per_tensor=2 * (h - 1) * b * (2 * cross.per_tensor + cross.ring_step),
                  reduction=(h - 1) / h * total / per * (red.add + red.copy) + reduction_calls([1] * b, h, red))
    return inner + outer


def broadcast(sizes, ranks: int, per_host: int, cross: Link, local: Link) -> Terms:
    """The root writes every tensor to each other rank, then hears every rank back."""
    sizes = [s for s in sizes if s]
    if ranks < 2 or not sizes:
        return Terms()
    total, b = float(sum(sizes)), len(sizes)
    hosts = -(-ranks // per_host)
    far = cross if hosts > 1 else local
    return Terms(latency=2 * far.alpha,
                 bandwidth=max((min(per_host, ranks) - 1) * total * local.beta_eff,
                               (ranks - per_host) * total * cross.beta_eff if hosts > 1 else 0.0),
                 per_tensor=((ranks - 1) * b + 3) * far.per_tensor)


def allgather(sizes, ranks: int, per_host: int, cross: Link, local: Link, red: Reduce) -> Terms:
    """Every rank writes its own tensors (`sizes`) to every other rank directly."""
    sizes = [s for s in sizes if s]
    if ranks < 2 or not sizes:
        return Terms()
    own, b = float(sum(sizes)), len(sizes)
    hosts = -(-ranks // per_host)
    far = cross if hosts > 1 else local
    return Terms(latency=far.alpha,
                 bandwidth=max((min(per_host, ranks) - 1) * own * local.duplex_eff,
                               per_host * (ranks - per_host) * own * cross.duplex_eff if hosts > 1 else 0.0),
                 per_tensor=((ranks - 1) * b + 2) * far.per_tensor,
                 reduction=ranks * own * red.copy)


def point_to_point(sizes, link: Link) -> Terms:
    """rdmatensor-bench's step: one rank writes `sizes`, the other acks (the fit's step row)."""
    sizes = [s for s in sizes if s]
    return Terms(latency=2 * link.alpha, bandwidth=float(sum(sizes)) * link.beta_eff,
                 per_tensor=(len(sizes) + 3) * link.per_tensor)


def naive(sizes, link: Link) -> float:
    """The textbook model: α + s·β for each tensor, one after another."""
    return sum(link.alpha + s * link.beta for s in sizes if s)


def naive_ring(sizes, ranks: int, link: Link) -> float:
    """The textbook ring: 2(N-1) steps of α + (S/N)·β per bucket."""
    return sum(2 * (ranks - 1) * (link.alpha + s / ranks * link.beta) for s in sizes if s)


# ------------------------------------------------------------------ buckets
def _layout():
    # the collective engine's package may move (tf_plugin/core -> tf_plugin/executor)
    try:
        from tf_plugin.core import layout
    except ImportError:                       # pragma: no cover - after the move
        from tf_plugin.executor import layout
    return layout


def var_infos(grads) -> list:
    """VarInfos (what layout.buckets_of takes) from [{"name", "shape", "dtype"}]."""
    layout = _layout()
    return [layout.VarInfo(g["name"], tuple(g["shape"]), np.dtype(g["dtype"]), False, {}) for g in grads]


@dataclass(frozen=True)
class BucketInfo:
    bytes: int
    tensors: int
    last: int                    # backprop position of its last member (0: first gradient ready)


def buckets(grads, threshold: int | None) -> list[BucketInfo]:
    """tf_plugin's fusion buckets of a gradient list, in the order backprop completes
    them. threshold 0: one bucket per gradient; None: tf_plugin's default."""
    layout = _layout()
    infos = var_infos(grads)
    position = {v.key: i for i, v in enumerate(reversed(infos))}
    fusion = threshold != 0
    out = []
    for b in layout.buckets_of(infos, fusion, threshold if fusion else None):
        out.append(BucketInfo(int(b.size) * b.dtype.itemsize, len(b.members),
                              max(position[key] for key, _, _ in b.members)))
    return out


# ------------------------------------------------------------------ a step
@dataclass
class Cluster:
    ranks: int
    per_host: int
    cross: Link
    local: Link
    reduce: Reduce
    hierarchical: bool = False

    @property
    def hosts(self) -> int:
        return -(-self.ranks // self.per_host)

    def allreduce(self, sizes, lockstep: bool = False, tensors=None) -> Terms:
        if self.hierarchical and self.ranks % self.per_host == 0:
            return hierarchical_allreduce(sizes, self.hosts, self.per_host, self.cross, self.local, self.reduce,
                                          lockstep, tensors)
        return ring_allreduce(sizes, self.ranks, self.cross if self.hosts > 1 else self.local, self.reduce,
                              lockstep, tensors)


@dataclass
class Prediction:
    step_s: float
    compute_s: float
    comm: Terms
    exposed_s: float
    buckets: int
    bytes: int
    tensors: int
    bound: str
    efficiency: float | None
    schedule: list = field(default_factory=list)      # (ready, start, end) per bucket

    def as_dict(self) -> dict:
        d = asdict(self)
        d["comm"] = {**asdict(self.comm), "total": self.comm.total}
        return d


def predict(grads, cluster: Cluster, compute_s: float = 0.0, threshold: int | None = None,
            backprop_fraction: float = DEFAULT_BACKPROP, overlap: bool = True) -> Prediction:
    """One training step of a model with gradients `grads` on `cluster`."""
    if not 0 <= backprop_fraction <= 1:
        raise ValueError(f"backprop fraction {backprop_fraction}: expected 0..1")
    bs = buckets(grads, threshold)
    count = len(grads)
    sizes = [b.bytes for b in bs]
    schedule = []
    if overlap:
        comm, free = Terms(), 0.0
        for b in bs:
            t = cluster.allreduce([b.bytes], tensors=[b.tensors])
            comm = comm + t
            ready = compute_s * (1 - backprop_fraction) + compute_s * backprop_fraction * (b.last + 1) / count
            start = max(ready, free)
            free = start + t.total
            schedule.append((ready, start, free))
        step = max(compute_s, free)
    else:
        comm = cluster.allreduce(sizes, lockstep=True, tensors=[b.tensors for b in bs])
        step = compute_s + comm.total
    candidates = {"compute": compute_s, **{t: getattr(comm, t) for t in TERMS}}
    bound = max(candidates, key=candidates.get)
    return Prediction(step, compute_s, comm, step - compute_s, len(bs), sum(sizes), count,
                      bound.replace("_", "-"), compute_s / step if compute_s and step else None, schedule)


# ------------------------------------------------------------------ gradient lists
def gradient_set(model: str) -> list[dict]:
    """A model's gradients from bench/model_grads.json (32x32, 10 classes) or
    bench/model_grads_224.json (ImageNet sizes, 1000 classes)."""
    from . import model_grads, model_grads_224
    for path in (model_grads.FILE, model_grads_224.FILE):
        models = json.loads(Path(path).read_text())["models"]
        if model in models:
            return models[model]
    raise ValueError(f"unknown model {model!r}: choose from {', '.join(model_names())}")


def model_names() -> list[str]:
    from . import model_grads, model_grads_224
    return sorted(m for p in (model_grads.FILE, model_grads_224.FILE)
                  for m in json.loads(Path(p).read_text())["models"])


def synthetic_set(sizes) -> list[dict]:
    """A gradient list of float32 tensors of `sizes` bytes (each a multiple of 4)."""
    return [{"name": f"t{i}", "shape": [max(1, s // 4)], "dtype": "float32"} for i, s in enumerate(sizes)]
