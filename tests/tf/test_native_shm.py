"""The native all-reduce on one host over shared memory (tf_plugin/native): the C
executor and its Python twin against numpy, bit for bit, and against each other
(a C rank and a twin rank in one group); the TensorFlow ops eagerly and inside
tf.function, with several buckets launched before their completions; the
gradient; a peer that never arrives, an abort, a cancelled step, a group closed
under a traced graph; RDMATENSOR_TF_OPS; the build cache.

The ranks are real processes (this file, run as a worker), started once for the
module with TensorFlow imported and the op library built (once: they build it
together under the cache's lock) and loaded; the test process relays the
segments' descriptors between them (socket.send_fds) and drives them. No mocks.
"""
from __future__ import annotations

import functools
import json
import os
import pickle
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tf_plugin.core import scaling  # noqa: E402
from tf_plugin.native import build, contract, segment, shm_c, shm_twin  # noqa: E402

DTYPES = ("float32", "float64", "int32", "int64", "float16")
OPS = ("sum", "average", "min", "max", "product")
UFUNCS = {"sum": np.add, "average": np.add, "min": np.minimum, "max": np.maximum, "product": np.multiply}
SIZES = (0, 1, 7, 1000)


# ------------------------------------------------------------------ the numbers
def inputs(seed: int, rank: int, plan) -> list[np.ndarray]:
    """Rank `rank`'s arrays for `plan` [(bucket, shape, dtype)]: small values, so products stay finite,
    and in the larger floats a NaN, an infinity and a negative zero at places that differ by rank
    (the reductions' loops are vectorized: NaN on one side only, or on both, must still give numpy's bits)."""
    rng = np.random.default_rng([seed, rank])
    out = []
    for _, shape, dtype in plan:
        if np.dtype(dtype).kind == "f":
            x = (rng.standard_normal(shape) * 3).astype(dtype)
            flat = x.reshape(-1)
            if flat.size >= 7:
                flat[[rank % 3, 3 + rank % 2, 5 + rank % 2]] = [np.nan, np.inf * (-1) ** rank, -0.0]
            out.append(x)
        else:
            out.append(rng.integers(-9, 10, shape).astype(dtype))
    return out


def reference(seed: int, ranks: int, plan, op: str, scale: float = 1.0) -> list[np.ndarray]:
    """numpy's answer: folded in rank order in the dtype, then scaled as core/scaling.py does."""
    per_rank = [inputs(seed, r, plan) for r in range(ranks)]
    f = contract.factor(op, scaling.factor(scale), ranks)
    out = []
    for i in range(len(plan)):
        acc = functools.reduce(UFUNCS[op], [per_rank[r][i] for r in range(ranks)]).copy()
        if f != 1.0:
            scaling.scale_into(acc, acc, f)
        out.append(acc)
    return out


def bucket_bytes(plan) -> list[int]:
    sizes = {}
    for b, shape, dtype in plan:
        sizes[b] = max(sizes.get(b, 0), int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize)
    return [sizes.get(b, 0) for b in range(max(sizes) + 1)]


# ------------------------------------------------------------------ framing
def send_msg(sock: socket.socket, obj) -> None:
    data = pickle.dumps(obj)
    sock.sendall(struct.pack("<Q", len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            raise EOFError("the worker went away")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def recv_msg(sock: socket.socket):
    (n,) = struct.unpack("<Q", _recv_exact(sock, 8))
    return pickle.loads(_recv_exact(sock, n))


# ------------------------------------------------------------------ the worker's cases
class Worker:
    """One rank's process: its groups by name, and the cases the test process asks for."""

    def __init__(self, sock: socket.socket, rank: int):
        import tensorflow as tf

        from tf_plugin.native import ops
        self.tf, self.ops, self.sock, self.rank = tf, ops, sock, rank
        self.groups = {}
        self.built = ops.native_library()          # builds the op library on first use (one rank builds)

    def make_group(self, name, size, bucket_bytes, timeout, kind=None):
        fd = segment.create_segment(self.rank, size, bucket_bytes)
        fds = segment.exchange(self.sock, self.rank, size, fd)
        try:
            g = self.ops.group(fds, self.rank, size, bucket_bytes, timeout=timeout, name=name, kind=kind)
        finally:
            for f in [fd, *fds]:
                os.close(f)
        self.groups[name] = g
        return g.kind

    def close_group(self, name):
        self.groups.pop(name).close()

    def run(self, name, plan, op, scale, seed, mode, steps=1):
        """Every all-reduce of `plan`, `steps` times: results as bytes (the last step's)."""
        tf, ops, g = self.tf, self.ops, self.groups[name]
        arrays = inputs(seed, self.rank, plan)
        buckets = [b for b, _, _ in plan]
        if mode == "contract":             # numpy through the group itself (C executor or twin)
            for _ in range(steps):
                out = g.allreduce_many(buckets, arrays, op, scaling.factor(scale))
        elif mode == "eager":
            tensors = [tf.constant(a) for a in arrays]
            for _ in range(steps):
                out = [ops.allreduce(t, g, b, op, scale).numpy() for t, b in zip(tensors, buckets, strict=True)]
        elif mode in ("fused", "fused-eager"):   # a bucket's members in one request (allreduce_fused)
            members = {}
            for i, b in enumerate(buckets):
                members.setdefault(b, []).append(i)

            def fused(*xs):
                out = [None] * len(xs)
                for b, idx in members.items():
                    for i, y in zip(idx, ops.allreduce_fused([xs[i] for i in idx], g, b, op, scale), strict=True):
                        out[i] = y
                return out
            step = fused if mode == "fused-eager" else tf.function(fused)
            tensors = [tf.constant(a) for a in arrays]
            for _ in range(steps):
                out = [t.numpy() for t in step(*tensors)]
            if mode == "fused":            # three ops per bucket, none per member
                graph = step.get_concrete_function(*tensors).graph
                kinds = [o.type for o in graph.get_operations()]
                assert kinds.count("Slice") == 0 and kinds.count("ConcatV2") == 0 or g.kind == "python", kinds
                if g.kind == "native":
                    fused = ("RdtShmAllreduceLaunchFused", "RdtShmAllreduceDoneFused", "RdtShmAllreduceMembers")
                    assert [kinds.count(k) for k in fused] == [len(members)] * 3, kinds
                    assert not {"SplitV", "Split", "Reshape"} & set(kinds), kinds
        else:                              # one tf.function: every launch, then the completions
            together = mode == "function"      # one completion op for all, or one per tensor
            step = tf.function(lambda *xs: ops.allreduce_many(xs, g, buckets, op, scale, together=together))
            tensors = [tf.constant(a) for a in arrays]
            for _ in range(steps):
                out = [t.numpy() for t in step(*tensors)]
        return [(o.dtype.str, o.shape, o.tobytes()) for o in out]

    def gradient(self, name, mode):
        """With x = rank + 1 on each rank: d/dx of sum(c_rank * allreduce(x * x)) = 2 x * sum over
        ranks of c; with allreduce_many, + sum(allreduce(3 x)) adds 3 * ranks."""
        tf, ops, g = self.tf, self.ops, self.groups[name]
        x = tf.Variable(np.full(5, self.rank + 1.0, np.float32))
        c = tf.constant(np.arange(5, dtype=np.float32) + 10.0 * self.rank)

        def grad():
            with tf.GradientTape() as tape:
                if mode == "many":
                    y, z = ops.allreduce_many([x * x, 3.0 * x], g, [0, 1], "sum")
                    loss = tf.reduce_sum(c * y) + tf.reduce_sum(z)
                elif mode == "fused":
                    y, z = ops.allreduce_fused([x * x, 3.0 * x], g, 0, "sum")
                    loss = tf.reduce_sum(c * y) + tf.reduce_sum(z)
                else:
                    y = ops.allreduce(x * x, g, 0, "sum")
                    loss = tf.reduce_sum(c * y)
            return y, tape.gradient(loss, x)
        y, dx = grad() if mode == "eager" else tf.function(grad)()
        return y.numpy().tolist(), dx.numpy().tolist()

    def expect_error(self, name, after_abort=None, cancel=False, many=False):
        """One all-reduce that cannot complete (the peer never calls): the TensorFlow
        error type, its message and how long it took."""
        tf, ops, g = self.tf, self.ops, self.groups[name]
        x = tf.constant(np.ones(8, np.float32))
        if cancel:
            def boom(a):
                time.sleep(0.3)
                raise ValueError("another op of the step failed")

            @tf.function
            def step(t):
                y = ops.allreduce_many([t, 2 * t], g, [0, 0]) if many else ops.allreduce(t, g, 0)
                z = tf.numpy_function(boom, [t], tf.float32, stateful=False)   # not chained to the all-reduce
                return y, z
            step.get_concrete_function(x)          # traced before the clock starts
        if after_abort is not None:
            threading.Timer(after_abort, g.abort).start()
        started = time.monotonic()
        try:
            if cancel:
                step(x)
            else:
                ops.allreduce(x, g, 0).numpy()
        except tf.errors.OpError as exc:
            return type(exc).__name__, exc.message, time.monotonic() - started
        return None, "", time.monotonic() - started

    def held_after_close(self, name):
        """An output still held after its group is closed keeps its values."""
        tf, ops, g = self.tf, self.ops, self.groups.pop(name)
        y = ops.allreduce(tf.constant(np.arange(1000, dtype=np.float64)), g, 0, "sum")
        before = y.numpy().copy()
        g.close()
        import gc
        gc.collect()
        junk = [np.full(1 << 16, 7.0) for _ in range(64)]       # reuse freed memory, if any was freed
        del junk
        return before.tolist() == y.numpy().tolist(), y.numpy()[:3].tolist()

    def closed_under_graph(self, name):
        """A traced function over a group closed since: a clear FailedPrecondition."""
        tf, ops, g = self.tf, self.ops, self.groups.pop(name)
        f = tf.function(lambda t: ops.allreduce(t, g, 0))
        x = tf.constant(np.ones(4, np.float32))
        first = f(x).numpy().tolist()
        g.close()
        try:
            f(x)
        except tf.errors.OpError as exc:
            return first, type(exc).__name__, exc.message
        return first, None, ""

    def refused_many(self, name):
        """A launch of several with one too large for its bucket: InvalidArgument naming it, and
        nothing queued (the group still works)."""
        tf, ops, g = self.tf, self.ops, self.groups[name]
        small, large = tf.constant([1.0, 2.0]), tf.constant(np.ones(100, np.float32))
        try:
            ops.allreduce_many([small, large], g, [0, 0], labels=["small", "large"])
            refused = None
        except tf.errors.InvalidArgumentError as exc:
            refused = exc.message
        return refused, [t.numpy().tolist() for t in ops.allreduce_many([small], g, [0])]

    def env_choice(self, value):
        """The group RDMATENSOR_TF_OPS=value makes (a 1-rank group), or the error's type and message."""
        old = os.environ.get(build.ENV)
        os.environ[build.ENV] = value
        try:
            fd = segment.create_segment(0, 1, [64])
            try:
                g = self.ops.group([fd], 0, 1, [64], timeout=5.0)
            finally:
                os.close(fd)
            y = self.ops.allreduce(self.tf.constant([1.0, 2.0]), g, 0, "average").numpy().tolist()
            g.close()
            return g.kind, y
        except Exception as exc:       # noqa: BLE001 (the type is the answer)
            return type(exc).__name__, str(exc)
        finally:
            if old is None:
                os.environ.pop(build.ENV, None)
            else:
                os.environ[build.ENV] = old

    def version_refused(self):
        lib = self.ops.native_library()
        forged = build.Built(lib.path, True, 0.0, "x", "0.0.0")
        try:
            self.ops.NativeLibrary(forged)
        except build.BuildError as exc:
            return str(exc)
        return None

    def pending(self):
        return self.built.pending() if self.built else None


def worker_main(fd: int, rank: int) -> None:
    sock = socket.socket(fileno=fd)
    worker = Worker(sock, rank)
    send_msg(sock, ("ready", worker.built is not None))
    while True:
        try:
            case, kwargs = recv_msg(sock)
        except EOFError:
            sys.stdout.flush()
            os._exit(0)             # no TensorFlow teardown: seconds on a busy host
        try:
            send_msg(sock, ("ok", getattr(worker, case)(**kwargs)))
        except BaseException as exc:      # noqa: BLE001 (reported to the test process)
            send_msg(sock, ("error", type(exc).__name__, str(exc)))


# ------------------------------------------------------------------ the test process's side
class Ranks:
    """Worker processes, one per rank, driven over socketpairs."""

    def __init__(self, n: int):
        self.socks, self.procs = [], []
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
                   PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        env.pop(build.ENV, None)
        for r in range(n):
            mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            self.procs.append(subprocess.Popen([sys.executable, __file__, "--worker", str(theirs.fileno()), str(r)],
                                               pass_fds=[theirs.fileno()], env=env, cwd=ROOT))
            theirs.close()
            self.socks.append(mine)
        self.native = None

    def ready(self) -> "Ranks":
        """Wait for every worker to have TensorFlow and the op library loaded."""
        if self.native is None:
            self.native = [self._reply(r, 600) for r in range(len(self.socks))]
        return self

    def _reply(self, r: int, timeout: float):
        self.socks[r].settimeout(timeout)
        reply = recv_msg(self.socks[r])
        if reply[0] == "error":
            raise AssertionError(f"rank {r}: {reply[1]}: {reply[2]}")
        return reply[1]

    def call(self, case: str, ranks=(0, 1), wait: float = 120, **kwargs) -> list:
        """case(**kwargs) on each of `ranks` at once (a value of kwargs that is a dict keyed
        by rank gives each rank its own); their results in that order."""
        for r in ranks:
            mine = {k: v[r] if isinstance(v, dict) and set(v) >= set(ranks) else v for k, v in kwargs.items()}
            send_msg(self.socks[r], (case, mine))
        if case == "make_group":
            segment.relay([self.socks[r] for r in ranks])
        return [self._reply(r, wait) for r in ranks]

    def group(self, name, plan_or_bytes, ranks=(0, 1), timeout=10.0, kind=None) -> list:
        sizes = plan_or_bytes if isinstance(plan_or_bytes[0], int) else bucket_bytes(plan_or_bytes)
        return self.call("make_group", ranks, name=name, size=len(ranks), bucket_bytes=sizes, timeout=timeout,
                         kind=kind)

    def close(self):
        for s in self.socks:
            s.close()
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


@pytest.fixture(scope="module", autouse=True)
def _workers():
    """The workers start with the module's first test: TensorFlow loads in them while the
    tests that need no TensorFlow run here."""
    r = Ranks(3)
    yield r
    r.close()


@pytest.fixture
def ranks(_workers):
    r = _workers.ready()
    assert r.native == [True, True, True], "the op library did not build or load"
    return r


def check(results, seed, n, plan, op, scale=1.0, what=""):
    want = reference(seed, n, plan, op, scale)
    for r, got in enumerate(results):
        for i, ((dt, shape, data), w) in enumerate(zip(got, want, strict=True)):
            arr = np.frombuffer(data, np.dtype(dt)).reshape(shape)
            assert arr.dtype == w.dtype and arr.shape == w.shape, (what, r, i)
            assert arr.tobytes() == w.tobytes(), f"{what}: rank {r}, tensor {i} ({plan[i]}, {op}) differs"


# ------------------------------------------------------------------ contract, no TensorFlow
def _threads(groups, body):
    out, errors = {}, []

    def run(r):
        try:
            out[r] = body(r, groups[r])
        except BaseException as exc:      # noqa: BLE001
            errors.append(exc)
    ts = [threading.Thread(target=run, args=(r,)) for r in range(len(groups))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    if errors:
        raise errors[0]
    return [out[r] for r in range(len(groups))]


def _groups(kinds, sizes, timeout=5.0):
    lib = shm_c.bind(__import__("ctypes").CDLL(str(build.build("c").path)))
    fds = [segment.create_segment(r, len(kinds), sizes) for r in range(len(kinds))]
    try:
        return [shm_c.CGroup(lib, fds, r, len(kinds), sizes, timeout) if k == "c"
                else shm_twin.TwinGroup(fds, r, len(kinds), sizes, timeout) for r, k in enumerate(kinds)]
    finally:
        for fd in fds:
            os.close(fd)


def _every_op_as_numpy(groups, plan, kinds) -> None:
    """`plan` all-reduced by every op (a scale where it applies) on `groups`, in one
    allreduce_many per op: numpy's bits on every rank."""
    for seed, op in enumerate(OPS):
        scale = 0.5 if op in ("sum", "average") else 1.0
        got = _threads(groups, lambda r, g, seed=seed, op=op, scale=scale: g.allreduce_many(
            [b for b, _, _ in plan], inputs(seed, r, plan), op, scaling.factor(scale)))
        check([[(o.dtype.str, o.shape, o.tobytes()) for o in res] for res in got], seed, len(groups), plan, op,
              scale, f"{kinds} {op}")


@pytest.mark.parametrize("kinds", [("c", "c"), ("py", "py"), ("c", "py"), ("py", "c", "c")])
def test_the_twins_agree_with_numpy_bit_for_bit(kinds):
    """Every dtype and op, sizes 0, 1, odd and 1000, the same bucket twice in a row:
    the C executor, the twin and a mix of both give numpy's bits (threads of this
    process as ranks; the TensorFlow tests below use processes)."""
    n = len(kinds)
    plan = [(i % 3, (s,), d) for i, (s, d) in enumerate((s, d) for d in DTYPES for s in SIZES)]
    plan.append((0, (3, 4), "float32"))
    groups = _groups(kinds, bucket_bytes(plan))
    try:
        _every_op_as_numpy(groups, plan, kinds)
        # what each rank counts: per call, its slice from each peer and the rest of the result
        # from them (stats' bytes each way, as the ring's): the same in both twins
        for r, g in enumerate(groups):
            moved = 0
            for _, shape, dtype in plan:
                count = int(np.prod(shape))
                lo, hi = shm_twin.bounds(count, n, r)
                moved += ((n - 1) * (hi - lo) + count - (hi - lo)) * np.dtype(dtype).itemsize
            assert g.counters() == (len(OPS) * len(plan), len(OPS) * moved), (kinds, r)
    finally:
        for g in groups:
            g.close()
    assert all(g.counters()[0] == len(OPS) * len(plan) for g in groups), "counters lost at close"


@pytest.mark.parametrize("kinds", [("c", "c"), ("py", "py"), ("c", "py"), ("py", "c", "c")])
def test_parts_are_one_request_bit_for_bit_as_their_concatenation(kinds):
    """allreduce_parts: a fusion bucket's members as one request, the C executor copying
    each part in and each result out (slices that cross the parts' edges, an empty
    part, shapes kept) gives the bits the concatenation all-reduced as one array gives,
    on the C executor, the twin and a mix; a call of it counts as one."""
    shapes = [(3,), (0,), (2, 5), (1,), (7,), (4, 1)]
    total = sum(int(np.prod(s)) for s in shapes)
    groups = _groups(kinds, [total * 8])
    try:
        for seed, (op, dtype) in enumerate([("sum", "float32"), ("average", "float64"), ("max", "int32"),
                                            ("product", "float16"), ("min", "int64")]):
            def body(r, g, seed=seed, op=op, dtype=dtype):
                rng = np.random.default_rng(100 * seed + r)
                parts = [rng.integers(-9, 9, s).astype(dtype) for s in shapes]
                got = g.allreduce_parts(0, parts, op, 0.5 if op == "average" else 1.0, f"bucket {seed}")
                whole = g.allreduce(0, np.concatenate([p.reshape(-1) for p in parts]), op,
                                    0.5 if op == "average" else 1.0)
                return got, whole
            for r, (got, whole) in enumerate(_threads(groups, body)):
                assert [a.shape for a in got] == shapes and all(a.dtype == np.dtype(dtype) for a in got)
                flat = np.concatenate([a.reshape(-1) for a in got])
                assert flat.tobytes() == whole.tobytes(), (kinds, op, r)
        assert all(g.counters()[0] == 10 for g in groups)
        for g in groups:
            with pytest.raises(contract.ShmInvalid, match="do not fit in bucket 0"):
                g.allreduce_parts(0, [np.ones(total, np.float64), np.ones(1, np.float64)])
            with pytest.raises(contract.ShmInvalid, match="parts of one dtype"):
                g.allreduce_parts(0, [np.ones(1, np.float32), np.ones(1, np.float64)])
    finally:
        for g in groups:
            g.close()


@pytest.mark.parametrize("kinds", [("c", "c"), ("py", "py"), ("c", "py")])
def test_busy_counts_what_ran_before_the_last_bucket_came(kinds):
    """busy(): calls of an earlier bucket, made while the round's last bucket is not
    submitted yet, overlap all of their time; calls of the last bucket none; the
    seconds outlive close(), on both twins."""
    groups = _groups(kinds, [1 << 20, 64])
    try:
        _threads(groups, lambda r, g: [g.allreduce(0, np.ones(1 << 18, np.float32)) for _ in range(3)])
        first = [g.busy() for g in groups]
        for (busy, overlapped), kind in zip(first, kinds, strict=True):
            assert busy > 0 and overlapped == busy, (kind, busy, overlapped)
        _threads(groups, lambda r, g: [g.allreduce(1, np.ones(4, np.float32)) for _ in range(3)])
        for g, (busy, overlapped), kind in zip(groups, first, kinds, strict=True):
            now = g.busy()
            assert now[0] > busy and now[1] == overlapped, (kind, now, busy, overlapped)
        last = [g.busy() for g in groups]
    finally:
        for g in groups:
            g.close()
    assert [g.busy() for g in groups] == last, "busy seconds lost at close"


PRIORITY_SCRIPT = r"""
import json, logging, os, sys
sys.path.insert(0, sys.argv[1])
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="LOG %(message)s")
import numpy as np
from tf_plugin.errors import SettingError
from tf_plugin.native import ops, segment

def nices():
    out = {}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/stat") as f:
            out[tid] = int(f.read().rsplit(")", 1)[1].split()[16])      # field 19: nice
    return out

ops.native_library()
report = {}
for setting in sys.argv[2:]:
    os.environ["RDMATENSOR_EXECUTOR_NICE"] = setting
    before = nices()
    fd = segment.create_segment(0, 1, [64])
    try:
        g = ops.group([fd], 0, 1, [64], timeout=5, kind="native")
    except SettingError as exc:
        report[setting] = {"error": str(exc), "threads": len(nices()) - len(before)}
        continue
    finally:
        os.close(fd)
    new = sorted(n for t, n in nices().items() if t not in before)
    out = g.allreduce(0, np.arange(4, dtype=np.float32)).tolist()
    report[setting] = {"new": new, "executor_nice": g.executor_nice, "out": out}
    g.close()
report["mine"] = os.getpriority(os.PRIO_PROCESS, 0)
print("RESULT " + json.dumps(report))
"""


def _priorities(*settings, prefix=()) -> tuple[dict, str]:
    proc = subprocess.run([*prefix, sys.executable, "-c", PRIORITY_SCRIPT, str(ROOT), *settings],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.split("RESULT ", 1)[1]), proc.stderr


def test_the_executor_thread_runs_below_the_process_nice_where_permitted():
    """RDMATENSOR_EXECUTOR_NICE is added to the executor thread's nice (the thread that
    makes the group keeps its own); 0 leaves it; a bad value raises SettingError
    before any thread is started. Without CAP_SYS_NICE (setpriv drops it) the group
    runs at the process's priority, says so once, and its results are the same."""
    got, _ = _priorities("-7", "0", "-40", "fast")
    assert got["-7"] == {"new": [-7], "executor_nice": -7, "out": [0.0, 1.0, 2.0, 3.0]}, got
    assert got["0"] == {"new": [0], "executor_nice": None, "out": [0.0, 1.0, 2.0, 3.0]}, got
    for bad, words in (("-40", "-20 to 19"), ("fast", "a whole number")):
        assert got[bad]["threads"] == 0 and f"RDMATENSOR_EXECUTOR_NICE={bad!r}: expected {words}" in \
            got[bad]["error"], got
    assert got["mine"] == 0, got
    refused, log = _priorities("-7", "-3", prefix=("setpriv", "--bounding-set=-sys_nice", "--inh-caps=-sys_nice"))
    for setting in ("-7", "-3"):
        assert refused[setting] == {"new": [0], "executor_nice": None, "out": [0.0, 1.0, 2.0, 3.0]}, refused
    assert log.count("keeps the process's priority: nice -7 (-7) is not permitted") == 1, log[-3000:]
    assert "nice -3" not in log, log[-3000:]


PIPELINE_BYTES = 256 * 1024      # shm_allreduce.c: a call whose slices exceed it runs chunk by chunk


@pytest.mark.parametrize("kinds", [("c", "c"), ("c", "py"), ("py", "c", "c"), ("c", "c", "c")])
def test_large_calls_run_pipelined_bit_for_bit(kinds):
    """Calls whose slices span several chunks (the C executor copies in, reduces and
    copies out chunk by chunk, a stage apart) give numpy's bits: counts that leave
    ragged slices and chunks, every op, the same bucket again at once, a small
    call between large ones; beside the twin, which runs each call whole; and a
    fusion bucket's parts crossing chunk edges, as their concatenation."""
    n = len(kinds)
    plan = [(0, (2 * PIPELINE_BYTES // 4 * n + 13,), "float32"), (0, (5,), "float64"),
            (0, (3 * PIPELINE_BYTES // 8 * n + 7,), "float64"), (0, (PIPELINE_BYTES * n + 1,), "float16"),
            (0, (PIPELINE_BYTES // 4 * n + 3, 2), "int32")]
    groups = _groups(kinds, [max(int(np.prod(s)) * np.dtype(d).itemsize for _, s, d in plan)])
    try:
        _every_op_as_numpy(groups, plan, kinds)
        shapes = [(PIPELINE_BYTES // 8 + 5,), (0,), (PIPELINE_BYTES // 4, 3), (1,), (PIPELINE_BYTES // 2 + 1,)]

        def body(r, g):
            rng = np.random.default_rng(r)
            parts = [rng.standard_normal(s).astype(np.float32) for s in shapes]
            got = g.allreduce_parts(0, parts, "average")
            return np.concatenate([a.reshape(-1) for a in got]), g.allreduce(0, np.concatenate(
                [p.reshape(-1) for p in parts]), "average")
        for r, (parts, whole) in enumerate(_threads(groups, body)):
            assert parts.tobytes() == whole.tobytes(), (kinds, r)
    finally:
        for g in groups:
            g.close()


@pytest.mark.parametrize("kinds", [("c", "c"), ("c", "py")])
def test_a_pipelined_call_against_a_whole_one_is_a_mismatch_at_once(kinds):
    """Rank 0 all-reduces a large tensor (pipelined on C), rank 1 a small one on the
    same bucket: both raise ShmMismatch naming the counts, long before the timeout."""
    big = 4 * PIPELINE_BYTES // 4
    groups = _groups(kinds, [big * 4], timeout=20.0)
    try:
        started = time.monotonic()
        errors = _threads(groups, lambda r, g: _raised(g.allreduce, 0, np.ones(big if r == 0 else 9, np.float32)))
        assert [type(e) for e in errors] == [contract.ShmMismatch] * 2, errors
        assert f"rank 0 all-reduces {big} elements" in str(errors[1]), errors
        assert time.monotonic() - started < 5
    finally:
        for g in groups:
            g.close()


def test_the_contract_refuses_and_breaks_alike():
    """A bad argument raises ShmInvalid on both, starting nothing; a mismatch
    raises ShmMismatch on every rank and breaks the group; a timeout names the
    rank that did not arrive."""
    for kinds in (("c", "c"), ("py", "py"), ("c", "py")):
        groups = _groups(kinds, [64, 64], timeout=1.0)
        try:
            for g in groups:
                with pytest.raises(contract.ShmInvalid, match="do not fit in bucket 0"):
                    g.allreduce(0, np.ones(17, np.float32))
                with pytest.raises(contract.ShmInvalid, match="bucket 2 does not exist"):
                    g.allreduce(2, np.ones(1, np.float32))
            errors = _threads(groups, lambda r, g: _raised(g.allreduce, 1, np.ones(4 + r, np.float32)))
            assert [type(e) for e in errors] == [contract.ShmMismatch] * 2, errors
            assert "rank 1 all-reduces 5 elements" in str(errors[0]) and "rank 0 all-reduces 4" in str(errors[1])
            for g in groups:
                with pytest.raises(contract.ShmAborted, match="failed"):
                    g.allreduce(0, np.ones(1, np.float32))
        finally:
            for g in groups:
                g.close()
        groups = _groups(kinds, [64], timeout=1.0)
        try:
            started = time.monotonic()
            with pytest.raises(contract.ShmTimeout, match="rank 1 did not arrive within 1 s"):
                groups[0].allreduce(0, np.ones(2, np.float32), label="w0")
            assert time.monotonic() - started < 3
        finally:
            for g in groups:
                g.close()


def _raised(fn, *args):
    try:
        fn(*args)
    except Exception as exc:      # noqa: BLE001
        return exc
    return None


def test_a_peer_abort_ends_the_wait_at_once():
    for kinds in (("c", "c"), ("py", "c"), ("c", "py")):
        groups = _groups(kinds, [64], timeout=20.0)
        try:
            threading.Timer(0.2, groups[1].abort).start()
            started = time.monotonic()
            with pytest.raises(contract.ShmPeerAborted, match="rank 1 aborted"):
                groups[0].allreduce(0, np.ones(2, np.float32))
            assert time.monotonic() - started < 2, kinds
        finally:
            for g in groups:
                g.close()


def test_a_peer_ahead_is_seen_and_an_abort_as_a_mismatch_fails_its_wait_as_one():
    """peer_ahead names a peer that began a call this rank has not (what the
    divergence watchdog judges), and nothing once both made it; a group aborted as
    a mismatch fails the peer's wait at once with ShmMismatch, not at its timeout."""
    for kinds in (("c", "c"), ("py", "c"), ("c", "py")):
        groups = _groups(kinds, [64, 64], timeout=20.0)
        seen = []

        def judge(groups=groups, seen=seen):
            deadline = time.monotonic() + 5
            while groups[1].peer_ahead() is None and time.monotonic() < deadline:
                time.sleep(0.01)
            seen.append(groups[1].peer_ahead())
            groups[1].abort("the ranks diverged", contract.MISMATCH)
        try:
            assert groups[0].peer_ahead() is None and groups[1].peer_ahead() is None
            _threads(groups, lambda r, g: g.allreduce(1, np.ones(2, np.float32)))
            assert groups[0].peer_ahead() is None and groups[1].peer_ahead() is None, kinds
            judging = threading.Thread(target=judge)
            judging.start()
            started = time.monotonic()
            with pytest.raises(contract.ShmMismatch, match="rank 1 found that the ranks called different"):
                groups[0].allreduce(0, np.ones(2, np.float32))
            judging.join()
            assert seen == [(0, 0, 1)], (kinds, seen)
            assert time.monotonic() - started < 5, kinds
        finally:
            for g in groups:
                g.close()


# ------------------------------------------------------------------ the build cache
def _package(tmp: Path) -> Path:
    pkg = tmp / "pkg"
    pkg.mkdir()
    for name in build.SOURCES["c"]:
        shutil.copy(build.HERE / name, pkg / name)
    return pkg


def test_build_cache_hit_and_one_library_for_concurrent_builders(tmp_path):
    pkg = _package(tmp_path)
    code = ("import sys, json; from tf_plugin.native import build; "
            f"b = build.build('c', package_dir={str(pkg)!r}, directory={str(tmp_path / 'cache')!r}); "
            "print(json.dumps([b.cached, str(b.path)]))")
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
             for _ in range(3)]
    results = [__import__("json").loads(p.communicate(timeout=120)[0]) for p in procs]
    assert sorted(cached for cached, _ in results) == [False, True, True]
    assert len({path for _, path in results}) == 1
    assert [p.name for p in (tmp_path / "cache").glob("*.so")] == [Path(results[0][1]).name]
    again = build.build("c", package_dir=pkg, directory=tmp_path / "cache")
    assert again.cached and str(again.path) == results[0][1]
    (pkg / "shm_allreduce.c").write_text((pkg / "shm_allreduce.c").read_text() + "\n/* changed */\n")
    changed = build.build("c", package_dir=pkg, directory=tmp_path / "cache")
    assert not changed.cached and changed.path != again.path
    assert [p.name for p in (tmp_path / "cache").glob("*.so")] == [changed.path.name]    # the stale one pruned


def test_build_falls_back_to_xdg_cache_home(tmp_path, monkeypatch):
    pkg = _package(tmp_path)
    (pkg / "build").write_text("not a directory")          # unwritable even for root
    os.chmod(pkg, 0o555)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    try:
        assert build.cache_dir(pkg) == tmp_path / "xdg" / "rdmatensor"
        built = build.build("c", package_dir=pkg)
        assert built.path.parent == tmp_path / "xdg" / "rdmatensor" and built.path.exists()
    finally:
        os.chmod(pkg, 0o755)


def test_no_compiler_one_line_and_the_twin(tmp_path):
    code = ("from tf_plugin.native import build; import sys; "
            "print(build.library('c')); print(build.choice())")
    env = dict(os.environ, PATH=str(tmp_path), XDG_CACHE_HOME=str(tmp_path / "xdg"))
    env.pop(build.ENV, None)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.stdout.split() == ["None", "native"]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "no C compiler" in lines[0] and "install" in lines[0] and "twin runs" in lines[0]


def test_bad_choice_and_framework_free_modules(monkeypatch):
    monkeypatch.setenv(build.ENV, "Python")
    assert build.choice() == "python"
    monkeypatch.setenv(build.ENV, "gpu")
    with pytest.raises(ValueError, match="give 'native'"):
        build.choice()
    code = ("import sys; import tf_plugin.native, tf_plugin.native.contract, tf_plugin.native.segment, "
            "tf_plugin.native.shm_twin, tf_plugin.native.shm_c, tf_plugin.native.build; "
            "print(sorted(m for m in ('tensorflow', 'keras') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "[]", proc.stderr


# ------------------------------------------------------------------ TensorFlow, real processes
def test_ops_eager_and_in_tf_function_bit_identical(ranks):
    """Every dtype and op through the ops, eagerly and in one tf.function (every
    launch before any completion, buckets reused within the step), on 2 ranks."""
    small = [(i % 4, (s,), d) for i, (s, d) in enumerate((s, d) for d in DTYPES for s in SIZES)]
    small.append((0, (2, 3), "float64"))
    large = small + [(4, (1 << 20,), "float32")]          # 4 MiB
    assert ranks.group("ops2", large) == ["native", "native"]
    try:
        for seed, op in enumerate(OPS):
            scale = 0.7 if op == "average" else 1.0
            plan = large if op in ("sum", "average") else small
            modes = (("eager", 1), ("function", 2 if op == "sum" else 1)) + \
                ((("function-each", 1),) if op == "sum" else ())
            for mode, steps in modes:
                got = ranks.call("run", name="ops2", plan=plan, op=op, scale=scale, seed=seed, mode=mode,
                                 steps=steps)
                check(got, seed, 2, plan, op, scale, f"{mode} {op}")
    finally:
        ranks.call("close_group", name="ops2")
    assert ranks.call("pending") == [0, 0]


def test_a_fusion_bucket_in_one_request_bit_identical(ranks):
    """allreduce_fused: a bucket's members (one dtype, any shapes, empty ones too)
    back to back in one request, eagerly and in a tf.function, on the C ops
    (three ops per bucket, no concatenation, slice or reshape in the graph: the
    executor copies each member in and its result back, in place) and on the twin."""
    plan = [(0, (16, 4), "float32"), (0, (5,), "float32"), (0, (2, 3), "float32"), (1, (7,), "int64"),
            (0, (1000,), "float32"),
            (2, (0,), "float64"), (2, (4, 1), "float64"), (1, (3,), "int64"), (3, (9,), "float16")]
    sizes = {}
    for b, shape, dtype in plan:
        sizes[b] = sizes.get(b, 0) + int(np.prod(shape)) * np.dtype(dtype).itemsize
    for kind in ("native", "python"):
        assert ranks.group(f"fused-{kind}", [sizes[b] for b in range(4)], kind=kind) == [kind, kind]
        try:
            for seed, op in enumerate(OPS):
                scale = 0.7 if op == "average" else 1.0
                for mode in ("fused", "fused-eager"):
                    got = ranks.call("run", name=f"fused-{kind}", plan=plan, op=op, scale=scale, seed=seed,
                                     mode=mode, steps=2)
                    check(got, seed, 2, plan, op, scale, f"{kind} {mode} {op}")
        finally:
            ranks.call("close_group", name=f"fused-{kind}")
    assert ranks.call("pending") == [0, 0]


def test_three_ranks_c_and_twin_together(ranks):
    """Three processes: two on the C ops, one on the Python twin, in one group: numpy's bits."""
    plan = [(0, (1000,), "float32"), (1, (7,), "int64"), (0, (1,), "float32"), (2, (0,), "float64"),
            (3, (1 << 18,), "float64")]
    kinds = ranks.group("mix3", plan, ranks=(0, 1, 2), kind={0: "native", 1: "python", 2: "native"})
    assert kinds == ["native", "python", "native"]
    try:
        for seed, op in enumerate(("sum", "average", "max")):
            got = ranks.call("run", (0, 1, 2), name="mix3", plan=plan, op=op, scale=1.0, seed=seed,
                             mode="function")
            check(got, seed, 3, plan, op, 1.0, f"3 ranks {op}")
    finally:
        ranks.call("close_group", (0, 1, 2), name="mix3")


def test_the_gradient_is_the_allreduce_of_the_gradient(ranks):
    for kind in ("native", "python"):
        ranks.group(f"grad-{kind}", [64, 64], kind=kind)
        try:
            for mode in ("eager", "function", "many", "fused"):
                got = ranks.call("gradient", name=f"grad-{kind}", mode=mode)
                c_sum = np.arange(5) * 2 + 10.0
                for r, (y, dx) in enumerate(got):
                    assert y == [5.0] * 5                       # 1*1 + 2*2
                    want = 2 * (r + 1) * c_sum + (6.0 if mode in ("many", "fused") else 0.0)
                    assert dx == want.tolist(), (kind, mode, r)
        finally:
            ranks.call("close_group", name=f"grad-{kind}")


def test_a_peer_that_never_arrives_is_named_within_the_timeout(ranks):
    for kind in ("native", "python"):
        ranks.group(f"late-{kind}", [64], timeout=1.0, kind=kind)
        try:
            (kind_name, message, seconds), = ranks.call("expect_error", (0,), name=f"late-{kind}")
            assert kind_name == "DeadlineExceededError", (kind, message)
            assert "rank 1 did not arrive within 1 s" in message and "bucket 0" in message
            assert 0.9 < seconds < 4
        finally:
            ranks.call("close_group", name=f"late-{kind}")


def test_abort_fails_the_wait_promptly(ranks):
    ranks.group("abort", [64], timeout=30.0)
    try:
        (kind_name, message, seconds), = ranks.call("expect_error", (0,), name="abort", after_abort=0.3)
        assert kind_name == "AbortedError" and "aborted by the caller" in message
        assert seconds < 3
        # the peer sees it at once too
        (kind_name, message, seconds), = ranks.call("expect_error", (1,), name="abort")
        assert kind_name == "UnavailableError" and "rank 0 aborted" in message and seconds < 3
    finally:
        ranks.call("close_group", name="abort")


def test_a_cancelled_step_ends_the_wait(ranks):
    """Another op of the step fails after 0.3 s: the all-reduce's wait (timeout 30 s)
    ends through the step's CancellationManager, and the peer learns it at once."""
    for many in (False, True):          # one completion op, or one for several all-reduces
        ranks.group("cancel", [64], timeout=30.0)
        try:
            (kind_name, message, seconds), = ranks.call("expect_error", (0,), name="cancel", cancel=True, many=many)
            assert kind_name == "InvalidArgumentError" and "another op of the step failed" in message
            assert seconds < 5
            (kind_name, message, seconds), = ranks.call("expect_error", (1,), name="cancel")
            assert kind_name == "UnavailableError" and "rank 0 aborted" in message and seconds < 3
        finally:
            ranks.call("close_group", name="cancel")


def test_outputs_outlive_the_group_and_a_closed_group_fails_clearly(ranks):
    ranks.group("held", [8000])
    assert ranks.call("held_after_close", name="held") == [(True, [0.0, 2.0, 4.0])] * 2
    ranks.group("traced", [64])
    for first, kind_name, message in ranks.call("closed_under_graph", name="traced"):
        assert first == [2.0] * 4
        assert kind_name == "FailedPreconditionError" and "is not open in this process" in message


def test_a_bad_argument_among_several_queues_none(ranks):
    ranks.group("refuse", [64])
    try:
        for refused, after in ranks.call("refused_many", name="refuse"):
            assert "all-reduce of large: 100 elements of float32 (400 bytes) do not fit in bucket 0" in refused
            assert after == [[2.0, 4.0]]
    finally:
        ranks.call("close_group", name="refuse")


def test_rdmatensor_tf_ops_chooses_and_a_bad_value_errors(ranks):
    assert ranks.call("env_choice", (0,), value="python") == [("python", [1.0, 2.0])]
    assert ranks.call("env_choice", (0,), value="native") == [("native", [1.0, 2.0])]
    kind_name, message = ranks.call("env_choice", (0,), value="fast")[0]
    assert kind_name == "SettingError" and "RDMATENSOR_TF_OPS='fast'" in message
    assert "built for TensorFlow 0.0.0" in ranks.call("version_refused", (0,))[0]


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "--worker":
    worker_main(int(sys.argv[2]), int(sys.argv[3]))
