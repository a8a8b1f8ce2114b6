package bench

import (
	"context"
	"fmt"
	"os/exec"
	"slices"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Hooks for what lands later: the gVisor and VM runtimes' raw restore
// baselines and the E2B round trip (cubemaster + cubeproxy). Each probes
// the node and skips with the reason until the thing it measures exists;
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
	for _, h := range []struct{ name, rt, bin, help string }{
		{"runsc-restore", "gvisor", "runsc", "bare `runsc restore` of the template's warm checkpoint + first /health"},
		{"qemu-incoming", "vm", "qemu-system-x86_64", "bare `qemu -incoming` of the template's warm snapshot + first /health"},
	} {
		Register(Scenario{
			Name: h.name, Kind: KindBaseline, Runtime: h.rt, Help: h.help,
			Params: func(o Options) Params { return Params{N: o.N1, Concurrency: 1} },
			Probe: func(ctx context.Context, e *Env) error {
				if err := hasRuntime(ctx, e, h.rt); err != nil {
					return err
				}
				if _, err := exec.LookPath(h.bin); err != nil {
					return skipf("%s is not installed", h.bin)
				}
				return nil
			},
			Run: func(context.Context, *Env, Params) (*Result, error) {
				return nil, skipf("the %s baseline comes with the %s runtime driver", h.name, h.rt)
			},
		})
	}

	Register(Scenario{
		Name: "e2b", Kind: KindCube,
		Help:      "E2B round trip: POST /sandboxes on the E2B API, first envd /health through cubeproxy, DELETE",
		Baselines: []string{"runc-run", "podman-run"},
		Params:    func(o Options) Params { return Params{N: o.N1, Concurrency: 1} },
		Probe: func(context.Context, *Env) error {
			return skipf("needs cubemaster's E2B API and cubeproxy, which are not in this tree yet")
		},
		Run: func(context.Context, *Env, Params) (*Result, error) {
			return nil, skipf("E2B round trip not available")
		},
	})
}
