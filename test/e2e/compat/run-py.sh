#!/usr/bin/env bash
# Runs Python suites (pytest files, with their conftest) against one
# published version of a PyPI SDK package, installed once into the cache
# (install.sh). Run under the system harness:
#
#   go run ./test/e2e/node/system -domain -- bash test/e2e/compat/run-py.sh e2b==2.0.0 test/e2e/compat/py/test_domain.py
set -euo pipefail
spec=$1; shift
dir=$(bash "$(dirname "$0")/install.sh" pypi "$spec")
exec "$dir/bin/python" -m pytest -p no:cacheprovider -q "$@"
