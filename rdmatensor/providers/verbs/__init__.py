"""verbs: real one-sided RDMA WRITE through an RC queue pair (InfiniBand, RoCE, SoftRoCE).

channel.py is a channel over one queue pair; rails.py, over several NICs
(RDMATENSOR_IB_RAILS): imported here so that a VerbsChannel opens over
several rails wherever that is asked for.
"""
from . import rails  # noqa: F401 - registers the channel over several rails with VerbsChannel
