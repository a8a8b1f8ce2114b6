package integration

import (
	"context"
	"testing"

	"github.com/cubesandbox/cube/internal/cubelet"
	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
	"github.com/cubesandbox/cube/internal/failpoint"
	"github.com/cubesandbox/cube/internal/lifecycle"
	"github.com/cubesandbox/cube/internal/network/nettest"
)

// TestVerbOutlivesCaller: a caller that goes away mid-verb (a cubemaster
// SIGKILLed during the call cancels its context) does not cut the verb's
// flow short. On gVisor, snapshot, pause, resume and rollback each have
// their caller's context cancelled right after the flow's first action;
// each verb still completes, and the sandbox runs on with its memory (a
// live process's value) and files. Cut short, `runsc checkpoint` was
// killed half-way, the undo could not resume the sandbox, and cubelet
// marked it failed.
func TestVerbOutlivesCaller(t *testing.T) {
	cubelettest.RequireRoot(t)
	requireRunsc(t)
	env := cubelettest.New(t, "")
	env.StartNetworkAgent(t, nettest.Options{PoolSize: 2})
	svc := env.Start(t)
	env.ImportBusybox(t, svc, "busybox")
	a := mustCreate(t, svc, cubelet.CreateRequest{SandboxID: "ol-a", Runtime: "gvisor"})
	defer func() {
		if _, err := svc.Delete(context.Background(), a.ID); err != nil {
			t.Error(err)
		}
		for _, sn := range listSnaps(t, svc, "") {
			_ = svc.DeleteSnapshot(context.Background(), sn)
		}
		assertSnapshotFiles(t, env, svc)
		env.AssertNoLeaks(t)
	}()
	file := writePayload(t, svc, a.ID)
	buf := holdBuffer(t, svc, a.ID)

	// callerGone runs verb with a context that is cancelled once flow's
	// first action has run.
	callerGone := func(flow string, verb func(ctx context.Context) error) {
		t.Helper()
		point := points(svc, flow)[1] // "<flow>/<first action>/after"
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		if err := failpoint.EnableFunc(point, func(context.Context) error { cancel(); return nil }); err != nil {
			t.Fatal(err)
		}
		defer failpoint.Disable(point)
		if err := verb(ctx); err != nil {
			t.Fatalf("%s with its caller gone after %s: %v", flow, point, err)
		}
		if ctx.Err() == nil {
			t.Fatalf("%s: %s never ran", flow, point)
		}
		t.Logf("%s: completed though its caller went away after %s", flow, point)
	}

	var sn string
	callerGone(cubelet.FlowSnapshot, func(ctx context.Context) error {
		res, err := svc.Snapshot(ctx, cubelet.SnapshotRequest{SandboxID: a.ID, SnapshotID: "ol-snap"})
		if err == nil {
			sn = res.Snapshot.ID
		}
		return err
	})
	mustState(t, svc, a.ID, lifecycle.Running)
	checkBuffer(t, svc, a.ID, buf)
	callerGone(cubelet.FlowPause, func(ctx context.Context) error { _, err := svc.Pause(ctx, a.ID); return err })
	mustState(t, svc, a.ID, lifecycle.Paused)
	callerGone(cubelet.FlowResume, func(ctx context.Context) error { _, err := svc.Resume(ctx, a.ID); return err })
	mustState(t, svc, a.ID, lifecycle.Running)
	checkBuffer(t, svc, a.ID, buf)
	writePayload(t, svc, a.ID)
	holdBuffer(t, svc, a.ID)
	callerGone(cubelet.FlowRollback, func(ctx context.Context) error {
		_, err := svc.Rollback(ctx, cubelet.RollbackRequest{SandboxID: a.ID, SnapshotID: sn})
		return err
	})
	mustState(t, svc, a.ID, lifecycle.Running)
	agentReady(t, svc, a.ID)
	checkPayload(t, svc, a.ID, file)
	checkBuffer(t, svc, a.ID, buf)
}
