package integration

import (
	"context"
	"testing"

	"github.com/cubesandbox/cube/internal/cubelet"
	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/lifecycle"
	"github.com/cubesandbox/cube/internal/network/nettest"
	"github.com/cubesandbox/cube/internal/sandbox"
)

// TestWarmTemplateRefusedWithoutMemorySnapshots: runc cannot checkpoint,
// so warming on it is FailedPrecondition and leaves nothing behind.
func TestWarmTemplateRefusedWithoutMemorySnapshots(t *testing.T) {
	cubelettest.RequireRoot(t)
	ctx := context.Background()
	env := cubelettest.New(t, "")
	svc := env.Start(t)
	env.ImportBusybox(t, svc, "busybox")
	if _, err := svc.WarmTemplate(ctx, "busybox", "runc"); !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("warm on runc = %v, want FailedPrecondition", err)
	}
	if _, err := svc.WarmTemplate(ctx, "nope", ""); !errdefs.IsNotFound(err) {
		t.Fatalf("warm of a missing template = %v, want NotFound", err)
	}
	if _, err := svc.WarmTemplate(ctx, "busybox", "no-such-runtime"); !errdefs.IsInvalidArgument(err) {
		t.Fatalf("warm on a missing runtime = %v, want InvalidArgument", err)
	}
	if n := len(mustList(t, svc)); n != 0 {
		t.Fatalf("%d sandboxes left", n)
	}
	if ids := listSnaps(t, svc, ""); len(ids) != 0 {
		t.Fatalf("snapshots left: %v", ids)
	}
	tmpl, err := svc.GetTemplate(ctx, "busybox")
	if err != nil || tmpl.WarmSnapshotID != "" {
		t.Fatalf("template after refused warm: %+v %v", tmpl, err)
	}
	env.AssertNoLeaks(t)
}

// TestWarmTemplateGvisor warms a template on gVisor and creates from it:
// the create restores the warm snapshot (a clone with the create's own
// identity), the snapshot is protected from retention and deletes, and
// goes with the template.
func TestWarmTemplateGvisor(t *testing.T) {
	cubelettest.RequireRoot(t)
	requireRunsc(t)
	ctx := context.Background()
	env := cubelettest.New(t, "[gvisor]\ncheckpoint = true\n")
	env.StartNetworkAgent(t, nettest.Options{PoolSize: 2})
	svc := env.Start(t)
	env.ImportBusybox(t, svc, "busybox")
	defer func() {
		for _, sb := range mustList(t, svc) {
			if _, err := svc.Delete(ctx, sb.ID); err != nil {
				t.Error(err)
			}
		}
		_ = svc.DeleteTemplate(ctx, "busybox")
		assertSnapshotFiles(t, env, svc)
		env.AssertNoLeaks(t)
	}()

	res, err := svc.WarmTemplate(ctx, "busybox", "gvisor")
	if err != nil {
		t.Fatalf("warm: %v", err)
	}
	tmpl := res.Template
	if tmpl.WarmSnapshotID == "" || tmpl.Runtime != "gvisor" {
		t.Fatalf("warmed template %+v", tmpl)
	}
	if n := len(mustList(t, svc)); n != 0 {
		t.Fatalf("the warm-up sandbox is still there (%d sandboxes)", n)
	}
	sn, err := svc.GetSnapshot(ctx, tmpl.WarmSnapshotID)
	if err != nil || !sn.HasMemory || sn.WarmFor != "busybox" {
		t.Fatalf("warm snapshot %+v, %v", sn, err)
	}
	if err := svc.DeleteSnapshot(ctx, sn.ID); !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("delete of a warm snapshot = %v, want FailedPrecondition", err)
	}

	// No runtime named: the template's (gvisor), restored warm.
	r, err := svc.Create(ctx, cubelet.CreateRequest{SandboxID: "warm-a", TemplateID: "busybox", Env: map[string]string{"WHO": "a"}})
	if err != nil {
		t.Fatalf("create from warm template: %v", err)
	}
	if !r.Warm || r.Sandbox.Runtime != "gvisor" || r.Sandbox.SourceSnapshotID != sn.ID || len(r.Warnings) != 0 {
		t.Fatalf("create result warm=%v runtime=%s source=%s warnings=%v", r.Warm, r.Sandbox.Runtime, r.Sandbox.SourceSnapshotID, r.Warnings)
	}
	mustState(t, svc, "warm-a", lifecycle.Running)
	wantMemory(t, svc, "warm-a", map[string]string{"WHO": "a"})

	// Another shape: served warm with the snapshot's shape, and said so.
	r, err = svc.Create(ctx, cubelet.CreateRequest{SandboxID: "warm-b", TemplateID: "busybox",
		Resources: sandbox.Resources{MemoryMiB: sn.Resources.MemoryMiB * 2}})
	if err != nil {
		t.Fatalf("create with another shape: %v", err)
	}
	if !r.Warm || len(r.Warnings) != 1 || r.Sandbox.Resources.MemoryMiB != sn.Resources.MemoryMiB {
		t.Fatalf("create with another shape: warm=%v warnings=%v resources=%+v", r.Warm, r.Warnings, r.Sandbox.Resources)
	}

	// runc asked for explicitly: a cold boot.
	r, err = svc.Create(ctx, cubelet.CreateRequest{SandboxID: "cold-c", TemplateID: "busybox", Runtime: "runc"})
	if err != nil || r.Warm || r.Sandbox.Runtime != "runc" {
		t.Fatalf("runc create from a gvisor-warm template: %+v %v", r, err)
	}

	for _, id := range []string{"warm-a", "warm-b", "cold-c"} {
		if _, err := svc.Delete(ctx, id); err != nil {
			t.Fatal(err)
		}
	}
	if err := svc.DeleteTemplate(ctx, "busybox"); err != nil {
		t.Fatalf("delete warm template: %v", err)
	}
	if _, err := svc.GetSnapshot(ctx, sn.ID); !errdefs.IsNotFound(err) {
		t.Fatalf("warm snapshot after its template went: %v", err)
	}
}
