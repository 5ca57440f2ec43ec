"""verbs: real one-sided RDMA WRITE through an RC queue pair (InfiniBand, RoCE, SoftRoCE)."""
