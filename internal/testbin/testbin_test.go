package testbin

import (
	"os"
	"path/filepath"
	"strconv"
	"testing"
)

// The directories of dead processes go; a live process's stays, and so
// does anything not named for a process.
func TestSweep(t *testing.T) {
	base := t.TempDir()
	// PIDs above pid_max (at most 2^22) never exist.
	dead := filepath.Join(base, "99999999-abc")
	live := filepath.Join(base, strconv.Itoa(os.Getpid())+"-abc")
	other := filepath.Join(base, "notes")
	for _, d := range []string{dead, live, other} {
		if err := os.MkdirAll(filepath.Join(d, "failpoints"), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	sweep(base)
	if _, err := os.Stat(dead); !os.IsNotExist(err) {
		t.Errorf("dead process's dir still there: %v", err)
	}
	for _, d := range []string{live, other} {
		if _, err := os.Stat(d); err != nil {
			t.Errorf("%s removed: %v", d, err)
		}
	}
}
