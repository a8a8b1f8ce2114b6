#!/usr/bin/env bash
# The project's test command (README quick start, second command; CI runs
# it through .ci/run). Needs root: the tests use real loop devices, XFS,
# mounts, cgroups and runc.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="/usr/local/go/bin:$PATH"
bash hack/deps.sh
# The suites start and reap processes by the thousand (runc, runsc, ip,
# nft, QEMU, daemons): with the kernel's default 32768 PIDs the numbers
# wrap within minutes on a busy machine, and a test's cleanup that signals
# a PID it remembered can reach another test's process. Nodes raise it too
# (the chart's prepare.sh).
sysctl -qw kernel.pid_max=4194304 || true

echo "== gofmt / go vet"
unformatted=$(gofmt -l $(git ls-files '*.go'))
if [ -n "$unformatted" ]; then echo "gofmt needed:"; echo "$unformatted"; exit 1; fi
go vet ./...
(cd sdk/go && go vet ./...) # the Go SDK, a module of its own

echo "== golangci-lint"
# .golangci.yml; the linter is pinned in hack/tools/go.mod and built by the
# go command on first use (about 1.5 min on 2 cores, then cached). Its
# analysis cache is $GOLANGCI_LINT_CACHE, by default golangci-lint next to
# Go's build cache (~/.cache), created on first use. docs/contributing.md.
export GOLANGCI_LINT_CACHE="${GOLANGCI_LINT_CACHE:-$(dirname "$(go env GOCACHE)")/golangci-lint}"
# --allow-serial-runners: another golangci-lint on the machine (a
# developer's) is waited for instead of failing the run.
make -s lint LINT_FLAGS=--allow-serial-runners
(cd sdk/go && go tool -modfile=../../hack/tools/go.mod golangci-lint run --allow-serial-runners --config ../../.golangci.yml ./...)

echo "== generated code is up to date"
make -s generate
if ! git diff --quiet -- api/; then
  echo "api/ is stale: run 'make generate' and commit"; git diff --stat -- api/; exit 1
fi

echo "== go test"
# The base template's debootstrap build (about a minute on these machines,
# then cached until an input changes) runs in CI; CUBE_TEST_BASE=0 skips it.
export CUBE_TEST_BASE="${CUBE_TEST_BASE:-1}" CUBE_BASE_CACHE="${CUBE_BASE_CACHE:-/var/cache/cube/base}"
# The snapshot store tests run SeaweedFS (hack/s3/weed.sh: built from the Go
# module proxy once, a few minutes, then cached in /var/cache/cube/weed).
export CUBE_WEED="${CUBE_WEED:-$(bash hack/s3/weed.sh)}"
# The console's browser test (internal/master/opsapi TestConsoleBrowser)
# drives Debian's chromium with puppeteer-core, pinned in
# hack/console-test/package-lock.json (no browser download).
npm ci --prefix hack/console-test --no-audit --no-fund --loglevel=error
export CUBE_ARTIFACTS="${CUBE_ARTIFACTS:-$PWD/.artifacts}"
# -p 2: the machines have 2 cores; packages that start sandboxes are heavy.
go test -p 2 -count=1 -timeout 40m ./... "$@"

# Every SDK suite below records its cases in $CUBE_E2E_RESULTS (the JS
# ones through a node:test reporter added by NODE_OPTIONS, the Python ones
# from their conftest); docs/compatibility.md is written from them when the
# script ends, failures included (test/e2e/compat).
export CUBE_E2E_RESULTS="${CUBE_E2E_RESULTS:-$(mktemp)}"
: >"$CUBE_E2E_RESULTS"
export NODE_OPTIONS="${NODE_OPTIONS:+$NODE_OPTIONS }--test-reporter=$PWD/test/e2e/node/compat-reporter.mjs --test-reporter-destination=stderr"
compat() {
  if [ -s "$CUBE_E2E_RESULTS" ] && go run ./test/e2e/compat -o docs/compatibility.md "$CUBE_E2E_RESULTS"; then
    echo "docs/compatibility.md written from $CUBE_E2E_RESULTS"
  fi
}
trap compat EXIT

# The unmodified E2B JS SDK (pinned in test/e2e/node/package-lock.json,
# installed from the npm registry) against a real sandbox; docs/envd.md.
# CUBE_TEST_NODE=0 skips it.
if [ "${CUBE_TEST_NODE:-1}" != 0 ]; then
  echo "== node e2e (e2b SDK)"
  if ! node -e 'const [a,b,c]=process.versions.node.split(".").map(Number); process.exit(a>20||(a==20&&(b>18||(b==18&&c>=1)))?0:1)' 2>/dev/null; then
    echo "the Node suite needs node >= 20.18.1 and npm (hack/deps.sh says how); CUBE_TEST_NODE=0 skips it"; exit 1
  fi
  npm ci --prefix test/e2e/node --no-audit --no-fund --loglevel=error
  go run ./test/e2e/node/harness -- npm --prefix test/e2e/node test
  # The same suite against a QEMU micro-VM sandbox (TCG; CUBE_VM_ACCEL=auto
  # uses KVM where it works; docs/vm.md). CUBE_TEST_VM=0 skips it.
  if [ "${CUBE_TEST_VM:-1}" != 0 ]; then
    echo "== node e2e: vm runtime"
    go run ./test/e2e/node/harness -runtime vm -- npm --prefix test/e2e/node test
  fi
  # And against a gVisor sandbox (runsc, ptrace). CUBE_TEST_GVISOR=0 skips it.
  if [ "${CUBE_TEST_GVISOR:-1}" != 0 ]; then
    echo "== node e2e: gvisor runtime"
    go run ./test/e2e/node/harness -runtime gvisor -- npm --prefix test/e2e/node test
  fi
  echo "== node e2e: control plane (e2b SDK against cube up's system)"
  # E2B_SANDBOX_URL is cubemaster's in-process cubeproxy; CUBE_TEST_PROXY=standalone
  # runs the suite through a separate cmd/cubeproxy process instead.
  proxy_flag=""; [ "${CUBE_TEST_PROXY:-}" = standalone ] && proxy_flag="-standalone-proxy"
  go run ./test/e2e/node/system $proxy_flag -- npm --prefix test/e2e/node run test:controlplane
  # Egress (DNS, domain policies, the egress proxy, credential injection,
  # audit) against a fake internet in its own namespace; the resolver and
  # a domain policy on the other runtimes too. docs/network.md.
  echo "== node e2e: egress"
  go run ./test/e2e/node/system -egress -- npm --prefix test/e2e/node run test:egress
  if [ "${CUBE_TEST_GVISOR:-1}" != 0 ]; then
    echo "== node e2e: egress, gvisor runtime"
    go run ./test/e2e/node/system -egress -runtime gvisor -- npm --prefix test/e2e/node run test:egress
  fi
  if [ "${CUBE_TEST_VM:-1}" != 0 ]; then
    echo "== node e2e: egress, vm runtime"
    go run ./test/e2e/node/system -egress -runtime vm -- npm --prefix test/e2e/node run test:egress
  fi
  # Snapshot, create from snapshot and fork of secure SDK sandboxes through
  # the E2B API on the memory-snapshot runtimes too (runc ran them above).
  if [ "${CUBE_TEST_GVISOR:-1}" != 0 ]; then
    echo "== node e2e: control plane snapshots, gvisor runtime"
    go run ./test/e2e/node/system -runtime gvisor -- npm --prefix test/e2e/node run test:snapshots
  fi
  if [ "${CUBE_TEST_VM:-1}" != 0 ]; then
    echo "== node e2e: control plane snapshots, vm runtime"
    go run ./test/e2e/node/system -runtime vm -- npm --prefix test/e2e/node run test:snapshots
  fi
fi

# The unmodified E2B Python SDK (sync and async) and both code-interpreter
# SDKs (JS and Python) against cube up's system, with the code-interpreter
# template (built from Debian once into $CUBE_BASE_CACHE, then cached; its
# server starts in each sandbox as the template's service). The virtualenv
# is cached in $CUBE_PY_CACHE (/var/cache/cube/pyenv) by the requirements'
# hash; test/e2e/python/run.sh. test/e2e/sdk-suites.sh also runs the Go
# SDK's suite (sdk/go). CUBE_TEST_PYTHON=0 skips them.
if [ "${CUBE_TEST_PYTHON:-1}" != 0 ]; then
  echo "== python e2e + code interpreter (e2b, e2b-code-interpreter, @e2b/code-interpreter SDKs)"
  go run ./test/e2e/node/system -code-interpreter -- bash test/e2e/sdk-suites.sh
  if [ "${CUBE_TEST_GVISOR:-1}" != 0 ]; then
    echo "== python e2e + code interpreter: gvisor runtime"
    go run ./test/e2e/node/system -runtime gvisor -code-interpreter -- bash test/e2e/sdk-suites.sh
  fi
fi
# Template builds through the E2B API with the unmodified JS SDK's Template
# builder: a Debian base, apt-get and pip steps over the node's egress allow
# list (the package mirrors the host reaches), a start command, the cached
# rebuild (docs/templates.md). CUBE_TEST_TEMPLATE_BUILDS=0 skips it.
if [ "${CUBE_TEST_TEMPLATE_BUILDS:-1}" != 0 ]; then
  echo "== node e2e: template builds (e2b Template builder)"
  go run ./test/e2e/node/system -template-builds -- npm --prefix test/e2e/node run test:templatebuild
fi
# Domain mode (docs/proxy.md): `cube up --domain-mode`, the SDKs configured
# by E2B_DOMAIN alone and the cluster CA, names from a test resolver; the
# domain suite against each SDK version of the matrix (JS 1.13.2, 2.0.1,
# 2.51.0; Python 2.0.0, 2.63.0; docs/compatibility.md), each installed once
# into $CUBE_SDK_CACHE (/var/cache/cube/sdk). About 75 s once installed.
# CUBE_TEST_DOMAIN=0 skips it; CUBE_TEST_PROXY=standalone serves the domain
# from a separate cmd/cubeproxy (--api) instead of cubemaster's route.
if [ "${CUBE_TEST_DOMAIN:-1}" != 0 ]; then
  echo "== domain mode + SDK versions (test/e2e/compat/domain-suites.sh)"
  domain_proxy=""; [ "${CUBE_TEST_PROXY:-}" = standalone ] && domain_proxy="-standalone-proxy"
  bash test/e2e/compat/domain-suites.sh --install
  go run ./test/e2e/node/system -domain $domain_proxy -- bash test/e2e/compat/domain-suites.sh
fi
# The Helm chart (deploy/helm/cube) with helm as a library, in its own
# module (hack/kube: Kubernetes v1.34 and helm): lint, every values overlay
# rendered and validated against Kubernetes' OpenAPI, probes, refusals.
echo "== helm chart"
(cd hack/kube && go test -count=1 ./...)
# The chart on a real cluster built from source (hack/kube-up.sh: Kubernetes
# cached in /var/cache/cube/kube after a cold build of about 10 minutes):
# helm install, the join issuer's refusals, helm test, a sandbox kept across
# a node pod's replacement and a helm upgrade to new digests, the E2B SDK
# suite through the Services, helm uninstall leaving nothing on the host, a
# second kubelet node in a network namespace. CUBE_TEST_KUBE=0 skips it.
if [ "${CUBE_TEST_KUBE:-1}" != 0 ]; then
  echo "== kubernetes (hack/kube-up.sh)"
  CUBE_KUBE_NODES=2 bash hack/kube-up.sh
fi
