#!/usr/bin/env bash
# Build real Horovod (TensorFlow ops, gloo, CPU, no MPI) into its own
# virtualenv, against the project's TensorFlow: the library users would pick
# instead, to measure beside. Nothing of Horovod enters the project's tree:
# the sources are downloaded into a temporary directory and built there.
#
#   scripts/horovod_reference.sh [VENV]    (default: .venv-horovod; make horovod-reference)
#
# TensorFlow 2.21's wheel lacks the highwayhash headers that Horovod's
# xla_mpi_ops.cc includes; that file is GPU-only (XLA ops for CUDA), so it
# is dropped from the build. About 5-8 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv-horovod}"
version=0.28.1

[ -x .venv/bin/python ] || { echo "horovod-reference: run make setup first" >&2; exit 1; }
missing=()
for p in cmake g++ make; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "horovod-reference: installing Debian packages: ${missing[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# Like the project's: Debian's packages visible (TensorFlow needs its six), then the project's own.
[ -x "$venv/bin/python" ] || /usr/bin/python3 -m venv --system-site-packages "$venv"
purelib() { "$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
# The project's TensorFlow (and numpy), not a second copy that could differ.
purelib .venv/bin/python > "$(purelib "$venv/bin/python")/rdmatensor-project.pth"
"$venv/bin/python" -m pip install -q --upgrade pip setuptools wheel
"$venv/bin/python" -m pip install -q cloudpickle psutil pyyaml packaging cffi

if "$venv/bin/python" -c "import horovod.tensorflow" 2>/dev/null && [ -x "$venv/bin/horovodrun" ]; then
  echo "horovod-reference: Horovod $version is built in $venv"
else
  src=$(mktemp -d)
  trap 'rm -rf "$src"' EXIT
  "$venv/bin/python" -m pip download -q --no-deps --no-binary :all: "horovod==$version" -d "$src"
  tar -xzf "$src/horovod-$version.tar.gz" -C "$src"
  sed -i '/xla_mpi_ops\.cc/d' "$src/horovod-$version/horovod/tensorflow/CMakeLists.txt"
  echo "horovod-reference: building Horovod $version (TensorFlow, gloo, CPU) into $venv"
  HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_WITH_GLOO=1 \
    HOROVOD_WITHOUT_MPI=1 HOROVOD_CPU_OPERATIONS=gloo MAKEFLAGS="-j$(nproc)" \
    "$venv/bin/python" -m pip install -q --no-build-isolation --use-pep517 "$src/horovod-$version"
fi
"$venv/bin/horovodrun" --check-build
# horovodrun as the launcher of an rdmatensor job: rank 0 publishes its
# rendezvous in horovodrun's key-value store, and the two ranks all-reduce.
echo "horovod-reference: horovodrun -np 2 --gloo starting rdmatensor's tests/tf/launcher_script.py"
RDMATENSOR_TOKEN=$(openssl rand -hex 16) PYTHONPATH="$PWD" TF_CPP_MIN_LOG_LEVEL=2 \
  "$venv/bin/horovodrun" -np 2 -H localhost:2 --gloo "$PWD/.venv/bin/python" tests/tf/launcher_script.py \
  | grep -E "^\[[0-9]+\]<stdout>:rank " | sort
