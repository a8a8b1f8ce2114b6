package agenttest

import (
	"context"
	"path"
	"slices"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	fspb "github.com/cubesandbox/cube/api/envd/filesystem"
)

// scratch makes a fresh directory in the user's home, removed afterwards.
func (h *harness) scratch(t *testing.T) string {
	t.Helper()
	dir := path.Join(h.tg.UserHome, "t-"+strings.ReplaceAll(t.Name(), "/", "-")+"-"+time.Now().Format("150405.000000"))
	if _, err := h.fs.MakeDir(ctxT(t), as(h, "user", &fspb.MakeDirRequest{Path: dir})); err != nil {
		t.Fatalf("scratch dir: %v", err)
	}
	t.Cleanup(func() {
		_, _ = h.fs.Remove(context.Background(), as(h, "root", &fspb.RemoveRequest{Path: dir}))
	})
	return dir
}

func (h *harness) testFilesystem(t *testing.T) {
	t.Run("MakeDirStatListMoveRemove", h.testFSBasics)
	t.Run("SymlinkAndRelativePaths", h.testFSSymlinks)
	t.Run("Permissions", h.testFSPermissions)
	t.Run("WatchDir", h.testWatchDir)
	t.Run("PollingWatcher", h.testPollingWatcher)
}

func (h *harness) testFSBasics(t *testing.T) {
	ctx := ctxT(t)
	dir := h.scratch(t)
	res, err := h.fs.MakeDir(ctx, as(h, "user", &fspb.MakeDirRequest{Path: dir + "/a/b"}))
	if err != nil {
		t.Fatal(err)
	}
	if e := res.Msg.GetEntry(); e.GetType() != fspb.FileType_FILE_TYPE_DIRECTORY || e.GetPath() != dir+"/a/b" || e.GetName() != "b" || e.GetOwner() != "user" {
		t.Errorf("mkdir entry: %v", e)
	}
	_, err = h.fs.MakeDir(ctx, as(h, "user", &fspb.MakeDirRequest{Path: dir + "/a/b"}))
	wantCode(t, "mkdir existing", err, connect.CodeAlreadyExists)

	h.upload(t, "user", dir+"/a/f.txt", []byte("hello"))
	_, err = h.fs.MakeDir(ctx, as(h, "user", &fspb.MakeDirRequest{Path: dir + "/a/f.txt"}))
	wantCode(t, "mkdir over a file", err, connect.CodeInvalidArgument)

	st, err := h.fsBin.Stat(ctx, as(h, "user", &fspb.StatRequest{Path: dir + "/a/f.txt"}))
	if err != nil {
		t.Fatal(err)
	}
	e := st.Msg.GetEntry()
	age := time.Since(e.GetModifiedTime().AsTime())
	if e.GetType() != fspb.FileType_FILE_TYPE_FILE || e.GetSize() != 5 || e.GetMode() != 0o644 || e.GetPermissions() != "-rw-r--r--" ||
		e.GetOwner() != "user" || e.GetGroup() != "user" || age < -time.Minute || age > time.Minute || e.SymlinkTarget != nil {
		t.Errorf("stat: %v (age %s)", e, age)
	}
	_, err = h.fs.Stat(ctx, as(h, "user", &fspb.StatRequest{Path: dir + "/missing"}))
	wantCode(t, "stat missing", err, connect.CodeNotFound)

	names := func(depth uint32) []string {
		t.Helper()
		res, err := h.fs.ListDir(ctx, as(h, "user", &fspb.ListDirRequest{Path: dir, Depth: depth}))
		if err != nil {
			t.Fatalf("list depth %d: %v", depth, err)
		}
		var out []string
		for _, e := range res.Msg.GetEntries() {
			out = append(out, strings.TrimPrefix(e.GetPath(), dir+"/"))
		}
		slices.Sort(out)
		return out
	}
	if got := names(0); !slices.Equal(got, []string{"a"}) {
		t.Errorf("depth 0 (= 1): %v", got)
	}
	if got := names(2); !slices.Equal(got, []string{"a", "a/b", "a/f.txt"}) {
		t.Errorf("depth 2: %v", got)
	}
	_, err = h.fs.ListDir(ctx, as(h, "user", &fspb.ListDirRequest{Path: dir + "/a/f.txt"}))
	wantCode(t, "list a file", err, connect.CodeInvalidArgument)
	_, err = h.fs.ListDir(ctx, as(h, "user", &fspb.ListDirRequest{Path: dir + "/nope"}))
	wantCode(t, "list missing", err, connect.CodeNotFound)

	mv, err := h.fs.Move(ctx, as(h, "user", &fspb.MoveRequest{Source: dir + "/a/f.txt", Destination: dir + "/new/parent/g.txt"}))
	if err != nil {
		t.Fatal(err)
	}
	if mv.Msg.GetEntry().GetPath() != dir+"/new/parent/g.txt" || mv.Msg.GetEntry().GetSize() != 5 {
		t.Errorf("move entry: %v", mv.Msg.GetEntry())
	}
	if string(h.download(t, "user", dir+"/new/parent/g.txt")) != "hello" {
		t.Errorf("moved content differs")
	}
	_, err = h.fs.Move(ctx, as(h, "user", &fspb.MoveRequest{Source: dir + "/a/f.txt", Destination: dir + "/x"}))
	wantCode(t, "move missing source", err, connect.CodeNotFound)
	_, err = h.fs.Move(ctx, as(h, "user", &fspb.MoveRequest{Source: dir + "/new"}))
	wantCode(t, "move without destination", err, connect.CodeInvalidArgument)

	if _, err := h.fs.Remove(ctx, as(h, "user", &fspb.RemoveRequest{Path: dir + "/new"})); err != nil {
		t.Fatal(err)
	}
	_, err = h.fs.Stat(ctx, as(h, "user", &fspb.StatRequest{Path: dir + "/new/parent/g.txt"}))
	wantCode(t, "stat removed", err, connect.CodeNotFound)
	if _, err := h.fs.Remove(ctx, as(h, "user", &fspb.RemoveRequest{Path: dir + "/new"})); err != nil {
		t.Errorf("removing what is gone should succeed (envd): %v", err)
	}
	_, err = h.fs.Remove(ctx, as(h, "root", &fspb.RemoveRequest{Path: "/"}))
	wantCode(t, "remove /", err, connect.CodeInvalidArgument)
}

func (h *harness) testFSSymlinks(t *testing.T) {
	ctx := ctxT(t)
	dir := h.scratch(t)
	h.upload(t, "user", dir+"/target.txt", []byte("x"))
	if r, err := h.run(ctx, h.proc, as(h, "user", sh("cd "+dir+" && /bin/busybox ln -s target.txt link && /bin/busybox ln -s nowhere dangling"))); err != nil || r.end.GetExitCode() != 0 {
		t.Fatalf("ln: %v %s %s", err, r.stderr, fmtEnd(r.end))
	}
	st, err := h.fs.Stat(ctx, as(h, "user", &fspb.StatRequest{Path: dir + "/link"}))
	if err != nil {
		t.Fatal(err)
	}
	if e := st.Msg.GetEntry(); e.GetType() != fspb.FileType_FILE_TYPE_SYMLINK || e.GetSymlinkTarget() != dir+"/target.txt" {
		t.Errorf("symlink: %v", e)
	}
	st, err = h.fs.Stat(ctx, as(h, "user", &fspb.StatRequest{Path: dir + "/dangling"}))
	if err != nil || st.Msg.GetEntry().GetSymlinkTarget() != "nowhere" {
		t.Errorf("dangling symlink: %v %v", st.Msg.GetEntry(), err)
	}
	// Relative paths and ~ are in the user's home.
	rel := strings.TrimPrefix(dir, h.tg.UserHome+"/")
	for _, p := range []string{rel + "/target.txt", "~/" + rel + "/target.txt"} {
		st, err := h.fs.Stat(ctx, as(h, "user", &fspb.StatRequest{Path: p}))
		if err != nil || st.Msg.GetEntry().GetPath() != dir+"/target.txt" {
			t.Errorf("stat %q: %v %v", p, st.Msg.GetEntry(), err)
		}
	}
}

func (h *harness) testFSPermissions(t *testing.T) {
	ctx := ctxT(t)
	ro := h.tg.RootOnly
	_, err := h.fs.ListDir(ctx, as(h, "user", &fspb.ListDirRequest{Path: ro}))
	wantCode(t, "user lists root-only dir", err, connect.CodePermissionDenied)
	_, err = h.fs.Stat(ctx, as(h, "user", &fspb.StatRequest{Path: ro + "/x"}))
	wantCode(t, "user stats inside root-only dir", err, connect.CodePermissionDenied)
	_, err = h.fs.MakeDir(ctx, as(h, "user", &fspb.MakeDirRequest{Path: "/cube-forbidden-dir"}))
	wantCode(t, "user mkdir in /", err, connect.CodePermissionDenied)
	_, err = h.fs.Remove(ctx, as(h, "user", &fspb.RemoveRequest{Path: ro}))
	wantCode(t, "user removes root's dir", err, connect.CodePermissionDenied)
	if _, err := h.fs.ListDir(ctx, as(h, "root", &fspb.ListDirRequest{Path: ro})); err != nil {
		t.Errorf("root lists its dir: %v", err)
	}
	// What root creates is root's, what user creates is user's.
	dir := h.scratch(t)
	for _, u := range []string{"root", "user"} {
		res, err := h.fs.MakeDir(ctx, as(h, u, &fspb.MakeDirRequest{Path: dir + "/by-" + u}))
		if err != nil || res.Msg.GetEntry().GetOwner() != u || res.Msg.GetEntry().GetGroup() != u {
			t.Errorf("mkdir as %s: %v %v", u, res, err)
		}
	}
}

// watchEvent is a received filesystem event, flattened.
type watchEvent struct {
	name string
	typ  fspb.EventType
	e    *fspb.EntryInfo
}

func (h *harness) testWatchDir(t *testing.T) {
	ctx := ctxT(t)
	dir := h.scratch(t)
	watch := func(recursive, entries bool) (<-chan watchEvent, func()) {
		t.Helper()
		wctx, cancel := context.WithCancel(ctx)
		s, err := h.fs.WatchDir(wctx, as(h, "user", &fspb.WatchDirRequest{Path: dir, Recursive: recursive, IncludeEntry: entries}))
		if err != nil {
			t.Fatal(err)
		}
		if !s.Receive() || s.Msg().GetStart() == nil {
			t.Fatalf("watch: first event %v, %v", s.Msg(), s.Err())
		}
		ch := make(chan watchEvent, 256)
		go func() {
			defer close(ch)
			for s.Receive() {
				if fe := s.Msg().GetFilesystem(); fe != nil {
					ch <- watchEvent{fe.GetName(), fe.GetType(), fe.GetEntry()}
				}
			}
		}()
		return ch, func() { cancel(); s.Close() }
	}
	rec, stopRec := watch(true, true)
	defer stopRec()
	flat, stopFlat := watch(false, false)
	defer stopFlat()

	// The subdirectory and its file come in one go (the upload creates
	// both): the file's create is reported although it may precede the
	// new directory's watch.
	h.upload(t, "user", dir+"/sub/f.txt", []byte("data"))
	h.upload(t, "user", dir+"/top.txt", []byte("data"))
	if _, err := h.fs.Remove(ctx, as(h, "user", &fspb.RemoveRequest{Path: dir + "/top.txt"})); err != nil {
		t.Fatal(err)
	}

	wait := func(ch <-chan watchEvent, name string, typ fspb.EventType) watchEvent {
		t.Helper()
		deadline := time.After(10 * time.Second)
		for {
			select {
			case ev, ok := <-ch:
				if !ok {
					t.Fatalf("watch ended before %s %v", name, typ)
				}
				if ev.name == name && ev.typ == typ {
					return ev
				}
			case <-deadline:
				t.Fatalf("no %v event for %q", typ, name)
			}
		}
	}
	ev := wait(rec, "sub", fspb.EventType_EVENT_TYPE_CREATE)
	if ev.e.GetType() != fspb.FileType_FILE_TYPE_DIRECTORY {
		t.Errorf("create event entry: %v", ev.e)
	}
	ev = wait(rec, "sub/f.txt", fspb.EventType_EVENT_TYPE_CREATE)
	if ev.e.GetPath() != dir+"/sub/f.txt" {
		t.Errorf("create event entry: %v", ev.e)
	}
	wait(rec, "top.txt", fspb.EventType_EVENT_TYPE_REMOVE)
	// After the directory's create event its watch exists: writes are seen.
	h.upload(t, "user", dir+"/sub/g.txt", []byte("more"))
	wait(rec, "sub/g.txt", fspb.EventType_EVENT_TYPE_WRITE)

	wait(flat, "sub", fspb.EventType_EVENT_TYPE_CREATE)
	for _, ev := range drain(flat, "top.txt", fspb.EventType_EVENT_TYPE_REMOVE) {
		if strings.HasPrefix(ev.name, "sub/") {
			t.Errorf("non-recursive watch saw %q", ev.name)
		}
		if ev.e != nil {
			t.Errorf("entry sent without include_entry")
		}
	}

	_, err := h.fs.WatchDir(ctx, as(h, "user", &fspb.WatchDirRequest{Path: dir + "/nope"}))
	if err == nil {
		s, _ := h.fs.WatchDir(ctx, as(h, "user", &fspb.WatchDirRequest{Path: dir + "/nope"}))
		s.Receive()
		err = s.Err()
	}
	wantCode(t, "watch missing dir", err, connect.CodeNotFound)
}

// drain returns the events received up to and including (name, typ).
func drain(ch <-chan watchEvent, name string, typ fspb.EventType) []watchEvent {
	var out []watchEvent
	deadline := time.After(10 * time.Second)
	for {
		select {
		case ev, ok := <-ch:
			if !ok {
				return out
			}
			out = append(out, ev)
			if ev.name == name && ev.typ == typ {
				return out
			}
		case <-deadline:
			return out
		}
	}
}

func (h *harness) testPollingWatcher(t *testing.T) {
	ctx := ctxT(t)
	dir := h.scratch(t)
	res, err := h.fs.CreateWatcher(ctx, as(h, "user", &fspb.CreateWatcherRequest{Path: dir, IncludeEntry: true}))
	if err != nil {
		t.Fatal(err)
	}
	id := res.Msg.GetWatcherId()
	h.upload(t, "user", dir+"/p.txt", []byte("x"))
	var got []*fspb.FilesystemEvent
	eventually(t, "polled events", func() bool {
		ev, err := h.fs.GetWatcherEvents(ctx, as(h, "user", &fspb.GetWatcherEventsRequest{WatcherId: id}))
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, ev.Msg.GetEvents()...)
		return slices.ContainsFunc(got, func(e *fspb.FilesystemEvent) bool {
			return e.GetName() == "p.txt" && e.GetType() == fspb.EventType_EVENT_TYPE_WRITE
		})
	})
	if _, err := h.fs.RemoveWatcher(ctx, as(h, "user", &fspb.RemoveWatcherRequest{WatcherId: id})); err != nil {
		t.Fatal(err)
	}
	_, err = h.fs.GetWatcherEvents(ctx, as(h, "user", &fspb.GetWatcherEventsRequest{WatcherId: id}))
	wantCode(t, "poll removed watcher", err, connect.CodeNotFound)
	_, err = h.fs.RemoveWatcher(ctx, as(h, "user", &fspb.RemoveWatcherRequest{WatcherId: id}))
	wantCode(t, "remove removed watcher", err, connect.CodeNotFound)
	_, err = h.fs.CreateWatcher(ctx, as(h, "user", &fspb.CreateWatcherRequest{Path: dir + "/p.txt"}))
	wantCode(t, "watch a file", err, connect.CodeInvalidArgument)
	_, err = h.fs.CreateWatcher(ctx, as(h, "user", &fspb.CreateWatcherRequest{Path: h.tg.RootOnly}))
	wantCode(t, "user watches root-only dir", err, connect.CodePermissionDenied)
}
