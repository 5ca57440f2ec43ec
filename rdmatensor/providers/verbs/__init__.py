"""verbs: real one-sided RDMA WRITE through an RC queue pair (InfiniBand, RoCE, SoftRoCE).

channel.py is a channel over one queue pair; rails.py, over several NICs
(RDMATENSOR_IB_RAILS): imported here so that a VerbsChannel opens over
several rails wherever that is asked for.

    channel.py           the channel over one queue pair
    rails.py             several NICs to one peer, large writes striped over them
    rc.py                what both RC endpoints share: contract, parameters, helpers
    native_endpoint.py   the RC endpoint, compiled (_native_endpoint.c): the default
    pyverbs_endpoint.py  the same endpoint through pyverbs: the fallback
    choose_endpoint.py   which of the two opens (RDMATENSOR_VERBS_ENDPOINT)
    choose_port.py       which device, port and GID (RDMATENSOR_IB_HCA, RDMATENSOR_IB_GID_INDEX)
    addressing.py        the route by each link layer's rules, and the fabric settings (RDMATENSOR_IB_*)
"""
from . import rails  # noqa: F401 - registers the channel over several rails with VerbsChannel
