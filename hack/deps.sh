#!/usr/bin/env bash
# Installs the Debian packages cube needs on a node and in its tests.
# Idempotent: apt-get update runs once, and only when something is missing.
set -euo pipefail
PKGS=(runc xfsprogs e2fsprogs busybox-static util-linux iproute2 ca-certificates)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
