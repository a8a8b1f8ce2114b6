#!/usr/bin/env bash
# The project's test command (README quick start, second command; CI runs
# it through .ci/run). Needs root: the tests use real loop devices, XFS,
# mounts, cgroups and runc.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="/usr/local/go/bin:$PATH"
bash hack/deps.sh

echo "== gofmt / go vet"
unformatted=$(gofmt -l $(git ls-files '*.go'))
if [ -n "$unformatted" ]; then echo "gofmt needed:"; echo "$unformatted"; exit 1; fi
go vet ./...

echo "== generated code is up to date"
make -s generate
if ! git diff --quiet -- api/; then
  echo "api/ is stale: run 'make generate' and commit"; git diff --stat -- api/; exit 1
fi

echo "== go test"
# -p 2: the machines have 2 cores; packages that start sandboxes are heavy.
go test -p 2 -count=1 -timeout 40m ./... "$@"
