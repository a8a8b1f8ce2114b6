#!/usr/bin/env bash
# Builds SeaweedFS's weed, the S3-compatible object store the snapshot store
# tests run against (internal/objstore/objstoretest), at the version pinned in
# hack/s3/go.mod, from the Go module proxy. The binary is cached outside the
# clone, keyed by that version: $CUBE_WEED_CACHE/<version>/weed (default
# /var/cache/cube/weed); a cached one is reused. Prints the binary's path.
set -euo pipefail
cd "$(dirname "$0")"
ver=$(awk '$1 == "require" && $2 == "github.com/seaweedfs/seaweedfs" {print $3}' go.mod)
cache="${CUBE_WEED_CACHE:-/var/cache/cube/weed}/$ver"
if [ -x "$cache/weed" ]; then echo "$cache/weed"; exit 0; fi
mkdir -p "$cache"
echo "building weed $ver (a few minutes on 2 cores, then cached in $cache)" >&2
tmp=$(mktemp "$cache/weed.XXXXXX")
trap 'rm -f "$tmp"' EXIT
# -mod=mod: the module's go.sum is filled from the proxy on first build.
GOFLAGS=-mod=mod go build -o "$tmp" github.com/seaweedfs/seaweedfs/weed
chmod 0755 "$tmp"
mv "$tmp" "$cache/weed"
trap - EXIT
echo "$cache/weed"
