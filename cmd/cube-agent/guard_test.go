package main

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// TestCappedConsoleStaysBounded: however much the agent logs, the console
// file stays under max plus one line, keeps the newest lines, and says it
// was truncated. The control is the same stream written straight to a
// file, which grows with it.
func TestCappedConsoleStaysBounded(t *testing.T) {
	const limit, keep = 4096, 512
	dir := t.TempDir()
	open := func(name string) *os.File {
		f, err := os.OpenFile(filepath.Join(dir, name), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { f.Close() })
		return f
	}
	// Something was there before the agent (runc or runsc output).
	capped, plain := open("capped"), open("plain")
	if _, err := capped.WriteString("before the agent\n"); err != nil {
		t.Fatal(err)
	}
	c := newCappedConsole(capped, limit, keep)
	var last string
	for i := range 1000 {
		last = fmt.Sprintf("line %04d: a request failed\n", i)
		if _, err := c.Write([]byte(last)); err != nil {
			t.Fatal(err)
		}
		if _, err := plain.WriteString(last); err != nil {
			t.Fatal(err)
		}
		st, err := capped.Stat()
		if err != nil {
			t.Fatal(err)
		}
		if st.Size() > limit {
			t.Fatalf("after line %d the console is %d bytes, over %d", i, st.Size(), limit)
		}
	}
	got, err := os.ReadFile(capped.Name())
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.HasSuffix(got, []byte(last)) {
		t.Errorf("the newest line is gone: ends %q", got[max(0, len(got)-64):])
	}
	if !strings.Contains(string(got), "truncated, the newest") {
		t.Errorf("no truncation marker in %q", got[:min(len(got), 200)])
	}
	if i := bytes.Index(got, []byte("the newest")); i < 0 || len(got)-i < keep {
		t.Errorf("fewer than %d bytes kept after the marker", keep)
	}
	if st, _ := plain.Stat(); st.Size() <= limit {
		t.Fatalf("control: the uncapped file is %d bytes, the stream never passed %d", st.Size(), limit)
	} else {
		t.Logf("capped console %d bytes, uncapped control %d bytes", len(got), st.Size())
	}
}

// TestCappedConsoleWritesThroughPipes: a pipe or a serial console is not
// the agent's to truncate; every byte goes through.
func TestCappedConsoleWritesThroughPipes(t *testing.T) {
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	c := newCappedConsole(w, 8, 4)
	go func() {
		_, _ = c.Write([]byte("0123456789abcdef"))
		w.Close()
	}()
	var buf bytes.Buffer
	if _, err := buf.ReadFrom(r); err != nil {
		t.Fatal(err)
	}
	if buf.String() != "0123456789abcdef" {
		t.Errorf("pipe got %q", buf.String())
	}
}

func TestProtectSelf(t *testing.T) {
	if v, _ := unix.PrctlRetInt(unix.PR_GET_DUMPABLE, 0, 0, 0, 0); v != 1 {
		t.Skipf("the test process is not dumpable to begin with (%d)", v)
	}
	if err := protectSelf(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Prctl(unix.PR_SET_DUMPABLE, 1, 0, 0, 0) })
	if v, err := unix.PrctlRetInt(unix.PR_GET_DUMPABLE, 0, 0, 0, 0); err != nil || v != 0 {
		t.Fatalf("PR_GET_DUMPABLE = %d, %v after protectSelf; want 0", v, err)
	}
}

// TestDetachLetsGoOfTheConsole: after detach the descriptor that was the
// console refers to /dev/null (so /proc/<pid>/fd/N no longer reaches the
// file) and later log lines are dropped. The control is the file before
// detach, which the same descriptor reaches.
func TestDetachLetsGoOfTheConsole(t *testing.T) {
	path := filepath.Join(t.TempDir(), "console")
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	c := newCappedConsole(f, 1<<20, 64)
	fdPath := fmt.Sprintf("/proc/self/fd/%d", f.Fd())
	if got, _ := os.Readlink(fdPath); got != path {
		t.Fatalf("control: %s -> %q, want the console %s", fdPath, got, path)
	}
	if _, err := c.Write([]byte("before\n")); err != nil {
		t.Fatal(err)
	}
	if err := c.detach(int(f.Fd())); err != nil {
		t.Fatal(err)
	}
	if err := c.detach(int(f.Fd())); err != nil {
		t.Fatalf("second detach: %v", err)
	}
	if got, _ := os.Readlink(fdPath); got != os.DevNull {
		t.Errorf("after detach %s -> %q, want %s", fdPath, got, os.DevNull)
	}
	if _, err := c.Write([]byte("after\n")); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if want := "before\ncube-agent: listening; console detached, nothing more is logged here\n"; string(b) != want {
		t.Errorf("console %q, want %q", b, want)
	}
}
