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

"$BIN/cubelet" ${CUBELET_CONFIG:+--config "$CUBELET_CONFIG"} 2>&1 | tee -a /var/log/cube/cubelet.log &
pid=$!
trap 'kill -TERM $pid 2>/dev/null; wait $pid' INT TERM
for _ in $(seq 1 300); do
  "$BIN/cubecli" node info >/dev/null 2>&1 && break
  sleep 0.2
done
"$BIN/cubecli" node info
if ! "$BIN/cubecli" template inspect busybox >/dev/null 2>&1; then
  "$BIN/cubecli" template import busybox "$layout"
fi
cat <<MSG

cubelet is up (socket /run/cube/cubelet.sock, gRPC 127.0.0.1:9999, metrics 127.0.0.1:9998/metrics).
Try:
  $BIN/cubecli sandbox create --template busybox
  $BIN/cubecli sandbox ls
MSG
wait $pid
