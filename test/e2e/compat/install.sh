#!/usr/bin/env bash
# Installs one published SDK version once into a cache outside the clone,
# keyed by name and version, and prints its directory:
#
#   bash test/e2e/compat/install.sh npm e2b@1.13.2      -> $CUBE_SDK_CACHE/npm/e2b@1.13.2
#   bash test/e2e/compat/install.sh pypi e2b==2.0.0     -> $CUBE_SDK_CACHE/pypi/e2b==2.0.0-py3.11
#
# npm: `npm install` of exactly that version into <dir>/node_modules.
# pypi: a virtualenv (per interpreter version) with that version and the
# test runner (pytest, as test/e2e/python/requirements.txt pins it).
# $CUBE_SDK_CACHE is /var/cache/cube/sdk by default. One install per key at
# a time (flock); .ready marks a finished one, so an interrupted install
# is redone rather than used.
set -euo pipefail
kind=$1 spec=$2
cache="${CUBE_SDK_CACHE:-/var/cache/cube/sdk}"
py="${CUBE_PYTHON:-python3}"
case "$kind" in
npm) dir="$cache/npm/$spec" ;;
pypi) dir="$cache/pypi/$spec-py$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" ;;
*) echo "install.sh: kind npm or pypi, not $kind" >&2; exit 2 ;;
esac
mkdir -p "$(dirname "$dir")"
exec 9>"$dir.lock"
flock 9
if [ ! -e "$dir/.ready" ]; then
  rm -rf "$dir"
  mkdir -p "$dir"
  case "$kind" in
  npm)
    echo '{"private":true,"type":"module"}' >"$dir/package.json"
    npm install --prefix "$dir" --no-audit --no-fund --loglevel=error --save-exact "$spec" >&2 ;;
  pypi)
    pytest=$(sed -n 's/^\(pytest==[^ ]*\).*/\1/p' "$(dirname "$0")/../python/requirements.txt")
    "$py" -m venv "$dir"
    "$dir/bin/pip" install -q --disable-pip-version-check "$spec" "${pytest:-pytest}" >&2 ;;
  esac
  touch "$dir/.ready"
fi
echo "$dir"
