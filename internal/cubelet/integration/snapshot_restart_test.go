package integration

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	pb "github.com/cubesandbox/cube/api/cubelet/v1"
	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
)

// readyDisks lists the ready disks of a template in the pool.
func readyDisks(env *cubelettest.Env, tmpl string) []string {
	ents, _ := os.ReadDir(filepath.Join(env.Config.PoolDir(), "ready", tmpl))
	var out []string
	for _, e := range ents {
		if strings.HasSuffix(e.Name(), ".img") {
			out = append(out, e.Name())
		}
	}
	return out
}

// TestSnapshotCrashRecovery kills cubelet (SIGKILL) in the middle of a
// snapshot and of a rollback and checks what the restart makes of it:
// ready disks adopted, half-taken snapshots and orphaned snapshot files
// removed, a sandbox the snapshot froze thawed, a rollback's staged disk
// removed, and the sandbox running on whichever disk it really has.
func TestSnapshotCrashRecovery(t *testing.T) {
	env := cubelettest.New(t, "")
	cfgPath := env.WriteConfig(t, "[storage.disk_pool]\nsize = 3\n")
	ctx := context.Background()

	d := startDaemon(t, env, cfgPath, "")
	stream, err := d.client.ImportTemplate(ctx, &pb.ImportTemplateRequest{TemplateId: "busybox", Source: env.Image})
	if err != nil {
		t.Fatal(err)
	}
	for {
		if _, err := stream.Recv(); err != nil {
			break
		}
	}
	// The first create registers the template with the pool (a miss);
	// the refiller then makes 3 ready disks.
	if _, err := d.client.CreateSandbox(ctx, &pb.CreateSandboxRequest{SandboxId: "crash", TemplateId: "busybox"}); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(20 * time.Second)
	for len(readyDisks(env, "busybox")) < 3 {
		if time.Now().After(deadline) {
			t.Fatalf("pool never filled: %v", readyDisks(env, "busybox"))
		}
		time.Sleep(20 * time.Millisecond)
	}
	before := readyDisks(env, "busybox")
	root := rootfs(env, "crash")
	v1 := files{"keep/a": []byte("before the crash"), "keep/b": randBytes(10000)}
	writeFiles(t, root, v1)
	d.kill()

	// Orphaned snapshot files (no record) are swept at start.
	orphan := filepath.Join(env.Config.PoolDir(), "snapshots", "orphan", "disk.img")
	if err := os.MkdirAll(filepath.Dir(orphan), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(orphan, []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}

	// Crash after the disk copy, with the sandbox frozen.
	d = startDaemon(t, env, cfgPath, "snapshot/disk/after=kill")
	if after := readyDisks(env, "busybox"); !slices.Equal(before, after) {
		t.Errorf("ready disks not adopted across the restart: %v then %v", before, after)
	}
	if !strings.Contains(tail(d.log), "adopted=3") {
		t.Errorf("restart log does not report 3 adopted ready disks:\n%s", tail(d.log))
	}
	_, _ = d.client.SnapshotSandbox(ctx, &pb.SnapshotSandboxRequest{SandboxId: "crash", SnapshotId: "half"})
	d.waitDead(t)
	if freezerState(t, env, "crash") != "FROZEN" {
		t.Fatal("the kill did not leave the sandbox frozen mid-snapshot")
	}

	d = startDaemon(t, env, cfgPath, "")
	expectRunning := func(c pb.CubeletServiceClient, source string) {
		t.Helper()
		got, err := c.GetSandbox(ctx, &pb.GetSandboxRequest{SandboxId: "crash"})
		if err != nil || got.Sandbox.State != pb.SandboxState_SANDBOX_STATE_RUNNING || got.Sandbox.SourceSnapshotId != source {
			t.Fatalf("after restart: %v %v", got, err)
		}
		if freezerState(t, env, "crash") != "THAWED" {
			t.Fatal("sandbox still frozen after restart")
		}
		if err := waitAgent(int(got.Sandbox.Pid)); err != nil {
			t.Fatal(err)
		}
		if _, err := os.Stat(filepath.Join(env.Config.PoolDir(), "sandboxes", "crash", "disk.img.staged")); !os.IsNotExist(err) {
			t.Fatalf("staged rollback disk survived the restart: %v", err)
		}
	}
	expectRunning(d.client, "")
	list, err := d.client.ListSnapshots(ctx, &pb.ListSnapshotsRequest{})
	if err != nil || len(list.Snapshots) != 0 {
		t.Fatalf("half-taken snapshot survived: %v %v", list, err)
	}
	if ents, _ := os.ReadDir(filepath.Join(env.Config.PoolDir(), "snapshots")); len(ents) != 0 {
		t.Fatalf("snapshot files survived the restart: %v", ents)
	}
	checkFiles(t, root, v1)
	if _, err := d.client.SnapshotSandbox(ctx, &pb.SnapshotSandboxRequest{SandboxId: "crash", SnapshotId: "good"}); err != nil {
		t.Fatal(err)
	}
	v2 := files{"keep/a": []byte("after the snapshot"), "keep/b": nil}
	writeFiles(t, root, v2)
	d.kill()

	// Crash with the snapshot disk staged, before the sandbox is touched:
	// it keeps running on its own disk.
	d = startDaemon(t, env, cfgPath, "rollback/disk/after=kill")
	_, _ = d.client.RollbackSandbox(ctx, &pb.RollbackSandboxRequest{SandboxId: "crash", SnapshotId: "good"})
	d.waitDead(t)
	d = startDaemon(t, env, cfgPath, "")
	expectRunning(d.client, "")
	checkFiles(t, root, v2)
	d.kill()

	// Crash once the container runs on the swapped disk, before its agent
	// was waited for: it is adopted running on the snapshot's disk.
	d = startDaemon(t, env, cfgPath, "rollback/container/after=kill")
	_, _ = d.client.RollbackSandbox(ctx, &pb.RollbackSandboxRequest{SandboxId: "crash", SnapshotId: "good"})
	d.waitDead(t)
	d = startDaemon(t, env, cfgPath, "")
	expectRunning(d.client, "good")
	checkFiles(t, root, v1)

	if _, err := d.client.DeleteSandbox(ctx, &pb.DeleteSandboxRequest{SandboxId: "crash"}); err != nil {
		t.Fatal(err)
	}
	if _, err := d.client.DeleteSnapshot(ctx, &pb.DeleteSnapshotRequest{SnapshotId: "good"}); err != nil {
		t.Fatal(err)
	}
	d.kill()
	env.AssertNoLeaks(t)
}
