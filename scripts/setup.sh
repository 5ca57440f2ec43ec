#!/usr/bin/env bash
# Install everything rdmatensor needs on Debian (bookworm), as root, and the
# project itself into a virtualenv. Idempotent: seconds when nothing is missing.
#
#   scripts/setup.sh [VENV]      (default: .venv next to this repository)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv}"

# rdma-core userspace, Debian's pyverbs (for /usr/bin/python3), perftest, what
# the compiled verbs endpoint is built with (gcc, libibverbs-dev, python3-dev),
# what the SoftRoCE VM needs: qemu, the stock kernel (with rdma_rxe), busybox; and
# Open MPI's mpirun, one of the launchers a job can be started with (tests/tf/test_launchers.py);
# OpenSSH, which rdmatensor-run starts remote ranks with (the two-VM job runs sshd in each VM).
packages=(rdma-core ibverbs-providers ibverbs-utils perftest python3-pyverbs
          python3-venv python3-dev gcc g++ libc6-dev libibverbs-dev qemu-system-x86 linux-image-amd64
          busybox-static iproute2 kmod cpio gzip procps openssl openmpi-bin
          openssh-client openssh-server)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# The virtualenv must see Debian's pyverbs, which is built for /usr/bin/python3.
if [ ! -x "$venv/bin/python" ]; then
  echo "setup: creating $venv from /usr/bin/python3 with system site packages"
  /usr/bin/python3 -m venv --system-site-packages "$venv"
fi

# Reinstall the project only when its metadata changed.
stamp="$venv/.rdmatensor-installed"
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing rdmatensor and its Python dependencies into $venv"
  "$venv/bin/python" -m pip install -q --upgrade pip setuptools wheel
  "$venv/bin/python" -m pip install -q -e ".[tf,bench,dev]"
  echo "$want" > "$stamp"
fi
# Horovod's own key-value store, which horovodrun serves a job's rendezvous
# through: its sources (pure Python, not built) for tests/tf/test_launchers.py.
hvd="$venv/share/horovod-0.28.1"
if [ ! -f "$hvd/horovod/runner/http/http_server.py" ]; then
  tmp=$(mktemp -d)
  "$venv/bin/python" -m pip download -q --no-deps --no-binary :all: horovod==0.28.1 -d "$tmp"
  mkdir -p "$venv/share" && tar -xzf "$tmp/horovod-0.28.1.tar.gz" -C "$venv/share"
  rm -rf "$tmp"
fi
# The verbs endpoint in C, rebuilt when its source changed.
bash scripts/build_native.sh "$venv"
# The TensorFlow ops of the shared-memory all-reduce (tf_plugin/native): built
# here against the TensorFlow present, so a job never waits for g++ on its
# first step (the cache hit costs TensorFlow's import, a few seconds).
log=$(mktemp)
if ! TF_CPP_MIN_LOG_LEVEL=2 "$venv/bin/python" -c "
import sys
from tf_plugin.native import build
sys.exit(0 if build.library('ops') is not None else 1)
" 2> "$log"; then
  grep -v "oneDNN\|absl::InitializeLog\|cpu_feature_guard\|rebuild TensorFlow" "$log" >&2 || true
  rm -f "$log"
  echo "setup: the TensorFlow op library did not build (above); the Python path would run" >&2
  exit 1
fi
rm -f "$log"
"$venv/bin/python" -c "import pyverbs, numpy, grpc" \
  || { echo "setup: the virtualenv cannot import pyverbs/numpy/grpc" >&2; exit 1; }
