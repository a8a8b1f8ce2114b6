package agent

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestWriteResolvConf(t *testing.T) {
	dir := t.TempDir()
	etc := filepath.Join(dir, "etc")
	if err := os.MkdirAll(etc, 0o755); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(etc, "resolv.conf")
	// What base images ship: a symlink into /run (systemd-resolved).
	if err := os.Symlink("../run/systemd/resolve/stub-resolv.conf", path); err != nil {
		t.Fatal(err)
	}
	if err := WriteResolvConf(path, "169.254.0.22"); err != nil {
		t.Fatal(err)
	}
	fi, err := os.Lstat(path)
	if err != nil || !fi.Mode().IsRegular() {
		t.Fatalf("resolv.conf is not a regular file: %v %v", fi, err)
	}
	b, _ := os.ReadFile(path)
	if want := "nameserver 169.254.0.22\n"; !containsLine(string(b), want) {
		t.Fatalf("resolv.conf = %q, want a line %q", b, want)
	}
	if err := WriteResolvConf(path, "not-an-ip"); err == nil {
		t.Fatal("a bad nameserver was written")
	}
	if entries, _ := os.ReadDir(etc); len(entries) != 1 {
		t.Fatalf("temporary files left: %v", entries)
	}
}

func containsLine(s, line string) bool { return strings.Contains("\n"+s, "\n"+line) }
