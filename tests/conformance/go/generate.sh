#!/usr/bin/env bash
# Generates the Go code of the rollout_checkpoint.v1 protos into gen/checkpointv1/ (not
# committed), or into OUT/gen/checkpointv1/ with `generate.sh OUT` (tests/test_conformance.py
# builds a copy of this module in a temporary directory). `go generate` runs it too.
#
# The protoc plugins are the versions pinned as `tool` lines in go.mod (checksummed in
# go.sum); `GOBIN=$PWD/.bin go install tool` puts them in .bin/ (scripts/test does). protoc
# itself is grpcio-tools' (`python -m grpc_tools.protoc`), the project's only protoc.
#
# The protos' go_package names the path a published module would use
# (github.com/rollout-checkpoint/rollout-checkpoint/gen/go/...). No such module exists, so
# the M options map every file into this module instead, the way any consumer that
# generates its own copy would.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../../.." && pwd)"
PYTHON="${PYTHON:-$repo/.venv/bin/python}"
module="$(cd "$here" && go list -m)"
package="$module/gen/checkpointv1"
out="$(cd "${1:-$here}" && pwd)"

for plugin in protoc-gen-go protoc-gen-go-grpc; do
  if [ ! -x "$here/.bin/$plugin" ]; then
    echo "generate.sh: $here/.bin/$plugin is missing; run: (cd $here && GOBIN=\$PWD/.bin go install tool)" >&2
    exit 1
  fi
done

cd "$repo/protos"
files=(rollout_checkpoint/v1/*.proto) # every file of the package, one Go package
cd "$repo"
go_opts=("module=$module")
for f in "${files[@]}"; do go_opts+=("M$f=$package;checkpointv1"); done
opts="$(IFS=,; echo "${go_opts[*]}")"

rm -rf "$out/gen"
"$PYTHON" -m grpc_tools.protoc -Iprotos -Ithird_party/googleapis \
  --plugin=protoc-gen-go="$here/.bin/protoc-gen-go" \
  --plugin=protoc-gen-go-grpc="$here/.bin/protoc-gen-go-grpc" \
  --go_out="$out" --go_opt="$opts" \
  --go-grpc_out="$out" --go-grpc_opt="$opts" \
  "${files[@]/#/protos/}"
