"""The compiled extensions, each beside a Python twin that does the same work.

`make setup` builds them (scripts/build_native.sh). Where one is not built,
its twin runs; where it is, a variable set to `python` forces the twin
(RDMATENSOR_SHM_RING, RDMATENSOR_TCP_INBOX, RDMATENSOR_SLOTS), which the
tests use to hold the two to the same contract."""
from __future__ import annotations

import importlib
import os
from types import ModuleType


def load(module: str) -> tuple[ModuleType | None, str | None]:
    """The built extension `module` (a dotted name), or None and why it is not there."""
    try:
        return importlib.import_module(module), None
    except ImportError as exc:
        return None, str(exc)


def chosen(extension: ModuleType | None, env: str) -> bool:
    """Whether the built `extension` runs: it is built and `env` does not say python."""
    return extension is not None and os.environ.get(env, "") != "python"
