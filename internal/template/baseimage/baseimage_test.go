package baseimage

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/loopdev"
	"github.com/cubesandbox/cube/internal/storage"
	"github.com/cubesandbox/cube/internal/template"
	"github.com/cubesandbox/cube/internal/testenv"
)

// TestBuildBase runs the real debootstrap build (about a minute on a small
// machine, then cached) and imports the result as a template. It runs only
// with CUBE_TEST_BASE=1 (hack/test.sh sets it); the cache is
// CUBE_BASE_CACHE, default /var/cache/cube/base, shared with hack/up.sh.
func TestBuildBase(t *testing.T) {
	if os.Getenv("CUBE_TEST_BASE") != "1" {
		t.Skip("set CUBE_TEST_BASE=1 to build the base image with debootstrap")
	}
	testenv.RequireRoot(t, "debootstrap, chroot, loop mounts")
	cache := os.Getenv("CUBE_BASE_CACHE")
	if cache == "" {
		cache = "/var/cache/cube/base"
	}
	ctx := context.Background()
	start := time.Now()
	res, err := Build(ctx, Options{Dir: cache})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("build (built=%v) took %s", res.Built, time.Since(start).Round(time.Millisecond))
	if ents, _ := filepath.Glob(filepath.Join(cache, ".base-build-*")); len(ents) != 0 {
		t.Errorf("build left work directories: %v", ents)
	}
	again, err := Build(ctx, Options{Dir: cache})
	if err != nil || again.Built || again.Layout != res.Layout {
		t.Fatalf("second build: %+v %v, want the cached layout", again, err)
	}

	dir := t.TempDir()
	agent := filepath.Join(dir, "agent")
	if err := os.WriteFile(agent, []byte("#!/bin/sh\necho cube-agent\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(dir, "out", "rootfs.img")
	meta, err := template.Import(ctx, template.ImportRequest{Source: res.Layout, AgentBinary: agent, Output: out, WorkDir: filepath.Join(dir, "work")}, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("base template: %d MiB image, digest %s", meta.SizeBytes>>20, meta.Digest)
	if meta.WorkingDir != "/home/user" || len(meta.Cmd) != 1 || meta.Cmd[0] != "/bin/bash" {
		t.Errorf("meta = %+v", meta)
	}

	mnt := filepath.Join(dir, "mnt")
	if _, err := storage.MountDisk(ctx, out, mnt, true); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := storage.UnmountDisk(context.Background(), mnt, out); err != nil {
			t.Errorf("unmount: %v", err)
		}
		if devs, _ := loopdev.FindByBacking(out); len(devs) != 0 {
			t.Errorf("loop devices left: %v", devs)
		}
	})
	for _, p := range []string{"usr/bin/python3", "bin/bash", "usr/bin/curl", "bin/ls", "bin/ps", "etc/ssl/certs/ca-certificates.crt", "usr/local/bin/cube-agent"} {
		if _, err := os.Stat(filepath.Join(mnt, p)); err != nil {
			t.Errorf("/%s: %v", p, err)
		}
	}
	passwd, _ := os.ReadFile(filepath.Join(mnt, "etc/passwd"))
	if !bytes.Contains(passwd, []byte("\nuser:x:1000:1000:")) || !bytes.HasPrefix(passwd, []byte("root:x:0:0:")) {
		t.Errorf("/etc/passwd:\n%s", passwd)
	}
	if st, err := os.Stat(filepath.Join(mnt, "home/user")); err != nil || st.Sys().(*syscall.Stat_t).Uid != 1000 {
		t.Errorf("/home/user: %v %v", st, err)
	}
	if b, _ := os.ReadFile(filepath.Join(mnt, "etc/resolv.conf")); len(b) != 0 {
		t.Errorf("build host's resolv.conf leaked into the image: %q", b)
	}
	// The interpreters really run from the imported image.
	cmd := exec.CommandContext(ctx, "chroot", mnt, "/usr/bin/python3", "-c", "import ssl, json; print(json.dumps({'ok': 1}))")
	if b, err := cmd.CombinedOutput(); err != nil || strings.TrimSpace(string(b)) != `{"ok": 1}` {
		t.Errorf("python3 in the image: %v: %s", err, b)
	}
	cmd = exec.CommandContext(ctx, "chroot", mnt, "/bin/bash", "-c", "su user -c 'id -u; echo $HOME'")
	if b, err := cmd.CombinedOutput(); err != nil || strings.Fields(string(b))[0] != "1000" {
		t.Errorf("user in the image: %v: %s", err, b)
	}
}
