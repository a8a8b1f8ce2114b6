package main

import (
	"context"
	"log/slog"
	"net/http"

	"github.com/cubesandbox/cube/internal/agent/vminit"
	"github.com/cubesandbox/cube/internal/agentchan"
)

// vmSetup is --vm's first step: as PID 1 of a VM the agent mounts, names
// and networks the guest itself (docs/vm-guest.md).
// It returns the access token's verifier the host put on the kernel
// command line ("" for none).
func vmSetup(log *slog.Logger) (tokenHash, resolver string, egressCA []byte, err error) {
	cfg, err := vminit.Setup(log)
	if cfg.Resolver.IsValid() {
		resolver = cfg.Resolver.String()
	}
	return cfg.TokenHash, resolver, cfg.EgressCA, err
}

// serveChannel serves the agent's API to the host over the agent channel
// (virtio-serial, and vsock where the guest has it) next to TCP. Unlike
// TCP, losing it is not fatal: the E2B path through the TAP still works.
func serveChannel(ctx context.Context, h http.Handler, log *slog.Logger) {
	if err := agentchan.Serve(ctx, h, log); err != nil {
		log.Error("agent channel stopped", "error", err)
	}
}
