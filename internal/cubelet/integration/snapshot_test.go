package integration

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/cubelet"
	"github.com/cubesandbox/cube/internal/cubelet/agentclient"
	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/lifecycle"
	"github.com/cubesandbox/cube/internal/sandbox"
)

// rootfs is where a sandbox's disk is mounted on the host; writing there
// is writing to the sandbox's filesystem.
func rootfs(env *cubelettest.Env, id string) string {
	return filepath.Join(env.Config.SandboxRunDir(id), "rootfs")
}

// files is a set of paths (relative to a sandbox root) and contents; a
// nil content means "must not exist".
type files map[string][]byte

func randBytes(n int) []byte {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return b
}

func writeFiles(t *testing.T, root string, fs files) {
	t.Helper()
	for p, data := range fs {
		full := filepath.Join(root, p)
		if data == nil {
			if err := os.Remove(full); err != nil && !errors.Is(err, os.ErrNotExist) {
				t.Fatal(err)
			}
			continue
		}
		if err := os.MkdirAll(filepath.Dir(full), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(full, data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

// checkFiles compares byte for byte.
func checkFiles(t *testing.T, root string, want files) {
	t.Helper()
	for p, data := range want {
		got, err := os.ReadFile(filepath.Join(root, p))
		switch {
		case data == nil && !errors.Is(err, os.ErrNotExist):
			t.Errorf("%s: should not exist (err %v)", p, err)
		case data != nil && err != nil:
			t.Errorf("%s: %v", p, err)
		case data != nil && !bytes.Equal(got, data):
			t.Errorf("%s: %d bytes differ from the %d expected", p, len(got), len(data))
		}
	}
}

// assertSnapshotFiles checks that the pool holds exactly the directories
// of the snapshots the service lists: no half-taken or orphaned files.
func assertSnapshotFiles(t *testing.T, env *cubelettest.Env, svc *cubelet.Service) {
	t.Helper()
	sns, err := svc.ListSnapshots(context.Background(), cubelet.SnapshotFilter{})
	if err != nil {
		t.Fatal(err)
	}
	var want, got []string
	for _, sn := range sns {
		want = append(want, sn.ID)
		if _, err := os.Stat(sn.DiskPath); err != nil {
			t.Errorf("snapshot %s: disk: %v", sn.ID, err)
		}
	}
	ents, _ := os.ReadDir(filepath.Join(env.Config.PoolDir(), "snapshots"))
	for _, e := range ents {
		got = append(got, e.Name())
	}
	slices.Sort(want)
	slices.Sort(got)
	if !slices.Equal(want, got) {
		t.Errorf("snapshot dirs %v, records %v", got, want)
	}
}

func mustCreate(t *testing.T, svc *cubelet.Service, req cubelet.CreateRequest) *sandbox.Record {
	t.Helper()
	if req.TemplateID == "" {
		req.TemplateID = "busybox"
	}
	res, err := svc.Create(context.Background(), req)
	if err != nil {
		t.Fatalf("create: %v", err)
	}
	return res.Sandbox
}

func mustSnapshot(t *testing.T, svc *cubelet.Service, req cubelet.SnapshotRequest) *sandbox.Snapshot {
	t.Helper()
	res, err := svc.Snapshot(context.Background(), req)
	if err != nil {
		t.Fatalf("snapshot of %s: %v", req.SandboxID, err)
	}
	return res.Snapshot
}

func mustState(t *testing.T, svc *cubelet.Service, id string, want lifecycle.State) *sandbox.Record {
	t.Helper()
	sb, err := svc.Get(context.Background(), id)
	if err != nil {
		t.Fatalf("get %s: %v", id, err)
	}
	if sb.State != want || sb.PrevState != "" {
		t.Fatalf("sandbox %s is %s (prev %q), want %s (error %q)", id, sb.State, sb.PrevState, want, sb.Error)
	}
	return sb
}

func agentUp(t *testing.T, svc *cubelet.Service, id string) {
	t.Helper()
	sb, _ := svc.Get(context.Background(), id)
	if sb == nil || sb.Container == nil {
		t.Fatalf("sandbox %s has no container", id)
	}
	if err := agentclient.WaitAgent(context.Background(), sb.Container.PID); err != nil {
		t.Fatalf("agent of %s: %v", id, err)
	}
}

func inode(t *testing.T, path string) uint64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	return st.Ino
}

func TestSnapshotRollbackClone(t *testing.T) {
	env := cubelettest.New(t, "")
	svc := env.Start(t)
	env.ImportBusybox(t, svc, "busybox")
	ctx := context.Background()

	a := mustCreate(t, svc, cubelet.CreateRequest{Labels: map[string]string{"app": "a"}, Env: map[string]string{"FOO": "bar"}})
	v1 := files{"data/a.txt": []byte("version one\n"), "data/blob": randBytes(256 << 10), "data/new.txt": nil}
	writeFiles(t, rootfs(env, a.ID), v1)

	// Snapshot of a running sandbox: it stays running, the snapshot is
	// disk-only (runc) with its lineage.
	s1 := mustSnapshot(t, svc, cubelet.SnapshotRequest{SandboxID: a.ID, Name: "first", Labels: map[string]string{"k": "v"}})
	mustState(t, svc, a.ID, lifecycle.Running)
	agentUp(t, svc, a.ID)
	if s1.HasMemory || s1.SandboxID != a.ID || s1.TemplateID != "busybox" || s1.ParentSnapshotID != "" ||
		s1.Name != "first" || s1.SizeBytes <= 0 || s1.Runtime != "runc" || s1.CreatedAt.IsZero() {
		t.Fatalf("snapshot record: %+v", s1)
	}
	if got, err := svc.GetSnapshot(ctx, s1.ID); err != nil || got.ID != s1.ID {
		t.Fatalf("get snapshot: %+v %v", got, err)
	}

	// Change everything, roll back, and get the snapshot's bytes back.
	writeFiles(t, rootfs(env, a.ID), files{"data/a.txt": []byte("version two, longer\n"), "data/blob": nil, "data/new.txt": []byte("new")})
	pid := mustState(t, svc, a.ID, lifecycle.Running).Container.PID
	res, err := svc.Rollback(ctx, cubelet.RollbackRequest{SandboxID: a.ID, SnapshotID: s1.ID})
	if err != nil {
		t.Fatalf("rollback: %v", err)
	}
	if res.Sandbox.ID != a.ID || res.Sandbox.SourceSnapshotID != s1.ID || res.Sandbox.Container.PID == pid {
		t.Fatalf("after rollback: %+v", res.Sandbox)
	}
	mustState(t, svc, a.ID, lifecycle.Running)
	agentUp(t, svc, a.ID)
	checkFiles(t, rootfs(env, a.ID), v1)
	if _, err := os.Stat(res.Sandbox.Disk.Path + ".staged"); !os.IsNotExist(err) {
		t.Errorf("replaced disk left behind: %v", err)
	}

	// A paused sandbox: the snapshot leaves it paused (still frozen); a
	// rollback brings it back running.
	if _, err := svc.Pause(ctx, a.ID); err != nil {
		t.Fatal(err)
	}
	s2 := mustSnapshot(t, svc, cubelet.SnapshotRequest{SandboxID: a.ID})
	mustState(t, svc, a.ID, lifecycle.Paused)
	if freezerState(t, env, a.ID) != "FROZEN" {
		t.Fatal("snapshot thawed a paused sandbox")
	}
	if s2.ParentSnapshotID != s1.ID {
		t.Fatalf("lineage: parent of %s is %q, want %s", s2.ID, s2.ParentSnapshotID, s1.ID)
	}
	writeFiles(t, rootfs(env, a.ID), files{"data/a.txt": []byte("dirty")})
	if _, err := svc.Rollback(ctx, cubelet.RollbackRequest{SandboxID: a.ID, SnapshotID: s2.ID}); err != nil {
		t.Fatalf("rollback of a paused sandbox: %v", err)
	}
	mustState(t, svc, a.ID, lifecycle.Running)
	agentUp(t, svc, a.ID)
	checkFiles(t, rootfs(env, a.ID), v1)

	// Clone 10 from one snapshot: distinct IDs, each its own disk with the
	// snapshot's content, the snapshot's resources and env.
	cl, err := svc.Clone(ctx, cubelet.CloneRequest{SnapshotID: s1.ID, Count: 10, Labels: map[string]string{"clone": "yes"}})
	if err != nil {
		t.Fatalf("clone: %v", err)
	}
	if len(cl.Sandboxes) != 10 {
		t.Fatalf("%d clones", len(cl.Sandboxes))
	}
	ids := map[string]bool{}
	inodes := map[uint64]bool{inode(t, a.Disk.Path): true}
	for _, c := range cl.Sandboxes {
		if ids[c.ID] || c.ID == a.ID {
			t.Fatalf("clone ID %s repeated", c.ID)
		}
		ids[c.ID] = true
		if c.State != lifecycle.Running || c.SourceSnapshotID != s1.ID || c.TemplateID != "busybox" ||
			c.Labels["clone"] != "yes" || c.Env["FOO"] != "bar" || c.Resources != a.Resources {
			t.Fatalf("clone record: %+v", c)
		}
		checkFiles(t, rootfs(env, c.ID), v1)
		if ino := inode(t, c.Disk.Path); inodes[ino] {
			t.Fatalf("clone %s shares a disk file", c.ID)
		} else {
			inodes[ino] = true
		}
	}
	if l, _ := svc.List(ctx, cubelet.ListFilter{Labels: map[string]string{"clone": "yes"}}); len(l) != 10 {
		t.Fatalf("list clones: %d", len(l))
	}
	// Clones are independent of each other.
	c0, c1 := cl.Sandboxes[0].ID, cl.Sandboxes[1].ID
	writeFiles(t, rootfs(env, c0), files{"data/a.txt": []byte("only in c0")})
	checkFiles(t, rootfs(env, c1), v1)

	// Snapshots outlive their sandbox and stay clonable; the template
	// stays while they reference it.
	if _, err := svc.Delete(ctx, a.ID); err != nil {
		t.Fatal(err)
	}
	if l, _ := svc.ListSnapshots(ctx, cubelet.SnapshotFilter{SandboxID: a.ID}); len(l) != 2 {
		t.Fatalf("snapshots of the destroyed sandbox: %d", len(l))
	}
	late, err := svc.Clone(ctx, cubelet.CloneRequest{SnapshotID: s1.ID, Count: 1, SandboxIDs: []string{"late-clone"}})
	if err != nil {
		t.Fatalf("clone after the parent was destroyed: %v", err)
	}
	checkFiles(t, rootfs(env, "late-clone"), v1)
	for _, c := range append(cl.Sandboxes, late.Sandboxes...) {
		if _, err := svc.Delete(ctx, c.ID); err != nil {
			t.Fatal(err)
		}
	}
	if err := svc.DeleteTemplate(ctx, "busybox"); !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("delete of a template snapshots reference: %v", err)
	}
	assertSnapshotFiles(t, env, svc)
	for _, sn := range []*sandbox.Snapshot{s1, s2} {
		if err := svc.DeleteSnapshot(ctx, sn.ID); err != nil {
			t.Fatal(err)
		}
	}
	if err := svc.DeleteSnapshot(ctx, s1.ID); !errdefs.IsNotFound(err) {
		t.Fatalf("second delete: %v", err)
	}
	assertSnapshotFiles(t, env, svc)
	if err := svc.DeleteTemplate(ctx, "busybox"); err != nil {
		t.Fatalf("delete template after its snapshots: %v", err)
	}
	env.AssertNoLeaks(t)
}

func TestSnapshotValidation(t *testing.T) {
	env := cubelettest.New(t, "")
	svc := env.Start(t)
	env.ImportBusybox(t, svc, "busybox")
	env.ImportBusybox(t, svc, "other")
	ctx := context.Background()
	a := mustCreate(t, svc, cubelet.CreateRequest{SandboxID: "val-a"})
	b := mustCreate(t, svc, cubelet.CreateRequest{SandboxID: "val-b", TemplateID: "other"})
	s := mustSnapshot(t, svc, cubelet.SnapshotRequest{SandboxID: a.ID, SnapshotID: "snap-a"})
	defer func() {
		for _, id := range []string{a.ID, b.ID, "val-c"} {
			_, _ = svc.Delete(ctx, id)
		}
		_ = svc.DeleteSnapshot(ctx, s.ID)
		env.AssertNoLeaks(t)
	}()

	is := func(what string, err error, want func(error) bool) {
		t.Helper()
		if !want(err) {
			t.Errorf("%s: got %v", what, err)
		}
	}
	field := func(err error) string {
		var fe *errdefs.FieldError
		if errors.As(err, &fe) {
			return fe.Field
		}
		return ""
	}
	_, err := svc.Snapshot(ctx, cubelet.SnapshotRequest{SandboxID: "nope"})
	is("snapshot of an unknown sandbox", err, errdefs.IsNotFound)
	_, err = svc.Snapshot(ctx, cubelet.SnapshotRequest{SandboxID: a.ID, SnapshotID: "Bad_ID"})
	is("bad snapshot id", err, errdefs.IsInvalidArgument)
	if field(err) != "snapshot_id" {
		t.Errorf("bad snapshot id: field %q", field(err))
	}
	_, err = svc.Snapshot(ctx, cubelet.SnapshotRequest{SandboxID: a.ID, SnapshotID: "snap-a"})
	is("duplicate snapshot id", err, errdefs.IsAlreadyExists)
	mustState(t, svc, a.ID, lifecycle.Running)
	_, err = svc.Snapshot(ctx, cubelet.SnapshotRequest{SandboxID: a.ID, Name: string(make([]byte, 200))})
	is("long name", err, errdefs.IsInvalidArgument)
	_, err = svc.Snapshot(ctx, cubelet.SnapshotRequest{SandboxID: a.ID, Labels: map[string]string{"bad key": "v"}})
	is("bad label", err, errdefs.IsInvalidArgument)
	_, err = svc.GetSnapshot(ctx, "missing")
	is("get unknown snapshot", err, errdefs.IsNotFound)
	is("delete unknown snapshot", svc.DeleteSnapshot(ctx, "missing"), errdefs.IsNotFound)

	for _, c := range []struct {
		name  string
		req   cubelet.CloneRequest
		field string
	}{
		{"no snapshot", cubelet.CloneRequest{Count: 1}, "snapshot_id"},
		{"count 0", cubelet.CloneRequest{SnapshotID: s.ID}, "count"},
		{"count 101", cubelet.CloneRequest{SnapshotID: s.ID, Count: 101}, "count"},
		{"ids mismatch", cubelet.CloneRequest{SnapshotID: s.ID, Count: 2, SandboxIDs: []string{"x"}}, "sandbox_ids"},
		{"bad id", cubelet.CloneRequest{SnapshotID: s.ID, Count: 1, SandboxIDs: []string{"X!"}}, "sandbox_ids[0]"},
		{"dup ids", cubelet.CloneRequest{SnapshotID: s.ID, Count: 2, SandboxIDs: []string{"x", "x"}}, "sandbox_ids[1]"},
		{"bad env", cubelet.CloneRequest{SnapshotID: s.ID, Count: 1, Env: map[string]string{"1X": ""}}, "env"},
	} {
		_, err := svc.Clone(ctx, c.req)
		if !errdefs.IsInvalidArgument(err) || field(err) != c.field {
			t.Errorf("clone %s: want InvalidArgument on %s, got %v", c.name, c.field, err)
		}
	}
	_, err = svc.Clone(ctx, cubelet.CloneRequest{SnapshotID: "missing", Count: 1})
	is("clone of an unknown snapshot", err, errdefs.IsNotFound)
	// One taken ID refuses the whole call before anything is made.
	_, err = svc.Clone(ctx, cubelet.CloneRequest{SnapshotID: s.ID, Count: 2, SandboxIDs: []string{"val-c", a.ID}})
	is("clone onto an existing ID", err, errdefs.IsAlreadyExists)
	if _, err := svc.Get(ctx, "val-c"); !errdefs.IsNotFound(err) {
		t.Errorf("refused clone call made val-c: %v", err)
	}

	_, err = svc.Rollback(ctx, cubelet.RollbackRequest{SandboxID: b.ID, SnapshotID: s.ID})
	is("rollback onto another template's snapshot", err, errdefs.IsFailedPrecondition)
	mustState(t, svc, b.ID, lifecycle.Running)
	_, err = svc.Rollback(ctx, cubelet.RollbackRequest{SandboxID: a.ID, SnapshotID: "missing"})
	is("rollback to an unknown snapshot", err, errdefs.IsNotFound)
	_, err = svc.Rollback(ctx, cubelet.RollbackRequest{SandboxID: "nope", SnapshotID: s.ID})
	is("rollback of an unknown sandbox", err, errdefs.IsNotFound)
	_, err = svc.Rollback(ctx, cubelet.RollbackRequest{SandboxID: a.ID})
	is("rollback without snapshot", err, errdefs.IsInvalidArgument)

	// --stop: the sandbox is destroyed, the snapshot stays.
	c := mustCreate(t, svc, cubelet.CreateRequest{SandboxID: "val-c"})
	sc := mustSnapshot(t, svc, cubelet.SnapshotRequest{SandboxID: c.ID, Stop: true})
	if _, err := svc.Get(ctx, c.ID); !errdefs.IsNotFound(err) {
		t.Errorf("snapshot --stop left the sandbox: %v", err)
	}
	if _, err := svc.GetSnapshot(ctx, sc.ID); err != nil {
		t.Errorf("snapshot --stop lost the snapshot: %v", err)
	}
	if err := svc.DeleteSnapshot(ctx, sc.ID); err != nil {
		t.Fatal(err)
	}
	assertSnapshotFiles(t, env, svc)
	if l, _ := svc.ListSnapshots(ctx, cubelet.SnapshotFilter{}); len(l) != 1 || l[0].ID != s.ID {
		t.Fatalf("snapshots left: %+v", l)
	}
	if l, _ := svc.List(ctx, cubelet.ListFilter{}); len(l) != 2 {
		t.Fatalf("sandboxes left: %d", len(l))
	}
}
