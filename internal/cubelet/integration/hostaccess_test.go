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
// plant a setuid binary or a device node) nor list the pool's sandboxes
// (their IDs are their URLs). Each row has its control: with the one
// directory that stops it loosened to what it used to be, the same probe
// succeeds. (The disk images themselves are 0600 besides.)
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
	for _, row := range []struct {
		name, path, dir string
		loose           os.FileMode
	}{
		{"planted setuid file in the rootfs", planted, sandboxes, 0o711},
		{"sandbox IDs in the pool", filepath.Join(env.Config.PoolDir(), "sandboxes"), env.Config.PoolDir(), 0o755},
	} {
		t.Run(row.name, func(t *testing.T) {
			if fi, err := os.Stat(row.dir); err != nil || fi.Mode().Perm() != 0o700 {
				t.Fatalf("%s: %v, %v; want 0700", row.dir, fi.Mode(), err)
			}
			if out, err := readAsNobody(row.path); err == nil {
				t.Fatalf("nobody read %s: %q", row.path, out)
			} else {
				t.Logf("nobody cannot read %s: %v (stopped by %s, mode 0700)", row.path, err, row.dir)
			}
			// Control: the same probe through a directory as loose as it
			// was succeeds, so the probe can fail for one reason only.
			if err := os.Chmod(row.dir, row.loose); err != nil {
				t.Fatal(err)
			}
			defer func() {
				if err := os.Chmod(row.dir, 0o700); err != nil {
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
