#!/usr/bin/env bash
# Runs JS suites against one published version of an npm SDK package,
# installed once into the cache (install.sh): the suites are copied next to
# that version's node_modules, so their `import 'e2b'` resolves to it.
# Run under the system harness, which sets the E2B_* variables:
#
#   go run ./test/e2e/node/system -domain -- bash test/e2e/compat/run-js.sh e2b@1.13.2 test/e2e/compat/domain.test.mjs
set -euo pipefail
spec=$1; shift
dir=$(bash "$(dirname "$0")/install.sh" npm "$spec")
run=$(mktemp -d "$dir/run.XXXXXX")
trap 'rm -rf "$run"' EXIT
for f in "$@"; do cp "$f" "$run/"; done
cd "$run"
node --test --test-concurrency=1 --test-reporter=spec --test-reporter-destination=stdout ./*.test.mjs
