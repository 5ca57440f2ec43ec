"""shm: a peer on the same host: shared-memory arenas, memcpy, a completion ring checked like a NIC.

    channel.py          the channel: the peer's arenas mapped, payloads copied straight into its slots
    completion_ring.py  one direction's immediates in shared memory, no system call per message
    _completion_ring.c  the ring's compiled twin (x86-64)
"""
