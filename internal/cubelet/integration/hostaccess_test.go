package integration

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/cubesandbox/cube/internal/cubelet"
	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
)

// TestSandboxFilesPrivateToRoot: another host account (nobody) can
// neither reach a running sandbox's root filesystem (where its root may
// plant a setuid binary or a device node), directly or through runc's
// idmapped view of it, nor list the sandboxes (their IDs are their URLs).
// Each row has its control: with the one directory that stops it
// loosened, the same probe succeeds. (The disk images themselves are 0600 besides.)
func TestSandboxFilesPrivateToRoot(t *testing.T) {
	env := cubelettest.New(t, "")
	svc := env.Start(t)
	env.ImportBusybox(t, svc, "busybox")
	ctx := context.Background()
	sb := mustCreate(t, svc, cubelet.CreateRequest{SandboxID: "host-private"})
	t.Cleanup(func() { _, _ = svc.Delete(ctx, sb.ID) })

	sandboxes := filepath.Join(env.Config.Node.RunDir, "sandboxes")
	planted := filepath.Join(env.Config.SandboxRunDir(sb.ID), "rootfs", "tmp", "planted")
	if err := os.WriteFile(planted, []byte("#!/bin/sh\necho escaped\n"), 0o4755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(planted, 0o4755); err != nil { // setuid root, as a sandbox's root could
		t.Fatal(err)
	}
	// runc hands each sandbox an idmapped view of its rootfs under a
	// directory its range's root (an unprivileged host user) can pass:
	// <runc root>-userns is 0711 (no listing), <id> in it 0700 and owned
	// by the range.
	runcViews := env.Config.Runc.Root + "-userns"
	for _, row := range []struct {
		name, path, dir string
		mode, loose     os.FileMode
	}{
		{"planted setuid file in the rootfs", planted, sandboxes, 0o700, 0o711},
		{"sandbox IDs in the pool", filepath.Join(env.Config.PoolDir(), "sandboxes"), env.Config.PoolDir(), 0o700, 0o755},
		{"planted setuid file through runc's idmapped view", filepath.Join(runcViews, sb.ID, "rootfs", "tmp", "planted"), filepath.Join(runcViews, sb.ID), 0o700, 0o711},
		{"sandbox IDs among runc's idmapped views", runcViews, runcViews, 0o711, 0o755},
	} {
		t.Run(row.name, func(t *testing.T) {
			if fi, err := os.Stat(row.dir); err != nil || fi.Mode().Perm() != row.mode {
				t.Fatalf("%s: %v, %v; want %v", row.dir, fi.Mode(), err, row.mode)
			}
			if out, err := readAsNobody(row.path); err == nil {
				t.Fatalf("nobody read %s: %q", row.path, out)
			} else {
				t.Logf("nobody cannot read %s: %v (stopped by %s, mode %v)", row.path, err, row.dir, row.mode)
			}
			// Control: the same probe through a directory as loose as it
			// was succeeds, so the probe can fail for one reason only.
			if err := os.Chmod(row.dir, row.loose); err != nil {
				t.Fatal(err)
			}
			defer func() {
				if err := os.Chmod(row.dir, row.mode); err != nil {
					t.Error(err)
				}
			}()
			if _, err := readAsNobody(row.path); err != nil {
				t.Fatalf("control: with %s at %v nobody still cannot read %s: %v", row.dir, row.loose, row.path, err)
			}
		})
	}
}

// readAsNobody reads the first bytes of a file, or lists a directory, as
// uid/gid 65534.
func readAsNobody(path string) ([]byte, error) {
	cmd := exec.Command("head", "-c", "16", path)
	if fi, err := os.Stat(path); err == nil && fi.IsDir() {
		cmd = exec.Command("ls", path)
	}
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	return cmd.CombinedOutput()
}
