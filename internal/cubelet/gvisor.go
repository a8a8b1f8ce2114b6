package cubelet

import (
	"context"
	"fmt"
	"log/slog"
	"os/exec"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/runtime"
	"github.com/cubesandbox/cube/internal/runtime/gvisor"
)

// gvisor returns the gvisor driver, or nil (with a log line) when this
// node cannot run it: gVisor is optional, runc is not.
func (a *runtimesAction) gvisor(ctx context.Context) runtime.Driver {
	c := a.n.cfg.Gvisor
	if _, err := exec.LookPath(c.Binary); err != nil {
		slog.InfoContext(ctx, "gvisor runtime skipped: runsc not found", "binary", c.Binary)
		return nil
	}
	d, err := gvisor.New(gvisor.Config{Binary: c.Binary, Root: c.Root, Platform: c.Platform, Debug: c.Debug, Checkpoint: c.Checkpoint})
	if err != nil {
		slog.WarnContext(ctx, "gvisor runtime skipped", "error", err)
		return nil
	}
	return d
}

// runtimeUsable refuses, before anything is created, a sandbox its
// runtime could start but cubelet could never reach: a gVisor sandbox runs
// its own network stack, so its agent answers only through a network
// slot's address, never in a bare namespace as a runc sandbox's does.
func (s *Service) runtimeUsable(name string) error {
	if name == "gvisor" && s.cfg.Network.AgentSocket == "" {
		return fmt.Errorf("runtime gvisor needs network slots (network.agent_socket): its agent is reachable only through one: %w",
			errdefs.ErrFailedPrecondition)
	}
	return nil
}
