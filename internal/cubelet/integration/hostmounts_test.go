package integration

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/cubesandbox/cube/api/cubelet/v1"
	"github.com/cubesandbox/cube/internal/cubelet"
	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
	"github.com/cubesandbox/cube/internal/failpoint"
	"github.com/cubesandbox/cube/internal/hostbind"
	"github.com/cubesandbox/cube/internal/network/nettest"
	"github.com/cubesandbox/cube/internal/sandbox"
)

// hostMountWorld is a host directory allowed for host mounts: ro holds a
// marker and a writable tmpfs submounted at ro/sub.
type hostMountWorld struct{ dir, ro, rw string }

func newHostMountWorld(t *testing.T) hostMountWorld {
	t.Helper()
	dir := t.TempDir()
	w := hostMountWorld{dir: dir, ro: filepath.Join(dir, "ro"), rw: filepath.Join(dir, "rw")}
	for _, d := range []string{filepath.Join(w.ro, "sub"), w.rw} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(w.ro, "marker"), []byte("original"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("tmpfs", filepath.Join(w.ro, "sub"), "tmpfs", 0, "size=1m"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Unmount(filepath.Join(w.ro, "sub"), unix.MNT_DETACH) })
	return w
}

func (w hostMountWorld) toml() string {
	return fmt.Sprintf("[[storage.host_mount_allow]]\nprefix = %q\n", w.dir)
}

// mountOptions returns the per-mount options of dst in the mount
// namespace of pid, "" if dst is not a mount point there.
func mountOptions(t *testing.T, pid int, dst string) string {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/mountinfo", pid))
	if err != nil {
		t.Fatal(err)
	}
	opts := ""
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) > 5 && f[4] == dst {
			opts = f[5] // the last one stacked there wins
		}
	}
	return opts
}

// TestHostMountsStaged: runc sandboxes get their host mounts through
// hostbind's staging, and their root filesystem is nosuid,nodev (the disk
// mount's flags). A read-only bind is read-only in its submount too,
// and nosuid,nodev at both levels, inside the sandbox; a source swapped
// for a symlink to /etc after staging still shows the original directory
// inside; the staging is gone once the sandbox runs; a create that fails
// after staging leaves nothing. (The controls of the recursion and of the
// swap are hostbind's TestStageReadOnlyRecursive and cubelet's
// TestHostMountSwapRace: a bind made by name reaches /etc, a
// non-recursive ro bind leaves the submount writable.)
func TestHostMountsStaged(t *testing.T) {
	w := newHostMountWorld(t)
	env := cubelettest.New(t, w.toml())
	svc := env.Start(t)
	env.ImportBusybox(t, svc, "busybox")
	ctx := context.Background()
	t.Cleanup(func() { failpoint.Reset() })

	a := mustCreate(t, svc, cubelet.CreateRequest{SandboxID: "hm-ro", HostMounts: []sandbox.HostMount{
		{Source: w.ro, Destination: "/data", ReadOnly: true},
		{Source: w.rw, Destination: "/out"},
	}})
	pid := a.Container.PID
	in := func(p string) string { return fmt.Sprintf("/proc/%d/root%s", pid, p) }
	if b, err := os.ReadFile(in("/data/marker")); err != nil || string(b) != "original" {
		t.Fatalf("read-only bind: %q %v", b, err)
	}
	for _, p := range []string{"/data/x", "/data/sub/x"} {
		err := os.WriteFile(in(p), nil, 0o644)
		t.Logf("write %s in the sandbox: %v", p, err)
		if !errors.Is(err, unix.EROFS) {
			t.Errorf("write %s in the sandbox: %v; want EROFS (read-only recursively)", p, err)
		}
	}
	if err := os.WriteFile(in("/out/x"), []byte("y"), 0o644); err != nil {
		t.Errorf("write to the read-write bind: %v", err)
	}
	// "/" is the sandbox disk MountDisk mounted nosuid,nodev.
	for _, dst := range []string{"/", "/data", "/data/sub", "/out"} {
		opts := mountOptions(t, pid, dst)
		t.Logf("in the sandbox, %s is mounted %s", dst, opts)
		for _, want := range []string{"nosuid", "nodev"} {
			if !strings.Contains(","+opts+",", ","+want+",") {
				t.Errorf("%s in the sandbox: options %q lack %s", dst, opts, want)
			}
		}
	}
	if _, err := os.Lstat(filepath.Join(env.Config.SandboxRunDir(a.ID), "hostmounts")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("staging left after start: %v", err)
	}

	// The source swapped for a symlink to /etc after staging, right
	// before runc binds: the sandbox still sees the original directory.
	swapped := filepath.Join(w.rw, "swapped")
	if err := os.Mkdir(swapped, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(swapped, "marker"), []byte("original"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := failpoint.EnableFunc(hostbind.FailpointStaged, func(context.Context) error {
		if err := os.Rename(swapped, swapped+".moved"); err != nil {
			return err
		}
		return os.Symlink("/etc", swapped)
	}); err != nil {
		t.Fatal(err)
	}
	b := mustCreate(t, svc, cubelet.CreateRequest{SandboxID: "hm-swap", HostMounts: []sandbox.HostMount{{Source: swapped, Destination: "/data"}}})
	failpoint.Disable(hostbind.FailpointStaged)
	if fi, err := os.Lstat(swapped); err != nil || fi.Mode()&os.ModeSymlink == 0 {
		t.Fatalf("the swap did not happen: %v %v", fi, err)
	}
	marker, err := os.ReadFile(fmt.Sprintf("/proc/%d/root/data/marker", b.Container.PID))
	_, perr := os.Stat(fmt.Sprintf("/proc/%d/root/data/passwd", b.Container.PID))
	t.Logf("source swapped for a symlink to /etc before runc's bind: /data/marker in the sandbox = %q (%v), /data/passwd: %v", marker, err, perr)
	if string(marker) != "original" || perr == nil {
		t.Errorf("the swapped source reached the sandbox")
	}

	// A create that fails after staging leaves no staging behind.
	if err := failpoint.Enable(hostbind.FailpointStaged, "error(injected after staging)"); err != nil {
		t.Fatal(err)
	}
	_, err = svc.Create(ctx, cubelet.CreateRequest{TemplateID: "busybox", SandboxID: "hm-fail", HostMounts: []sandbox.HostMount{{Source: w.ro, Destination: "/data", ReadOnly: true}}})
	failpoint.Disable(hostbind.FailpointStaged)
	if !errors.Is(err, failpoint.ErrInjected) {
		t.Fatalf("create with a failing staging: %v", err)
	}
	for _, id := range []string{a.ID, b.ID} {
		if _, err := svc.Delete(ctx, id); err != nil {
			t.Fatal(err)
		}
	}
	env.AssertNoLeaks(t)
}

// TestHostMountsStagedGvisor: gVisor's gofer serves the staged bind after
// the staging is gone (it keeps its own copy), read-only where asked.
func TestHostMountsStagedGvisor(t *testing.T) {
	cubelettest.RequireRoot(t)
	requireRunsc(t)
	w := newHostMountWorld(t)
	env := cubelettest.New(t, "[gvisor]\ncheckpoint = false\n"+w.toml())
	env.StartNetworkAgent(t, nettest.Options{PoolSize: 1})
	svc := env.Start(t)
	env.ImportBusybox(t, svc, "busybox")
	ctx := context.Background()

	sb := mustCreate(t, svc, cubelet.CreateRequest{SandboxID: "hm-gv", Runtime: "gvisor", HostMounts: []sandbox.HostMount{
		{Source: w.ro, Destination: "/data", ReadOnly: true},
	}})
	if _, err := os.Lstat(filepath.Join(env.Config.SandboxRunDir(sb.ID), "hostmounts")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("staging left after start: %v", err)
	}
	c := agentClient()
	defer c.CloseIdleConnections()
	resp, err := c.Get(agentURL(t, svc, sb.ID, "/files?path=/data/marker"))
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || string(body) != "original" {
		t.Fatalf("GET /data/marker in gVisor: %d %q", resp.StatusCode, body)
	}
	req, _ := http.NewRequest(http.MethodPost, agentURL(t, svc, sb.ID, "/files?path=/data/sub/x"), strings.NewReader("x"))
	req.Header.Set("Content-Type", "application/octet-stream")
	resp, err = c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	t.Logf("upload into the ro bind's submount in gVisor: %d %s", resp.StatusCode, body)
	if resp.StatusCode/100 == 2 {
		t.Errorf("upload into a read-only bind's submount succeeded")
	}
	if _, err := svc.Delete(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}
	env.AssertNoLeaks(t)
}

// TestHostMountStagingCrash: cubelet dies with a host mount staged (the
// staging bind of the host directory is in the sandbox's run directory);
// the restart's reconcile undoes the create and unmounts the staging
// before it removes the run directory, so the host directory's files
// survive and nothing is left.
func TestHostMountStagingCrash(t *testing.T) {
	w := newHostMountWorld(t)
	if err := os.WriteFile(filepath.Join(w.rw, "precious"), []byte("keep"), 0o644); err != nil {
		t.Fatal(err)
	}
	env := cubelettest.New(t, w.toml())
	cfgPath := env.WriteConfig(t, w.toml())
	ctx := context.Background()
	d := startDaemon(t, env, cfgPath, "")
	stream, err := d.client.ImportTemplate(ctx, &pb.ImportTemplateRequest{TemplateId: "busybox", Source: env.Image})
	if err != nil {
		t.Fatal(err)
	}
	for {
		if _, err := stream.Recv(); err != nil {
			if !strings.Contains(err.Error(), "EOF") {
				t.Fatalf("import: %v", err)
			}
			break
		}
	}
	d.kill()

	d = startDaemon(t, env, cfgPath, hostbind.FailpointStaged+"=kill")
	_, err = d.client.CreateSandbox(ctx, &pb.CreateSandboxRequest{SandboxId: "victim", TemplateId: "busybox",
		HostMounts: []*pb.HostMount{{Source: w.rw, Destination: "/out"}}})
	if err == nil {
		t.Fatal("create succeeded; the failpoint never fired")
	}
	d.waitDead(t)
	staged := filepath.Join(env.Config.SandboxRunDir("victim"), "hostmounts", "0")
	if b, err := os.ReadFile(filepath.Join(staged, "precious")); err != nil || string(b) != "keep" {
		t.Fatalf("no staging bind left by the crash (%q %v): the test proves nothing", b, err)
	}
	t.Logf("crash left the staging bind %s of %s", staged, w.rw)

	d = startDaemon(t, env, cfgPath, "")
	if _, err := d.client.GetSandbox(ctx, &pb.GetSandboxRequest{SandboxId: "victim"}); status.Code(err) != codes.NotFound {
		t.Errorf("victim after restart: %v; want NotFound (create undone)", err)
	}
	d.kill()
	if b, err := os.ReadFile(filepath.Join(w.rw, "precious")); err != nil || string(b) != "keep" {
		t.Fatalf("the host directory lost its files in the cleanup: %q %v", b, err)
	}
	env.AssertNoLeaks(t)
}
