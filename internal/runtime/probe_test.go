package runtime_test

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/runtime"
	"github.com/cubesandbox/cube/internal/testenv"
)

func TestProbeFiles(t *testing.T) {
	dir := t.TempDir()
	exe := filepath.Join(dir, "runc")
	plain := filepath.Join(dir, "plain")
	if err := os.WriteFile(exe, []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(plain, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := runtime.ProbeFiles(dir, exe); err != nil {
		t.Fatalf("control: an executable and a writable root: %v", err)
	}
	for name, c := range map[string]struct{ root, bin string }{
		"binary missing":  {dir, filepath.Join(dir, "gone")},
		"binary not exec": {dir, plain},
		"binary is a dir": {dir, dir},
		"root missing":    {filepath.Join(dir, "nope"), exe},
		"root is a file":  {plain, exe},
	} {
		err := runtime.ProbeFiles(c.root, c.bin)
		if err == nil {
			t.Errorf("%s: probe passed", name)
			continue
		}
		t.Logf("%s: %v", name, err)
	}
}

// TestProbeFilesReadOnly: a root on a read-only filesystem fails the
// probe even for root (access(2) says EROFS); the same directory
// writable passes (the control).
func TestProbeFilesReadOnly(t *testing.T) {
	testenv.RequireRoot(t, "bind mounts")
	dir := t.TempDir()
	exe := filepath.Join(dir, "runc")
	if err := os.WriteFile(exe, []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	root := filepath.Join(dir, "root")
	if err := os.Mkdir(root, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount(root, root, "", unix.MS_BIND, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Unmount(root, unix.MNT_DETACH) })
	if err := runtime.ProbeFiles(root, exe); err != nil {
		t.Fatalf("control: writable bind mount: %v", err)
	}
	if err := unix.Mount("", root, "", unix.MS_REMOUNT|unix.MS_BIND|unix.MS_RDONLY, ""); err != nil {
		t.Fatal(err)
	}
	err := runtime.ProbeFiles(root, exe)
	if !errors.Is(err, unix.EROFS) {
		t.Fatalf("read-only root: %v, want EROFS", err)
	}
	t.Logf("read-only root: %v", err)
}
