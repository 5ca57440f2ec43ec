"""The gRPC control plane: authentication, plan digests, descriptor exchange,
barriers, orderly close. Generated code: control_pb2*.py (`make proto`)."""
