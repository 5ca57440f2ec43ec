#!/usr/bin/env bash
# Compile the verbs endpoint in C (rdmatensor/providers/_verbs_native.c) for
# the virtualenv's Python, when the built module is missing or older than its
# source, and check that it imports. Fails loudly: `make setup` installs what
# it needs (gcc, libibverbs-dev, python3-dev).
#
#   scripts/build_native.sh [VENV]      (default: .venv next to this repository)
set -euo pipefail
cd "$(dirname "$0")/.."
py="${1:-.venv}/bin/python"
src=rdmatensor/providers/_verbs_native.c
suffix=$("$py" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
include=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
out="rdmatensor/providers/_verbs_native$suffix"
if [ ! -f "$out" ] || [ "$src" -nt "$out" ]; then
  [ -f /usr/include/infiniband/verbs.h ] \
    || { echo "build_native: <infiniband/verbs.h> is missing: apt-get install libibverbs-dev" >&2; exit 1; }
  echo "setup: compiling $out"
  cc -O2 -g -Wall -Wno-missing-field-initializers -shared -fPIC -I"$include" "$src" -o "$out.tmp" -libverbs
  mv "$out.tmp" "$out"
fi
"$py" -c "from rdmatensor.providers import rc_native as m; assert m.BUILD_ERROR is None, m.BUILD_ERROR" \
  || { echo "build_native: $out does not import" >&2; exit 1; }
