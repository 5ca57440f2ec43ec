"""`python -m tf_plugin.launcher.run` as before, deprecated: rdmatensor-run (rdmatensor.runner.cli)."""
import sys

from rdmatensor.runner.cli import main

from . import deprecated

deprecated("tf_plugin.launcher.run", "`rdmatensor-run` (rdmatensor.runner.cli)", __name__)

if __name__ == "__main__":
    sys.exit(main())
