GO ?= go
BIN ?= bin
BINARIES = cubelet cubecli cube-agent cube-bench network-agent cubemaster cube cubeproxy

.PHONY: all build generate lint test up clean bench bench-gvisor bench-vm bench-cluster

all: build

# Static binaries: cube-agent runs inside sandboxes whose rootfs has no libc.
build:
	@mkdir -p $(BIN)
	@for b in $(BINARIES); do CGO_ENABLED=0 $(GO) build -trimpath -o $(BIN)/$$b ./cmd/$$b || exit 1; done

# Regenerate protobuf code with the buf and plugin versions pinned in go.mod.
generate:
	$(GO) run github.com/bufbuild/buf/cmd/buf generate

# golangci-lint with .golangci.yml; the version is pinned in hack/tools/go.mod,
# a module of its own so the linter's dependencies stay out of go.mod
# (docs/contributing.md). Without package arguments it lints ./...; e.g.
# make lint LINT_FLAGS="./internal/master/..." or LINT_FLAGS="--fix".
LINT_FLAGS ?=
lint:
	$(GO) tool -modfile=hack/tools/go.mod golangci-lint run $(LINT_FLAGS)

test:
	bash hack/test.sh

up:
	bash hack/up.sh

clean:
	rm -rf $(BIN)

# Measure cubelet against the raw baselines and rewrite bench/RESULTS.md
# (needs root; see docs/bench.md). E.g. make bench BENCH_FLAGS="--density-n 200".
BENCH_FLAGS ?=
bench: build
	$(BIN)/cube-bench --markdown bench/RESULTS.md --json-out bench/results.json $(BENCH_FLAGS)

# The same scenarios on the gVisor and VM runtimes (smaller default N; a
# TCG boot takes seconds), each with its own report next to RESULTS.md.
bench-gvisor: build
	$(BIN)/cube-bench --runtime gvisor --markdown bench/RESULTS-gvisor.md --json-out bench/results-gvisor.json $(BENCH_FLAGS)

bench-vm: build
	$(BIN)/cube-bench --runtime vm --markdown bench/RESULTS-vm.md --json-out bench/results-vm.json $(BENCH_FLAGS)

# The cluster scenarios (they build a three-node cluster of network
# namespaces from source, so run from the repository as root), written to
# bench/RESULTS-cluster.md; see docs/bench.md, "Cluster".
BENCH_CLUSTER_FLAGS ?= --n 50 --n-c50 250 --quiet
bench-cluster: build
	$(BIN)/cube-bench --scenarios cluster-create-c1,cluster-create-c50,cluster-template,cluster-template-32m,cluster-resume-move,cluster-resume-move-exported --markdown bench/RESULTS-cluster.md --json-out bench/results-cluster.json $(BENCH_CLUSTER_FLAGS)
