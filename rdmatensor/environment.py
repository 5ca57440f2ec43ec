"""One rule for every setting read from the environment: a variable set to ""
is unset, and its default holds. An assignment with nothing after its `=`, in
a shell, an `mpirun -x` or a job file, leaves a variable empty where the user
meant "not set"; shells and launchers make the difference hard to see, so
none is made here."""
from __future__ import annotations

import os
from collections.abc import Mapping


def get(name: str, default: str | None = None, env: Mapping[str, str] | None = None) -> str | None:
    """`name`'s value in `env` (the process's environment by default), else `default`
    where it is unset or empty."""
    value = (os.environ if env is None else env).get(name, "")
    return default if value == "" else value
