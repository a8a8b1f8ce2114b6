#!/usr/bin/env bash
# README quick start, first command: install what is needed, build, start
# the whole single-node system with embedded defaults, import the default
# templates, and keep serving.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="/usr/local/go/bin:$PATH"
[ "$(id -u)" = 0 ] || { echo "run as root (cubelet manages mounts, cgroups, namespaces and runc)"; exit 1; }
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
# Guest kernel + initramfs for the vm runtime (Debian's cloud kernel,
# unpacked; cached). Without them cubelet runs runc and gvisor only.
if [ "${CUBE_SKIP_VM:-0}" != 1 ]; then
  echo "building the VM guest kernel and initramfs (cached in /var/lib/cube/vm)..."
  go run ./hack/vm-guest --out /var/lib/cube/vm >/dev/null || echo "warning: no VM guest artifacts; the vm runtime stays off" >&2
fi

# One supervised process group: network-agent, cubelet, cubemaster (E2B
# API on :3000) and the sandbox route (:8081). It prints the E2B_* variables
# to use and keeps serving; Ctrl-C stops the daemons, sandboxes keep running
# and are adopted by the next start (docs/control-plane.md).
if [ -n "$base_layout" ]; then
  exec "$BIN/cube" up --template base --template-source "$base_layout" --import busybox="$layout" "$@"
fi
exec "$BIN/cube" up --template busybox --template-source "$layout" "$@"
