"""The gRPC control plane: setup, growth, barriers, liveness, orderly close.

    control.proto  the messages and services (generated: control_pb2.py, control_pb2_grpc.py; `make proto`)
    service.py     server and client: token check, TLS, bounded threads for waiting calls
    servicers.py   the handlers: authorize, hand over to the session part that owns the call
    proof.py       proof of the job token without sending it: an HMAC on every call
    auth.py        pair credentials: which rank a caller is
    status.py      errors across the wire: the class as a code in trailing metadata
"""
