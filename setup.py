"""The compiled extensions, built by `pip install .` (and so by `make setup`):
each one that cannot be built (no compiler, no libibverbs-dev headers) is said
in one line, and its Python twin runs instead (rdmatensor/native.py). The verbs
endpoint links against the system's libibverbs, never a bundled copy; the shm
ring and the streaming copies rely on x86-64 (its store order, SSE2) and are
built there only. Everything else about the package is in pyproject.toml."""
import platform
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

FLAGS = ["-O2", "-g", "-Wall", "-Wno-missing-field-initializers"]
X86_64 = platform.machine() in ("x86_64", "AMD64")

EXTENSIONS = [
    Extension("rdmatensor.providers.verbs._native_endpoint", ["rdmatensor/providers/verbs/_native_endpoint.c"],
              libraries=["ibverbs"], extra_compile_args=FLAGS),
    Extension("rdmatensor.session._slots", ["rdmatensor/session/_slots.c"], extra_compile_args=FLAGS),
    Extension("rdmatensor.providers.tcp._inbox", ["rdmatensor/providers/tcp/_inbox.c"],
              depends=["rdmatensor/providers/emulated/_write_header.h"], extra_compile_args=FLAGS),
] + ([
    Extension("rdmatensor._streaming", ["rdmatensor/_streaming.c"], extra_compile_args=FLAGS),
    Extension("rdmatensor.providers.shm._completion_ring", ["rdmatensor/providers/shm/_completion_ring.c"],
              depends=["rdmatensor/providers/emulated/_write_header.h"], extra_compile_args=FLAGS),
] if X86_64 else [])


class BuildOrSay(build_ext):
    """Build each extension it can; say in one line which it could not, and go on."""

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001 - compiler or linker missing: the Python twin runs
            reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            print(f"rdmatensor: {ext.name} not compiled ({reason}); its Python twin runs "
                  f"(apt-get install gcc python3-dev libibverbs-dev, then reinstall)", file=sys.stderr)


setup(ext_modules=EXTENSIONS, cmdclass={"build_ext": BuildOrSay})
