#!/usr/bin/env bash
# The README's two commands, `bash run.sh demo` and `bash run.sh test`: any
# target of the Makefile, with make's own arguments after it. A bare Debian
# (the debian:bookworm image: no make, no compiler, no python) has all this
# needs: it installs make, as root, and the target's `make setup` installs
# the rest (scripts/setup.sh). Silent when make is there.
set -euo pipefail
cd "$(dirname "$0")"
[ $# -ge 1 ] || { echo "usage: bash run.sh TARGET [make arguments] (demo, test, or any Makefile target)" >&2; exit 2; }

if ! command -v make >/dev/null; then
  [ "$(id -u)" = 0 ] || { echo "run.sh: make is not installed; run as root, or first: apt-get install make" >&2; exit 1; }
  echo "run.sh: installing make"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends make >/dev/null
fi
exec make "$@"
