#!/usr/bin/env bash
# The SDK suites that run against one system started with the
# code-interpreter template (go run ./test/e2e/node/system
# -code-interpreter -- bash test/e2e/sdk-suites.sh): the Python SDK
# (sync, async, code interpreter) and, unless CUBE_TEST_NODE=0, the JS
# code-interpreter SDK, and, unless CUBE_TEST_GO_SDK=0, the Go SDK's
# suite (sdk/go). Every suite runs; the exit status is 1 when any
# failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
rc=0
echo "-- python: e2b, e2b-code-interpreter"
bash test/e2e/python/run.sh || rc=1
if [ "${CUBE_TEST_NODE:-1}" != 0 ]; then
  echo "-- node: @e2b/code-interpreter"
  npm --prefix test/e2e/node run test:codeinterpreter || rc=1
fi
if [ "${CUBE_TEST_GO_SDK:-1}" != 0 ]; then
  echo "-- go: sdk/go"
  (cd sdk/go && go test -count=1 -v -timeout 15m ./...) || rc=1
fi
exit $rc
