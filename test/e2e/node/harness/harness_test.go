package main

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/network"
	"github.com/cubesandbox/cube/internal/network/agent"
	"github.com/cubesandbox/cube/internal/testenv"
)

func requireRoot(t *testing.T) {
	t.Helper()
	testenv.RequireRoot(t, "namespaces, links, nftables, loop devices")
}

// privateTemp points os.TempDir, where the harness keeps every directory
// it makes, at a directory of this test's, and fails the test if anything
// is left in it at the end.
func privateTemp(t *testing.T) {
	t.Helper()
	dir := t.TempDir()
	t.Setenv("TMPDIR", dir)
	t.Cleanup(func() {
		if ents, _ := os.ReadDir(dir); len(ents) > 0 {
			t.Errorf("left in %s: %v", dir, ents)
		}
	})
}

// TestNetAgent starts the harness's network-agent, takes a VM slot the way
// cubelet would not (directly), and checks that close reports the slot as
// unreleased, yet still purges it and leaves nothing behind.
func TestNetAgent(t *testing.T) {
	requireRoot(t)
	privateTemp(t)
	ctx := context.Background()
	n, err := startNetAgent(ctx, "vm", slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(n.cfg.API.Socket); err != nil {
		n.close(ctx)
		t.Fatalf("agent socket: %v", err)
	}
	if _, _, err := n.agent.Ensure(ctx, agent.EnsureRequest{SandboxID: "held", Kind: network.VM}); err != nil {
		n.close(ctx)
		t.Fatalf("ensure a vm slot: %v", err)
	}
	err = n.close(ctx)
	if err == nil || !strings.Contains(err.Error(), "still assigned") || !strings.Contains(err.Error(), "held") {
		t.Fatalf("close with a slot still held: %v, want it reported", err)
	}
	if strings.Contains(err.Error(), "leaked") {
		t.Fatalf("close left the slot's kernel objects: %v", err)
	}
}

// TestStartNodeFailureLeavesNothing fails startNode after the
// network-agent is up (a bad CUBE_VM_ACCEL): the error names the variable
// and kind, and the agent's slots, namespaces, links and directories are
// gone (close runs the leak checker; privateTemp checks the dirs).
func TestStartNodeFailureLeavesNothing(t *testing.T) {
	requireRoot(t)
	if _, err := exec.LookPath("qemu-system-x86_64"); err != nil {
		testenv.Missing(t, "needs qemu-system-x86_64")
	}
	privateTemp(t)
	t.Setenv("CUBE_VM_ACCEL", "bogus")
	n, err := startNode(context.Background(), "/bin/true", "vm", slog.Default())
	if err == nil {
		_ = n.teardown(context.Background()) // the test fails either way
		t.Fatal("startNode with CUBE_VM_ACCEL=bogus succeeded")
	}
	if !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("want InvalidArgument, got %v", err)
	}
}
