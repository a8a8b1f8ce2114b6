#!/usr/bin/env bash
# Installs the Debian packages cube needs on a node and in its tests.
# Idempotent: apt-get update runs once, and only when something is missing.
set -euo pipefail
PKGS=(runc xfsprogs e2fsprogs busybox-static util-linux iproute2 ca-certificates
  mariadb-server # the catalog tests start a private server (CI must have it)
  podman         # cube-bench's podman-run baseline (Debian's podman, with runc)
  debootstrap    # builds the default `base` template (hack/base-image)
  runsc          # the gvisor runtime (gVisor, --platform=ptrace: no KVM needed)
  docker-registry # the template tests' loopback registry (started per test)
  nftables         # tests only: nft lists rule sets for golden files (network-agent uses netlink)
  chromium         # tests only: the console's browser test (puppeteer-core drives it)
  python3-venv     # the Python SDK suites' virtualenv (test/e2e/python/run.sh)
  qemu-system-x86 zstd) # the vm runtime: QEMU micro-VMs, memory images through zstd (docs/vm.md)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  # The package enables a registry on :5000 (all interfaces) under systemd;
  # the tests start their own on loopback, so a fresh install stays off.
  if [[ " ${missing[*]} " == *" docker-registry "* ]] && [ -d /run/systemd/system ]; then
    systemctl disable --now docker-registry.service >/dev/null 2>&1 || true
  fi
fi
# The Node e2e suite (hack/test.sh) needs node >= 20.18.1 with npm. Debian
# 12's nodejs is 18, too old for the pinned e2b SDK: install Node 20+ from
# nodejs.org or NodeSource. Nodes that only run cube need neither.
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
  echo "note: node/npm not found; the Node e2e suite will not run (CUBE_TEST_NODE=0 skips it)" >&2
fi
