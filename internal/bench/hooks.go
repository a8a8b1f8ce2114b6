package bench

import (
	"context"
	"fmt"
	"os/exec"
	"slices"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/cubesandbox/cube/internal/bench/raw"
	"github.com/cubesandbox/cube/internal/bench/report"
)

// The gVisor and VM runtimes' raw restore baselines (raw/runsc.go,
// raw/qemu.go, timed in baselines.go) and the E2B round trip (cubemaster + cubeproxy). Each probes
// the node and skips with the reason when what it measures is missing;
// none of them fakes a number.

// hasRuntime reports whether the cubelet offers runtime rt.
func hasRuntime(ctx context.Context, e *Env, rt string) error {
	info, err := e.Info(ctx)
	if err != nil {
		return err
	}
	var names []string
	for _, r := range info.Runtimes {
		names = append(names, r.Name)
	}
	if !slices.Contains(names, rt) {
		return skipf("cubelet offers runtimes %v, not %s", names, rt)
	}
	return nil
}

// implemented probes an RPC with an empty request: a cubelet that has it
// answers InvalidArgument (or NotFound), one that does not answers
// Unimplemented.
func implemented(ctx context.Context, rpc string, call func(context.Context) error) error {
	err := call(ctx)
	if status.Code(err) == codes.Unimplemented {
		return skipf("cubelet does not implement %s yet", rpc)
	}
	if err != nil && status.Code(err) == codes.Unavailable {
		return fmt.Errorf("probe %s: %w", rpc, err)
	}
	return nil
}

func init() {
	for _, h := range []struct {
		name, rt, bin, help string
		run                 func(context.Context, *Env, report.Params) (*report.Result, error)
	}{
		{"runsc-restore", "gvisor", raw.RunscBinary, "bare `runsc restore --detach` of the warm template's checkpoint + agent wake + first /health", runRunscRestore},
		{"runsc-checkpoint-restore", "gvisor", raw.RunscBinary, "bare `runsc checkpoint` of a sandbox restored from the warm template (agent quiesced) + bare `runsc restore --detach` of that image under a fresh runsc ID + agent wake + first /health", runRunscCheckpointRestore},
		{"qemu-incoming", "vm", raw.QemuBinary, "bare QEMU `-incoming exec:zstd -dc` of the warm template's snapshot (a shared-memory template: its RAM file mapped privately, the device state loaded) + cont + first /health", runQemuIncoming},
		{"qemu-incoming-full", "vm", raw.QemuBinary, "bare QEMU `-incoming exec:zstd -dc` of a full memory image of the same warm template snapshot (every page copied in, as before templates shared memory) + cont + first /health", runQemuIncomingFull},
	} {
		Register(Scenario{
			Name: h.name, Kind: report.KindBaseline, Runtime: h.rt, Help: h.help,
			Params: func(o report.Options) report.Params { return report.Params{N: o.N1, Concurrency: 1} },
			Probe: func(ctx context.Context, e *Env) error {
				if err := hasRuntime(ctx, e, h.rt); err != nil {
					return err
				}
				if _, err := exec.LookPath(h.bin); err != nil {
					return skipf("%s is not installed", h.bin)
				}
				if e.node == nil {
					return skipf("raw restores need the snapshot files of a private node (no --addr)")
				}
				return memoryRuntime(ctx, e)
			},
			Run: h.run,
		})
	}

}
