#!/usr/bin/env bash
# Runs the Python SDK suites (sync and async) in a virtualenv made from
# requirements.txt (PyPI), cached outside the clone in
# $CUBE_PY_CACHE/<sha256 of requirements.txt and the interpreter's version>
# so that later runs install nothing. Arguments go to pytest. Run under the
# system harness, which sets the E2B_* variables:
#
#   go run ./test/e2e/node/system -- bash test/e2e/python/run.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
py="${CUBE_PYTHON:-python3}"
req="${CUBE_PY_REQUIREMENTS:-$here/requirements.txt}"
key=$( { cat "$req"; "$py" -c 'import sys; print(sys.version)'; } | sha256sum | cut -c1-16)
venv="${CUBE_PY_CACHE:-/var/cache/cube/pyenv}/$key"
mkdir -p "$(dirname "$venv")"
# One install per key at a time; .ready marks a finished one, so an
# interrupted install is redone rather than used.
exec 9>"$venv.lock"
flock 9
if [ ! -e "$venv/.ready" ]; then
  rm -rf "$venv"
  "$py" -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check -r "$req"
  touch "$venv/.ready"
fi
exec 9>&-
cd "$here"
exec "$venv/bin/python" -m pytest -p no:cacheprovider -q "$@"
