#!/usr/bin/env bash
# The domain-mode suites (E2B_DOMAIN alone + the CA) against every SDK
# version of the compatibility matrix, on one system in domain mode:
#
#   go run ./test/e2e/node/system -domain -- bash test/e2e/compat/domain-suites.sh
#
# Each version is installed once into $CUBE_SDK_CACHE (install.sh). Every
# suite runs; the exit status is 1 when any failed. CUBE_TEST_NODE=0
# leaves out the JS ones. The versions are the matrix's (docs/proxy.md,
# docs/compatibility.md): JS 1.x last, 2.x oldest supported, newest;
# Python 2.x oldest supported, newest.
#
# With --install it only installs the versions (hack/test.sh does so before
# starting the system: npm install in the harness's mount namespace, whose
# resolver is the test's, stalled).
set -uo pipefail
cd "$(dirname "$0")/../../.."
if [ "${1:-}" = --install ]; then
  set -e
  if [ "${CUBE_TEST_NODE:-1}" != 0 ]; then
    for v in ${CUBE_COMPAT_JS:-1.13.2 2.0.1 2.51.0}; do bash test/e2e/compat/install.sh npm "e2b@$v" >/dev/null; done
  fi
  for v in ${CUBE_COMPAT_PY:-2.0.0 2.63.0}; do bash test/e2e/compat/install.sh pypi "e2b==$v" >/dev/null; done
  exit 0
fi
rc=0
if [ "${CUBE_TEST_NODE:-1}" != 0 ]; then
  for v in ${CUBE_COMPAT_JS:-1.13.2 2.0.1 2.51.0}; do
    echo "-- domain mode: e2b@$v (JS)"
    bash test/e2e/compat/run-js.sh "e2b@$v" test/e2e/compat/domain.test.mjs || rc=1
  done
fi
for v in ${CUBE_COMPAT_PY:-2.0.0 2.63.0}; do
  echo "-- domain mode: e2b==$v (Python)"
  bash test/e2e/compat/run-py.sh "e2b==$v" test/e2e/compat/py || rc=1
done
exit $rc
