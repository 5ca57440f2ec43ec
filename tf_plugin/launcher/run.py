"""`python -m tf_plugin.launcher.run` as before: rdmatensor-run (rdmatensor.runner.cli)."""
import sys

from rdmatensor.runner.cli import main

if __name__ == "__main__":
    sys.exit(main())
