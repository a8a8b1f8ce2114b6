#!/usr/bin/env bash
# Builds the Kubernetes binaries hack/kube-up.sh runs (kube-apiserver,
# kube-controller-manager, kube-scheduler, kubelet, kubectl) and helm from
# the Go module proxy, pinned by hack/kube/go.mod, into
# ${CUBE_KUBE_CACHE:-/var/cache/cube/kube}/<key>/bin, where <key> hashes the
# module files and the Go version: a changed input builds anew, an unchanged
# one is reused (a cold build takes about 10 minutes on 2 cores). Prints the
# bin directory.
set -euo pipefail
cd "$(dirname "$0")"
cache="${CUBE_KUBE_CACHE:-/var/cache/cube/kube}"
tools=(k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager
  k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kubectl
  helm.sh/helm/v3/cmd/helm)
# The key is every module the binaries link (path@version) and the Go
# version: a change elsewhere in the module (the chart tests' imports)
# keeps the cache.
# Stamped as the release it is (the API server reports it; helm checks a
# chart's kubeVersion against it).
ver=$(go list -m -f '{{.Version}}' k8s.io/kubernetes)
minor=$(echo "$ver" | cut -d. -f2)
ldflags="-s -X k8s.io/component-base/version.gitVersion=$ver -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor -X k8s.io/component-base/version.gitTreeState=clean"
ldflags="$ldflags -X k8s.io/client-go/pkg/version.gitVersion=$ver -X k8s.io/client-go/pkg/version.gitMajor=1 -X k8s.io/client-go/pkg/version.gitMinor=$minor"
key=$( (echo "$ldflags"; go list -deps -f '{{with .Module}}{{.Path}}@{{.Version}}{{with .Replace}}=>{{.Path}}@{{.Version}}{{end}}{{end}}' "${tools[@]}" | sort -u; go version) | sha256sum | cut -c1-16)
dir="$cache/$key"
if [ ! -f "$dir/done" ]; then
  mkdir -p "$cache"
  tmp=$(mktemp -d "$cache/.build.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  # The builds run at the lowest priority: the machines are shared.
  CGO_ENABLED=0 nice -n 19 go build -trimpath -ldflags="$ldflags" -o "$tmp/bin/" "${tools[@]}" >&2
  touch "$tmp/done"
  rm -rf "$dir"
  mv "$tmp" "$dir"
  trap - EXIT
fi
echo "$dir/bin"
