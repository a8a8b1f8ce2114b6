// Package integration holds the tests that drive a whole cubelet.Service
// through its exported API on this host: real runc, runsc, QEMU, loop
// devices and XFS pools (privileged; see cubelettest).
package integration

import (
	"context"
	"errors"
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/cubesandbox/cube/internal/cubelet"
	"github.com/cubesandbox/cube/internal/cubelet/agentclient"
	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/lifecycle"
	"github.com/cubesandbox/cube/internal/sandbox"
)

func TestLifecycle(t *testing.T) {
	env := cubelettest.New(t, "")
	svc := env.Start(t)
	env.ImportBusybox(t, svc, "busybox")
	ctx := context.Background()

	res, err := svc.Create(ctx, cubelet.CreateRequest{
		TemplateID: "busybox", Labels: map[string]string{"team": "a"},
		Env:       map[string]string{"FOO": "bar"},
		Resources: sandbox.Resources{MilliCPU: 500, MemoryMiB: 128, Pids: 100},
	})
	if err != nil {
		t.Fatalf("create: %v", err)
	}
	sb := res.Sandbox
	if sb.State != lifecycle.Running || sb.Container == nil || sb.Container.PID == 0 {
		t.Fatalf("after create: %+v", sb)
	}
	if len(res.Timings) != 5 { // disk, net (a no-op without network-agent), rootfs, container, agent
		t.Errorf("want a timing per create action, got %+v", res.Timings)
	}
	t.Logf("create timings: %+v", res.Timings)

	// The agent really is the sandbox's PID 1 and sees the env.
	environ, err := os.ReadFile("/proc/" + itoa(sb.Container.PID) + "/environ")
	if err != nil || !strings.Contains(string(environ), "FOO=bar") {
		t.Errorf("agent environment lacks FOO=bar: %q %v", environ, err)
	}

	list, _ := svc.List(ctx, cubelet.ListFilter{Labels: map[string]string{"team": "a"}})
	if len(list) != 1 || list[0].ID != sb.ID {
		t.Fatalf("list by label: %+v", list)
	}
	list, _ = svc.List(ctx, cubelet.ListFilter{States: []lifecycle.State{lifecycle.Paused}})
	if len(list) != 0 {
		t.Fatalf("list paused: %+v", list)
	}

	if _, err := svc.Pause(ctx, sb.ID); err != nil {
		t.Fatalf("pause: %v", err)
	}
	if got, _ := svc.Get(ctx, sb.ID); got.State != lifecycle.Paused {
		t.Fatalf("state after pause: %s", got.State)
	}
	if freezerState(t, env, sb.ID) != "FROZEN" {
		t.Errorf("cgroup is not frozen after pause")
	}
	_, err = svc.Pause(ctx, sb.ID)
	var te *lifecycle.TransitionError
	if !errors.As(err, &te) || te.From != lifecycle.Paused || !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("second pause: want FailedPrecondition naming paused, got %v", err)
	}
	if _, err := svc.Resume(ctx, sb.ID); err != nil {
		t.Fatalf("resume: %v", err)
	}
	if err := agentclient.WaitAgent(ctx, sb.Container.PID); err != nil {
		t.Fatalf("agent after resume: %v", err)
	}
	if _, err := svc.Resume(ctx, sb.ID); !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("resume of running: %v", err)
	}

	// A template in use cannot be removed.
	if err := svc.DeleteTemplate(ctx, "busybox"); !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("delete template in use: %v", err)
	}
	if _, err := svc.Delete(ctx, sb.ID); err != nil {
		t.Fatalf("delete: %v", err)
	}
	if _, err := svc.Get(ctx, sb.ID); !errdefs.IsNotFound(err) {
		t.Fatalf("get after delete: %v", err)
	}
	if _, err := svc.Delete(ctx, sb.ID); !errdefs.IsNotFound(err) {
		t.Fatalf("second delete: %v", err)
	}
	env.AssertNoLeaks(t)

	// A paused sandbox can be deleted too.
	res, err = svc.Create(ctx, cubelet.CreateRequest{TemplateID: "busybox", SandboxID: "paused-one"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := svc.Pause(ctx, res.Sandbox.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := svc.Delete(ctx, res.Sandbox.ID); err != nil {
		t.Fatalf("delete paused: %v", err)
	}
	env.AssertNoLeaks(t)
	if err := svc.DeleteTemplate(ctx, "busybox"); err != nil {
		t.Fatalf("delete template: %v", err)
	}
}

func TestValidation(t *testing.T) {
	env := cubelettest.New(t, "")
	svc := env.Start(t)
	env.ImportBusybox(t, svc, "busybox")
	ctx := context.Background()
	if _, err := svc.Create(ctx, cubelet.CreateRequest{TemplateID: "busybox", SandboxID: "dup"}); err != nil {
		t.Fatal(err)
	}
	cleanupDelete(t, svc, "dup")
	cases := []struct {
		name  string
		req   cubelet.CreateRequest
		is    error
		field string
	}{
		{"bad id", cubelet.CreateRequest{TemplateID: "busybox", SandboxID: "Bad_ID"}, errdefs.ErrInvalidArgument, "sandbox_id"},
		{"path id", cubelet.CreateRequest{TemplateID: "busybox", SandboxID: "../etc"}, errdefs.ErrInvalidArgument, "sandbox_id"},
		{"no template", cubelet.CreateRequest{}, errdefs.ErrInvalidArgument, "template_id"},
		{"unknown template", cubelet.CreateRequest{TemplateID: "nope"}, errdefs.ErrNotFound, ""},
		{"negative cpu", cubelet.CreateRequest{TemplateID: "busybox", Resources: sandbox.Resources{MilliCPU: -1}}, errdefs.ErrInvalidArgument, "resources.milli_cpu"},
		{"huge memory", cubelet.CreateRequest{TemplateID: "busybox", Resources: sandbox.Resources{MemoryMiB: 1 << 40}}, errdefs.ErrInvalidArgument, "resources.memory_mib"},
		{"tiny memory", cubelet.CreateRequest{TemplateID: "busybox", Resources: sandbox.Resources{MemoryMiB: 1}}, errdefs.ErrInvalidArgument, "resources.memory_mib"},
		{"negative pids", cubelet.CreateRequest{TemplateID: "busybox", Resources: sandbox.Resources{Pids: -5}}, errdefs.ErrInvalidArgument, "resources.pids"},
		{"huge disk", cubelet.CreateRequest{TemplateID: "busybox", Resources: sandbox.Resources{DiskMiB: 1 << 40}}, errdefs.ErrInvalidArgument, "resources.disk_mib"},
		{"bad env", cubelet.CreateRequest{TemplateID: "busybox", Env: map[string]string{"A=B": "x"}}, errdefs.ErrInvalidArgument, "env"},
		{"bad label", cubelet.CreateRequest{TemplateID: "busybox", Labels: map[string]string{"": "x"}}, errdefs.ErrInvalidArgument, "labels"},
		{"unknown runtime", cubelet.CreateRequest{TemplateID: "busybox", Runtime: "firecracker"}, errdefs.ErrInvalidArgument, "runtime"},
		{"duplicate", cubelet.CreateRequest{TemplateID: "busybox", SandboxID: "dup"}, errdefs.ErrAlreadyExists, ""},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := svc.Create(ctx, c.req)
			if !errors.Is(err, c.is) {
				t.Fatalf("want %v, got %v", c.is, err)
			}
			var fe *errdefs.FieldError
			if c.field != "" && (!errors.As(err, &fe) || fe.Field != c.field) {
				t.Fatalf("want field %q, got %v", c.field, err)
			}
		})
	}
	for _, id := range []string{"", "UPPER", "nope"} {
		_, err := svc.Pause(ctx, id)
		if id == "nope" && !errdefs.IsNotFound(err) || id != "nope" && !errdefs.IsInvalidArgument(err) {
			t.Errorf("pause %q: %v", id, err)
		}
	}
	// Re-importing the same image under the same ID is a no-op (see
	// templates_test.go for dedupe and the other-digest conflict).
	if _, err := svc.ImportTemplate(ctx, "busybox", env.Image, nil); err != nil {
		t.Errorf("re-import: %v", err)
	}
	if _, err := svc.ImportTemplate(ctx, "x", "/does/not/exist", nil); !errdefs.IsInvalidArgument(err) {
		t.Errorf("import missing source: %v", err)
	}
	if _, err := svc.ImportTemplate(ctx, "garbage", "/etc/hostname", nil); !errdefs.IsInvalidArgument(err) {
		t.Errorf("import garbage source: %v", err)
	}
	if l, _ := svc.List(ctx, cubelet.ListFilter{}); len(l) != 1 {
		t.Errorf("invalid requests left records: %+v", l)
	}
}

func TestDiskGrow(t *testing.T) {
	env := cubelettest.New(t, "")
	svc := env.Start(t)
	env.ImportBusybox(t, svc, "busybox")
	ctx := context.Background()
	res, err := svc.Create(ctx, cubelet.CreateRequest{TemplateID: "busybox", Resources: sandbox.Resources{DiskMiB: 300}})
	if err != nil {
		t.Fatal(err)
	}
	st, err := os.Stat(res.Sandbox.Disk.Path)
	if err != nil || st.Size() != 300<<20 {
		t.Errorf("disk size %v, %v", st.Size(), err)
	}
	if _, err := svc.Delete(ctx, res.Sandbox.ID); err != nil {
		t.Fatal(err)
	}
	env.AssertNoLeaks(t)
}

func itoa(n int) string { return strconv.Itoa(n) }

// cleanupDelete deletes sandbox id when the test ends, unless the test
// already did.
func cleanupDelete(t *testing.T, svc *cubelet.Service, id string) {
	t.Helper()
	t.Cleanup(func() {
		if _, err := svc.Delete(context.Background(), id); err != nil && !errdefs.IsNotFound(err) {
			t.Errorf("delete %s: %v", id, err)
		}
	})
}

func freezerState(t *testing.T, env *cubelettest.Env, id string) string {
	for _, p := range []string{
		"/sys/fs/cgroup/freezer/" + env.Config.Node.CgroupParent + "/" + id + "/freezer.state",
	} {
		if b, err := os.ReadFile(p); err == nil {
			return strings.TrimSpace(string(b))
		}
	}
	b, err := os.ReadFile("/sys/fs/cgroup/" + env.Config.Node.CgroupParent + "/" + id + "/cgroup.freeze")
	if err == nil && strings.TrimSpace(string(b)) == "1" {
		return "FROZEN"
	}
	return "THAWED"
}
