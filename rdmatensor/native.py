"""The compiled extensions, each beside a Python twin that does the same work.

`pip install .` and `make setup` build them (setup.py). Where one is not built,
its twin runs; where it is, a variable set to `python` forces the twin
(RDMATENSOR_SHM_RING, RDMATENSOR_TCP_INBOX, RDMATENSOR_SLOTS), which the
tests use to hold the two to the same contract."""
from __future__ import annotations

import importlib
import os
import platform
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


EXTENSIONS = {     # what each compiled part does -> the Python module that loads it (its BUILD_ERROR)
    "the verbs endpoint": "rdmatensor.providers.verbs.native_endpoint",
    "the slots and the hop": "rdmatensor.session.slots",
    "tcp's inbox": "rdmatensor.providers.tcp.inbox",
}
if platform.machine() in ("x86_64", "AMD64"):      # they rely on x86-64 (setup.py builds them there only)
    EXTENSIONS.update({"shm's completion ring": "rdmatensor.providers.shm.completion_ring",
                       "streaming copies and sums": "rdmatensor.streaming"})


def built() -> dict[str, str | None]:
    """Each compiled part -> None where it is built and loads, else why not."""
    return {what: importlib.import_module(module).BUILD_ERROR for what, module in EXTENSIONS.items()}
