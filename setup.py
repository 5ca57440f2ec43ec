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
    """Build each extension it can; say in one line which it could not (the
    compiler's own message above it says why), and go on without it."""

    failed: set = set()

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001 - compiler, header or library missing: the Python twin runs
            self.failed.add(ext.name)
            print(f"rdmatensor: {ext.name} not compiled ({type(exc).__name__}); its Python twin runs "
                  f"(apt-get install gcc python3-dev libibverbs-dev, then reinstall)", file=sys.stderr)

    def copy_extensions_to_source(self):      # in place: only what was built
        every, self.extensions = self.extensions, [e for e in self.extensions if e.name not in self.failed]
        try:
            super().copy_extensions_to_source()
        finally:
            self.extensions = every


setup(ext_modules=EXTENSIONS, cmdclass={"build_ext": BuildOrSay})
