"""Drives cc_async_kernel.so: async completion, pending ops at inter_op=1, cancellation."""

import ctypes
import sys
import time

import tensorflow as tf

lib_path = sys.argv[1]
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
mod = tf.load_op_library(lib_path)
c = ctypes.CDLL(lib_path)
for f in ("rdt_cc_cancelled", "rdt_cc_max_pending", "rdt_cc_no_manager", "rdt_cc_calls"):
    getattr(c, f).restype = ctypes.c_long
x = tf.constant([1.0, 2.0, 3.0])

t = time.perf_counter()
print("eager:", mod.rdt_cc_wait(x, delay_ms=200).numpy(), f"{time.perf_counter() - t:.3f}s",
      "ops that saw no cancellation manager:", c.rdt_cc_no_manager())


for name, fn in (("stateless", mod.rdt_cc_wait), ("stateful", mod.rdt_cc_wait_stateful)):
    @tf.function
    def eight(a, fn=fn):
        return [fn(a + i, delay_ms=300) for i in range(8)]

    eight.get_concrete_function(x)
    c.rdt_cc_reset()
    t = time.perf_counter()
    r = eight(x)
    print(f"inter_op=1, 8 {name} ops of 300 ms in one tf.function:", f"{time.perf_counter() - t:.3f}s",
          "max pending", c.rdt_cc_max_pending(), "values", [float(v[0]) for v in r])


@tf.function
def one_fails(a):
    return mod.rdt_cc_wait(a, delay_ms=5000), mod.rdt_cc_wait(a, delay_ms=100, fail=True)


one_fails.get_concrete_function(x)
t = time.perf_counter()
try:
    one_fails(x)
except tf.errors.FailedPreconditionError as e:
    print("a 5 s wait beside a failing op:", type(e).__name__, f"after {time.perf_counter() - t:.3f}s,",
          "waits ended by the cancellation manager:", c.rdt_cc_cancelled())


# A stateless op on a constant input: does grappler fold it (run it once, at optimization)?
for name, fn in (("stateless", mod.rdt_cc_wait), ("stateful", mod.rdt_cc_wait_stateful)):
    @tf.function
    def on_constant(fn=fn):
        return fn(tf.constant([1.0, 2.0]), delay_ms=1)

    before = c.rdt_cc_calls()
    values = [on_constant().numpy().tolist() for _ in range(3)]
    print(f"{name} op on a constant, 3 calls of the function: kernel ran {c.rdt_cc_calls() - before} times", values[-1])
