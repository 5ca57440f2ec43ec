#!/usr/bin/env bash
# Compile rdmatensor's C extensions in place for the virtualenv's Python, the
# same ones and the same way `pip install .` builds them (setup.py): each is
# rebuilt when its source or a header it depends on is newer. Then check that
# each imports and that the package runs it, not its Python twin: `make setup`
# installed the compiler and headers (gcc, python3-dev, libibverbs-dev), so
# here a part that did not build is an error, where pip goes on without it.
#
#   scripts/build_native.sh [VENV]      (default: .venv next to this repository)
set -euo pipefail
cd "$(dirname "$0")/.."
py="${1:-.venv}/bin/python"

[ -f /usr/include/infiniband/verbs.h ] \
  || { echo "build_native: <infiniband/verbs.h> is missing: apt-get install libibverbs-dev" >&2; exit 1; }
"$py" setup.py -q build_ext --inplace 2>&1 | grep -v "^running \|^copying \|^creating \|^$" || true
"$py" -c "
from rdmatensor import native
missing = {what: why for what, why in native.built().items() if why is not None}
assert not missing, missing
" || { echo "build_native: a compiled part does not load (above); its Python twin would run" >&2; exit 1; }
