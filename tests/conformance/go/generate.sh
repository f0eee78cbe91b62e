#!/usr/bin/env bash
# Generates the Go code of the rollout_checkpoint.v1 protos into gen/rollout_checkpoint/v1/
# (not committed), or into OUT/gen/rollout_checkpoint/v1/ with `generate.sh OUT`
# (tests/test_conformance.py builds a copy of this module in a temporary directory).
# `go generate` runs it too. The package is imported as
# <this module>/gen/rollout_checkpoint/v1 (package name checkpointv1).
#
# The protoc plugins are the versions pinned as `tool` lines in go.mod (checksummed in
# go.sum); `GOBIN=$PWD/.bin go install tool` puts them in .bin/ (scripts/test does). protoc
# itself is grpcio-tools' (`python -m grpc_tools.protoc`), the project's only protoc.
#
# No remapping: every file of the package has the same go_package (one Go package,
# checkpointv1), so no generated file imports another by that path, and
# `paths=source_relative` writes each next to its .proto's path under gen/. This is what
# any consumer that generates its own copy does (docs/controllers.md,
# "Regenerating and evolving the contract").
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../../.." && pwd)"
PYTHON="${PYTHON:-$repo/.venv/bin/python}"
out="$(cd "${1:-$here}" && pwd)"

for plugin in protoc-gen-go protoc-gen-go-grpc; do
  if [ ! -x "$here/.bin/$plugin" ]; then
    echo "generate.sh: $here/.bin/$plugin is missing; run: (cd $here && GOBIN=\$PWD/.bin go install tool)" >&2
    exit 1
  fi
done

cd "$repo"
rm -rf "$out/gen"
mkdir -p "$out/gen"
"$PYTHON" -m grpc_tools.protoc -Iprotos -Ithird_party/googleapis \
  --plugin=protoc-gen-go="$here/.bin/protoc-gen-go" \
  --plugin=protoc-gen-go-grpc="$here/.bin/protoc-gen-go-grpc" \
  --go_out="$out/gen" --go_opt=paths=source_relative \
  --go-grpc_out="$out/gen" --go-grpc_opt=paths=source_relative \
  protos/rollout_checkpoint/v1/*.proto
