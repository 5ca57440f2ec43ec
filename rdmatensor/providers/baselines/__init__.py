"""Providers measured against, never chosen by auto:

    grpc_channel.py       grpc: every write a gRPC message, serialized and copied (what rdmatensor replaces)
    verbs_rpc_channel.py  verbs-rpc: the RPC that RDMA-optimized libraries build, on the same verbs device
"""
