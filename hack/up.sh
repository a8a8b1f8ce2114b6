#!/usr/bin/env bash
# README quick start, first command: install what is needed, build, start
# the single-node system with embedded defaults, import the default
# template, and keep serving (Ctrl-C stops cubelet; sandboxes keep running
# and are adopted by the next start).
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="/usr/local/go/bin:$PATH"
[ "$(id -u)" = 0 ] || { echo "run as root (cubelet manages mounts, cgroups and runc)"; exit 1; }
bash hack/deps.sh
make -s build
BIN=$PWD/bin
STATE=/var/lib/cube
mkdir -p "$STATE/images" /var/log/cube
layout=$(go run ./hack/busybox-image "$STATE/images")
# The default template `base` (what E2B's Sandbox.create() asks for):
# Debian bookworm + python3, bash, curl..., built with debootstrap from the
# apt mirror this machine uses. About a minute the first time, then cached
# in /var/cache/cube/base until an input changes (docs/templates.md).
base_layout=""
if [ "${CUBE_SKIP_BASE:-0}" != 1 ]; then
  echo "building the base image (cached in /var/cache/cube/base)..."
  base_layout=$(go run ./hack/base-image /var/cache/cube/base)
fi

"$BIN/cubelet" ${CUBELET_CONFIG:+--config "$CUBELET_CONFIG"} 2>&1 | tee -a /var/log/cube/cubelet.log &
pid=$!
trap 'kill -TERM $pid 2>/dev/null; wait $pid' INT TERM
for _ in $(seq 1 300); do
  "$BIN/cubecli" node info >/dev/null 2>&1 && break
  sleep 0.2
done
"$BIN/cubecli" node info
# Imports are idempotent: the same image under the same ID is a no-op.
import_template() {
  local rc=0
  "$BIN/cubecli" template import "$1" "$2" || rc=$?
  if [ "$rc" = 4 ]; then
    echo "template $1 exists from another image; keeping it ('cubecli template rm $1' and rerun to replace it)"
  elif [ "$rc" != 0 ]; then
    return "$rc"
  fi
}
import_template busybox "$layout"
[ -z "$base_layout" ] || import_template base "$base_layout"
cat <<MSG

cubelet is up (socket /run/cube/cubelet.sock, gRPC 127.0.0.1:9999, metrics 127.0.0.1:9998/metrics).
Try:
  $BIN/cubecli sandbox create --template base
  $BIN/cubecli sandbox create --template busybox
  $BIN/cubecli sandbox ls
MSG
wait $pid
