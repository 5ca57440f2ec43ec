"""`tf_plugin.launcher.cluster` as before: rdmatensor.runner.cluster."""
import sys

from rdmatensor.runner.cluster import Cluster, expand_hostlist, expand_tasks_per_node, free_ports, main

__all__ = ["Cluster", "expand_hostlist", "expand_tasks_per_node", "free_ports", "main"]

if __name__ == "__main__":
    sys.exit(main())
