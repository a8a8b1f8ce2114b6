package cubelet

import (
	"context"
	"log/slog"
	"os/exec"

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
	d, err := gvisor.New(gvisor.Config{Binary: c.Binary, Root: c.Root, Platform: c.Platform, Debug: c.Debug})
	if err != nil {
		slog.WarnContext(ctx, "gvisor runtime skipped", "error", err)
		return nil
	}
	return d
}
