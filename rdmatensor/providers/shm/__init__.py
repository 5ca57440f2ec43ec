"""shm: a peer on the same host: shared-memory arenas, memcpy, a completion ring checked like a NIC."""
