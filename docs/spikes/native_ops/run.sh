#!/usr/bin/env bash
# Builds and runs the native-op spikes (docs/native-ops-spike.md) against a TensorFlow.
# usage: run.sh [python-with-tensorflow] [python-with-another-tensorflow-minor]
# Default python: the project's .venv. One compile at a time, -O1.
set -u
here=$(cd "$(dirname "$0")" && pwd)
py=${1:-$here/../../../.venv/bin/python}
other=${2:-}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

tfinfo() { "$1" -c 'import tensorflow as tf; print(tf.sysconfig.get_lib())' 2>/dev/null; }
tf=$(tfinfo "$py")
[ -n "$tf" ] || { echo "no tensorflow importable by $py" >&2; exit 2; }
echo "TensorFlow $("$py" -c 'import tensorflow as tf; print(tf.__version__)' 2>/dev/null) at $tf"

build() {  # build <compiler> <source> <output> <flags...>
  local cc=$1 src=$2 so=$3; shift 3
  local t0=$EPOCHREALTIME
  "$cc" -O1 -w -fPIC -shared "$here/$src" -o "$out/$so" "$@" || { echo "BUILD FAILED: $src"; return 1; }
  awk -v a="$t0" -v b="$EPOCHREALTIME" -v s="$src" 'BEGIN { printf "built %s in %.1f s\n", s, b - a }'
}
run() {  # run <python> <script> <args...>: stdout, and the exit code when not 0
  local p=$1 s=$2; shift 2
  "$p" "$here/$s" "$@" 2>"$out/err"
  local rc=$?
  [ $rc -eq 0 ] || { echo "  exit code $rc$( [ $rc -eq 139 ] && echo ' (segmentation fault)')"; grep -E 'Error' "$out/err" | tail -n 1 | sed 's/^/  /'; }
}

cxx=(--std=c++17 -D_GLIBCXX_USE_CXX11_ABI=1 -DEIGEN_MAX_ALIGN_BYTES=64 -I"$tf/include")
tflibs=(-L"$tf" -l:libtensorflow_framework.so.2)

echo "== 1a. C kernel API (gcc, plain C)"
build gcc c_async_kernel.c c_async_kernel.so -std=c11 -I"$tf/include" "${tflibs[@]}" -lpthread
for mode in 1 2; do
  echo "-- done() called before ComputeAsync returns (complete=$mode: 1 inline, 2 from a joined pthread)"
  for part in basic external many cancel interop1; do run "$py" c_kernel_check.py "$out/c_async_kernel.so" $part $mode; done
done
echo "-- done() called from a pthread after ComputeAsync returned (complete=0, the asynchronous case)"
for part in basic many; do run "$py" c_kernel_check.py "$out/c_async_kernel.so" $part 0; done
echo "-- TensorFlow's CAsyncOpKernel::ComputeAsync: passes &done (its by-value parameter) and returns"
addr=$(nm -C "$tf/libtensorflow_framework.so.2" | grep 'CAsyncOpKernel::ComputeAsync' | awk '{print $1}')
[ -n "$addr" ] && objdump -d --no-show-raw-insn --start-address=0x$addr --stop-address=$(printf '0x%x' $((0x$addr + 21))) \
  "$tf/libtensorflow_framework.so.2" | grep -E '^\s+[0-9a-f]+:' | sed 's/^/  /'

echo "== 1b. C++ route (AsyncOpKernel, tf.sysconfig flags)"
build g++ cc_async_kernel.cc cc_async_kernel.so "${cxx[@]}" "${tflibs[@]}"
run "$py" cc_kernel_check.py "$out/cc_async_kernel.so"

echo "== 2. XLA on the host platform"
build g++ xla_custom_call.cc xla_custom_call.so "${cxx[@]}" -L"$tf" -l:libtensorflow_cc.so.2 -l:libtensorflow_framework.so.2
build g++ xla_op_kernel.cc xla_op_kernel.so "${cxx[@]}" -I"$tf/include/external/highwayhash" \
  -I"$tf/include/external/farmhash_archive/src" -L"$tf" -l:libtensorflow_cc.so.2 -l:libtensorflow_framework.so.2
echo "-- our registrations resolve into TensorFlow's own registries:"
nm -D --undefined-only "$out/xla_custom_call.so" | c++filt | grep -E 'CustomCallTargetRegistry::Global|GetXlaFfiApi' | sed 's/^ */  /'
run "$py" xla_check.py "$out/xla_custom_call.so" "$out/xla_op_kernel.so"

if [ -n "$other" ]; then
  echo "== 3. the libraries built above, loaded by $("$other" -c 'import tensorflow as tf; print("TensorFlow", tf.__version__)' 2>/dev/null)"
  echo "-- C kernel API library"
  run "$other" c_kernel_check.py "$out/c_async_kernel.so" basic 1
  echo "-- C++ library"
  run "$other" cc_kernel_check.py "$out/cc_async_kernel.so"
  echo "-- XLA: legacy and FFI targets, then our XLA kernel"
  run "$other" xla_check.py "$out/xla_custom_call.so"
  run "$other" xla_check.py "$out/xla_custom_call.so" "$out/xla_op_kernel.so"
  echo "-- XLA: our XLA kernel rebuilt against that TensorFlow, the FFI handler still from the first build"
  otf=$(tfinfo "$other")
  build g++ xla_op_kernel.cc xla_op_kernel_other.so --std=c++17 -D_GLIBCXX_USE_CXX11_ABI=1 -DEIGEN_MAX_ALIGN_BYTES=64 \
    -I"$otf/include" -I"$otf/include/external/highwayhash" -I"$otf/include/external/farmhash_archive/src" \
    -L"$otf" -l:libtensorflow_cc.so.2 -l:libtensorflow_framework.so.2
  run "$other" xla_check.py "$out/xla_custom_call.so" "$out/xla_op_kernel_other.so" | grep 'own XlaOpKernel'
fi
