package serve_test

import (
	"net"
	"path/filepath"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/serve"
)

// TestUnixSocketPublishedListening: the socket's name appears only once
// it accepts connections (renamed into place after listen), so a client
// that waits for the file and dials at once is never refused. The
// control binds the same way net.Listen does: the name is created by the
// bind, before listen(2), the window in which a dial is refused.
func TestUnixSocketPublishedListening(t *testing.T) {
	dir := t.TempDir()
	fd, err := unix.InotifyInit1(unix.IN_CLOEXEC | unix.IN_NONBLOCK)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	if _, err := unix.InotifyAddWatch(fd, dir, unix.IN_CREATE|unix.IN_MOVED_TO); err != nil {
		t.Fatal(err)
	}

	// Control: a plain bind creates the name itself.
	raw, err := net.Listen("unix", filepath.Join(dir, "raw.sock"))
	if err != nil {
		t.Fatal(err)
	}
	raw.Close()
	if got := inotifyEvents(t, fd)["raw.sock"]; got&unix.IN_CREATE == 0 {
		t.Fatalf("control: a plain bind gave raw.sock events %#x, want IN_CREATE", got)
	}

	g := &serve.Group{}
	t.Cleanup(g.Close)
	sock := filepath.Join(dir, "api.sock")
	l, err := g.Unix(sock)
	if err != nil {
		t.Fatal(err)
	}
	got := inotifyEvents(t, fd)["api.sock"]
	if got&unix.IN_CREATE != 0 || got&unix.IN_MOVED_TO == 0 {
		t.Fatalf("api.sock events %#x: want it moved into place (IN_MOVED_TO), never created unlistening (IN_CREATE)", got)
	}
	if l.Addr().String() != sock {
		t.Errorf("listener address %q, want %q", l.Addr(), sock)
	}
	c, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatalf("dial the published socket: %v", err)
	}
	c.Close()
	if m, _ := filepath.Glob(filepath.Join(dir, "*.new")); len(m) != 0 {
		t.Errorf("temporary names left: %v", m)
	}
	l.Close()
	g.Close()
	if m, _ := filepath.Glob(filepath.Join(dir, "api.sock*")); len(m) != 0 {
		t.Errorf("after Close: %v left", m)
	}
}

// inotifyEvents reads the queued events of fd: name -> OR of their masks.
func inotifyEvents(t *testing.T, fd int) map[string]uint32 {
	t.Helper()
	out := map[string]uint32{}
	buf := make([]byte, 64<<10)
	n, err := unix.Read(fd, buf)
	if err != nil {
		t.Fatalf("read inotify: %v", err)
	}
	for off := 0; off+unix.SizeofInotifyEvent <= n; {
		ev := (*unix.InotifyEvent)(unsafe.Pointer(&buf[off]))
		name := buf[off+unix.SizeofInotifyEvent : off+unix.SizeofInotifyEvent+int(ev.Len)]
		for len(name) > 0 && name[len(name)-1] == 0 {
			name = name[:len(name)-1]
		}
		out[string(name)] |= ev.Mask
		off += unix.SizeofInotifyEvent + int(ev.Len)
	}
	return out
}
