"""Providers measured against, never chosen by auto: gRPC messages, and RPC over verbs."""
