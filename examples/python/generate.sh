#!/usr/bin/env bash
# Generates the Python gRPC stubs from ../../proto into ./generated (not committed).
# Run it with the Python that has requirements.txt installed, e.g. an activated venv,
# or name one with PYTHON=/path/to/python.
set -euo pipefail
cd "$(dirname "$0")"

rm -rf generated
mkdir -p generated
"${PYTHON:-python3}" -m grpc_tools.protoc \
  --proto_path=../../proto \
  --python_out=generated --pyi_out=generated --grpc_python_out=generated \
  outbox/v1/outbox.proto
echo "generated $(pwd)/generated/outbox/v1"
