"""Drives c_async_kernel.so: eager, tf.function, concurrency, errors, external memory."""

import ctypes
import sys
import time

import numpy as np
import tensorflow as tf

lib_path, part, complete = sys.argv[1], sys.argv[2], int(sys.argv[3])
if part == "interop1":
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
mod = tf.load_op_library(lib_path)
c = ctypes.CDLL(lib_path)  # same handle: reads the library's counters
for f in ("rdt_spike_deallocs", "rdt_spike_max_pending", "rdt_spike_done_calls"):
    getattr(c, f).restype = ctypes.c_long

x = tf.constant([1.0, 2.0, 3.0])


def op(a, **kw):
    return mod.rdt_async(a, complete=complete, **kw)



if part == "basic":
    t = time.perf_counter()
    y = op(x, delay_ms=200)
    print("eager:", y.numpy(), f"{time.perf_counter() - t:.3f}s")

    @tf.function
    def g(a):
        return op(a, delay_ms=200)

    t = time.perf_counter()
    print("tf.function:", g(x).numpy(), f"{time.perf_counter() - t:.3f}s")
    try:
        op(x, fail=True)
    except tf.errors.FailedPreconditionError as e:
        print("eager error:", type(e).__name__, "|", e.message.splitlines()[0])

    @tf.function
    def gf(a):
        return op(a, fail=True)

    try:
        gf(x)
    except tf.errors.FailedPreconditionError as e:
        print("graph error:", type(e).__name__, "|", e.message.splitlines()[0])

if part == "external":
    for mode in (1, 2):
        c.rdt_spike_reset()
        y = op(x, external=mode)
        print(f"external={mode}: value {y.numpy()} deallocs while output held: {c.rdt_spike_deallocs()}")
        del y
        print(f"external={mode}: deallocs after del: {c.rdt_spike_deallocs()}")

if part == "interop1":
    # Two ops that can only finish when both are pending at once.
    @tf.function
    def two(a):
        return op(a, barrier=2, timeout_ms=3000), op(a + 1, barrier=2, timeout_ms=3000)

    c.rdt_spike_reset()
    t = time.perf_counter()
    try:
        r = two(x)
        print("inter_op=1, 2 async C ops behind a barrier:", [v.numpy().tolist() for v in r],
              f"max pending {c.rdt_spike_max_pending()}", f"{time.perf_counter() - t:.3f}s")
    except tf.errors.DeadlineExceededError:
        print("inter_op=1, 2 C ops behind a barrier: DeadlineExceededError", f"{time.perf_counter() - t:.3f}s")

    # The same shape of wait with numpy_function: each blocks its thread.
    import threading

    bar = threading.Barrier(2, timeout=3)

    def wait(v):
        try:
            bar.wait()
        except threading.BrokenBarrierError:
            raise TimeoutError("numpy_function barrier timed out") from None
        return v * 2

    @tf.function
    def two_np(a):
        return (tf.numpy_function(wait, [a], tf.float32, stateful=True),
                tf.numpy_function(wait, [a + 1], tf.float32, stateful=True))

    t = time.perf_counter()
    try:
        r = two_np(x)
        print("inter_op=1, 2 numpy_function behind a barrier:", [v.numpy().tolist() for v in r],
              f"{time.perf_counter() - t:.3f}s")
    except Exception as e:  # noqa: BLE001 - the spike reports whatever comes
        why = "(TimeoutError in the Python function)" if "TimeoutError" in str(e) else ""
        print("inter_op=1, 2 numpy_function behind a barrier:", type(e).__name__, why,
              f"{time.perf_counter() - t:.3f}s")

if part == "many":
    @tf.function
    def eight(a):
        return [op(a + i, delay_ms=300) for i in range(8)]

    c.rdt_spike_reset()
    t = time.perf_counter()
    r = eight(x)
    print("8 ops of 300 ms in one tf.function:", f"{time.perf_counter() - t:.3f}s",
          f"max pending {c.rdt_spike_max_pending()}", "values ok:",
          all(np.allclose(v.numpy(), 2 * (x.numpy() + i)) for i, v in enumerate(r)))

if part == "cancel":
    @tf.function
    def one_fails(a):
        return op(a, delay_ms=3000), op(a, delay_ms=100, fail=True)

    one_fails.get_concrete_function(x)
    t = time.perf_counter()
    try:
        one_fails(x)
    except tf.errors.FailedPreconditionError as e:
        print("a 3 s wait beside a failing op:", type(e).__name__, f"after {time.perf_counter() - t:.3f}s")
