"""What can run our code inside tf.function(jit_compile=True) on the host platform."""

import ctypes
import sys

import numpy as np
import tensorflow as tf
from tensorflow.compiler.tf2xla.python import xla

lib_path = sys.argv[1]
c = ctypes.CDLL(lib_path, mode=ctypes.RTLD_GLOBAL)  # static initializers register the targets
for f in ("rdt_xla_legacy_calls", "rdt_xla_ffi_calls"):
    getattr(c, f).restype = ctypes.c_long
c.rdt_ffi_register_checked.restype = ctypes.c_char_p
print("FFI handler registration, checked:", c.rdt_ffi_register_checked().decode() or "ok")
# An XLA kernel must be registered before the first XLA compilation: TF copies the
# XLA op registry into XLA_CPU_JIT's kernels once (XlaOpRegistry::RegisterCompilationKernels).
mod = tf.load_op_library(sys.argv[2]) if len(sys.argv) > 2 else None
x = tf.constant([1.0, 2.0, 3.0])
spec = [tf.TensorSpec([3], tf.float32)]


def report(label, fn):
    try:
        y = fn(x)
        y = y[0] if isinstance(y, (list, tuple)) else y
        print(f"{label}: {np.asarray(y).tolist()} legacy calls {c.rdt_xla_legacy_calls()},"
              f" ffi calls {c.rdt_xla_ffi_calls()}")
    except Exception as e:  # noqa: BLE001 - the spike reports whatever comes
        msg = getattr(e, "message", str(e)).strip().splitlines()
        print(f"{label}: {type(e).__name__}: {next((m for m in msg if m.strip()), '')[:300]}")


report("custom_call_v2 -> legacy target", tf.function(
    lambda a: xla.custom_call_v2("rdt_xla_double", [a * 1], spec, backend_config="3", has_side_effect=True),
    jit_compile=True))
report("custom_call_v2 -> FFI handler", tf.function(
    lambda a: xla.custom_call_v2("rdt_ffi_double", [a * 1], spec, has_side_effect=True), jit_compile=True))
report("custom_call_v2 -> unregistered target", tf.function(
    lambda a: xla.custom_call_v2("rdt_nowhere", [a * 1], spec, has_side_effect=True), jit_compile=True))
report("numpy_function under jit_compile", tf.function(
    lambda a: tf.numpy_function(lambda v: v * 2, [a], tf.float32), jit_compile=True))
hlo = tf.function(
    lambda a: xla.custom_call_v2("rdt_xla_double", [a * 1], spec, backend_config="3", has_side_effect=True),
    jit_compile=True).experimental_get_compiler_ir(x)(stage="hlo")
print("HLO:", next(line.strip() for line in hlo.splitlines() if "custom-call" in line)[:300])

if mod is not None:  # our own XLA kernel emitting a typed-FFI custom call
    report("own XlaOpKernel -> FFI handler", tf.function(lambda a: mod.rdt_xla_double(a * 1), jit_compile=True))
    report("own XlaOpKernel, FFI error (empty input)", tf.function(
        lambda a: mod.rdt_xla_double(a[:0] * 1), jit_compile=True))
    report("own XlaOpKernel without jit_compile", tf.function(lambda a: mod.rdt_xla_double(a)))
