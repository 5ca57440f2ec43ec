"""`tf_plugin.launcher.cluster` as before, deprecated: rdmatensor.runner.cluster."""
import sys

from rdmatensor.runner.cluster import Cluster, expand_hostlist, expand_tasks_per_node, free_ports, main

from . import deprecated

__all__ = ["Cluster", "expand_hostlist", "expand_tasks_per_node", "free_ports", "main"]

deprecated("tf_plugin.launcher.cluster", "`rdmatensor.runner.cluster` (`python -m rdmatensor.runner.cluster`)",
           __name__)

if __name__ == "__main__":
    sys.exit(main())
