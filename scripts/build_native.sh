#!/usr/bin/env bash
# Compile rdmatensor's C extensions for the virtualenv's Python, each when its
# built module is missing or older than its source, and check that it imports:
#   - the verbs endpoint (rdmatensor/providers/verbs/_native_endpoint.c), against libibverbs;
#   - streaming copies and sums (rdmatensor/_streaming.c), x86-64 only (SSE2):
#     elsewhere rdmatensor.streaming uses numpy;
#   - a slot's state and the immediates that move it (rdmatensor/session/_slots.c);
#   - the shm completion ring (rdmatensor/providers/shm/_completion_ring.c), x86-64 only, as
#     shm itself (it relies on x86-64's store order);
#   - tcp's inbox (rdmatensor/providers/tcp/_inbox.c).
# Fails loudly: `make setup` installs what they need (gcc, libibverbs-dev, python3-dev).
#
#   scripts/build_native.sh [VENV]      (default: .venv next to this repository)
set -euo pipefail
cd "$(dirname "$0")/.."
py="${1:-.venv}/bin/python"
suffix=$("$py" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
include=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')

build() {   # build SOURCE [LIBS...]
  local src=$1 out="${1%.c}$suffix"
  shift
  local newer="" header
  for header in $(sed -n 's/^#include "\(.*\)"/\1/p' "$src"); do   # the project's own headers it includes
    [ "$(dirname "$src")/$header" -nt "$out" ] && newer=1
  done
  if [ ! -f "$out" ] || [ "$src" -nt "$out" ] || [ -n "$newer" ]; then
    echo "setup: compiling $out"
    cc -O2 -g -Wall -Wno-missing-field-initializers -shared -fPIC -I"$include" "$src" -o "$out.tmp" "$@"
    mv "$out.tmp" "$out"
  fi
}

[ -f /usr/include/infiniband/verbs.h ] \
  || { echo "build_native: <infiniband/verbs.h> is missing: apt-get install libibverbs-dev" >&2; exit 1; }
check() {   # check MODULE WHAT: the extension imports and the package says it is built
  "$py" -c "import rdmatensor.$1 as m; assert m.BUILD_ERROR is None, m.BUILD_ERROR" \
    || { echo "build_native: $2 does not import" >&2; exit 1; }
}

# Every extension first, then the checks: importing one imports the package,
# which needs the others current (an older build of one would fail it).
build rdmatensor/providers/verbs/_native_endpoint.c -libverbs
build rdmatensor/session/_slots.c
build rdmatensor/providers/tcp/_inbox.c
if [ "$(uname -m)" = x86_64 ]; then
  build rdmatensor/_streaming.c
  build rdmatensor/providers/shm/_completion_ring.c
fi
check providers.verbs.native_endpoint "the verbs endpoint"
check session.slots "the compiled slots"
check providers.tcp.inbox "the compiled tcp inbox"
if [ "$(uname -m)" = x86_64 ]; then
  check streaming "the streaming extension"
  check providers.shm.completion_ring "the compiled shm ring"
fi
