"""The launcher is rdmatensor.runner now (it imports no framework); these
modules keep the commands job files written before the move use working, and
say once, as a DeprecationWarning, what to use instead:

    run.py      `python -m tf_plugin.launcher.run`: rdmatensor-run
    cluster.py  `python -m tf_plugin.launcher.cluster`: rdmatensor.runner.cluster
"""
import warnings


def deprecated(old: str, new: str, module_name: str) -> None:
    """Warn that module `old` (run as `python -m old` when `module_name` is
    __main__) is deprecated in favour of `new`, once: called at a shim's import.

    Run with -m, the shim is __main__, and a DeprecationWarning raised there is shown
    by default, so whoever runs the old command reads it; imported, the warning names
    the importer's line (warnings skips the import machinery's frames), shown where
    that importer is __main__ or warnings are on (test runners, -W default)."""
    used = f"`python -m {old}`" if module_name == "__main__" else f"`{old}`"
    warnings.warn(f"{used} is deprecated: use {new} instead", DeprecationWarning,
                  stacklevel=2 if module_name == "__main__" else 3)
