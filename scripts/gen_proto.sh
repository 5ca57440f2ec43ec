#!/usr/bin/env bash
# Regenerate rdmatensor/control/control_pb2*.py from control.proto (make proto).
set -euo pipefail
cd "$(dirname "$0")/.."
"${PYTHON:-.venv/bin/python}" -m grpc_tools.protoc -I . --python_out=. --grpc_python_out=. \
  rdmatensor/control/control.proto
