#!/usr/bin/env bash
# Regenerate the committed gRPC stubs: scripts/gen_proto.sh [OUT_DIR] (default: repo root).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$root}
mkdir -p "$out/ragserve/v1"
cd "$root"
"${PYTHON:-python}" -m grpc_tools.protoc -I proto --python_out="$out" --pyi_out="$out" \
  --grpc_python_out="$out" proto/ragserve/v1/*.proto
