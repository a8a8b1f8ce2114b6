package inotify

import (
	"os"
	"path/filepath"
	"testing"
	"time"
)

func next(t *testing.T, w *Watcher, path string, op Op) {
	t.Helper()
	deadline := time.After(5 * time.Second)
	for {
		select {
		case ev, ok := <-w.C:
			if !ok {
				t.Fatalf("closed waiting for %s %s (err %v)", op, path, w.Err())
			}
			if ev.Path == path && ev.Op == op {
				return
			}
		case <-deadline:
			t.Fatalf("no %s event for %s", op, path)
		}
	}
}

func TestRecursiveWatch(t *testing.T) {
	root := t.TempDir()
	if err := os.MkdirAll(filepath.Join(root, "old/deep"), 0o755); err != nil {
		t.Fatal(err)
	}
	w, err := New(root, true, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()

	// Existing subdirectories are watched from the start.
	f := filepath.Join(root, "old/deep/a")
	if err := os.WriteFile(f, []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	next(t, w, f, Create)
	next(t, w, f, Write)
	// New ones as soon as they appear, with what they already hold:
	// mkdir -p races the watch on "new", yet "new/sub/x" is reported.
	if err := os.MkdirAll(filepath.Join(root, "new/sub"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(root, "new/sub/x"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	next(t, w, filepath.Join(root, "new"), Create)
	next(t, w, filepath.Join(root, "new/sub/x"), Create)
	g := filepath.Join(root, "new/sub/b")
	if err := os.WriteFile(g, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	next(t, w, g, Create)
	if err := os.Chmod(g, 0o600); err != nil {
		t.Fatal(err)
	}
	next(t, w, g, Chmod)
	if err := os.Rename(g, g+".moved"); err != nil {
		t.Fatal(err)
	}
	next(t, w, g, Rename)
	next(t, w, g+".moved", Create)
	if err := os.Remove(g + ".moved"); err != nil {
		t.Fatal(err)
	}
	next(t, w, g+".moved", Remove)

	// Removing the root ends the watch cleanly.
	if err := os.RemoveAll(root); err != nil {
		t.Fatal(err)
	}
	deadline := time.After(5 * time.Second)
	for open := true; open; {
		select {
		case _, open = <-w.C:
		case <-deadline:
			t.Fatal("watch did not end when its root was removed")
		}
	}
	if err := w.Err(); err != nil {
		t.Fatalf("Err after root removal: %v", err)
	}
}

func TestFlatWatchAndCloseWhileBlocked(t *testing.T) {
	root := t.TempDir()
	if err := os.Mkdir(filepath.Join(root, "sub"), 0o755); err != nil {
		t.Fatal(err)
	}
	w, err := New(root, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(root, "sub/x"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	top := filepath.Join(root, "top")
	if err := os.WriteFile(top, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	select {
	case ev := <-w.C:
		if ev.Path != top {
			t.Fatalf("non-recursive watch reported %v", ev)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("no event")
	}
	// Nobody reads any more: many events pile up; Close must not hang.
	for i := range 1000 {
		_ = os.WriteFile(filepath.Join(root, "f"+string(rune('a'+i%26))), nil, 0o644)
	}
	done := make(chan struct{})
	go func() { w.Close(); _ = w.Err(); close(done) }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("Close hung with unread events")
	}
	if _, err := New(filepath.Join(root, "top"), false, nil); err == nil {
		t.Fatal("watching a file succeeded")
	}
	if _, err := New(filepath.Join(root, "missing"), true, nil); err == nil {
		t.Fatal("watching a missing dir succeeded")
	}
}
