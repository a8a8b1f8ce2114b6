package serve_test

import (
	"net"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/serve"
)

// TestAccepting: a socket bound but not yet listening (the moment inside
// net.Listen a daemon's start can be caught in) has its file, yet refuses
// a dial; Accepting says false for it and true once it listens.
func TestAccepting(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "api.sock")
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	if err := unix.Bind(fd, &unix.SockaddrUnix{Name: path}); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(path); err != nil {
		t.Fatalf("bound socket has no file: %v", err)
	}
	if serve.Accepting(path) {
		t.Fatal("Accepting says true for a socket bound but not listening")
	}
	if err := unix.Listen(fd, 8); err != nil {
		t.Fatal(err)
	}
	if !serve.Accepting(path) {
		t.Fatal("Accepting says false for a listening socket")
	}
	if serve.Accepting(filepath.Join(dir, "missing.sock")) {
		t.Fatal("Accepting says true for no socket")
	}
	l, err := net.Listen("unix", filepath.Join(dir, "b.sock"))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if !serve.Accepting(filepath.Join(dir, "b.sock")) {
		t.Fatal("Accepting says false for net.Listen's socket")
	}
}
