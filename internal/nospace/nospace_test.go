package nospace_test

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/nospace"
	"github.com/cubesandbox/cube/internal/nospace/nospacetest"
)

// TestWrapNamesTheFullFilesystem: a write on a full filesystem, from this
// process or from a child that prints strerror, comes back as ErrNoSpace
// naming that filesystem's mount point; the same write after the space
// returns succeeds (the control that the write itself was sound).
func TestWrapNamesTheFullFilesystem(t *testing.T) {
	for _, fstype := range []string{"ext4", "tmpfs", "xfs"} {
		t.Run(fstype, func(t *testing.T) {
			size := 16
			if fstype == "xfs" {
				size = 300
			}
			mnt := nospacetest.Mount(t, fstype, size)
			other := t.TempDir()
			free := nospacetest.Fill(t, mnt)
			target := filepath.Join(mnt, "sub", "file")

			err := os.MkdirAll(filepath.Dir(target), 0o755)
			if err == nil {
				err = os.WriteFile(target, make([]byte, 1<<20), 0o600)
			}
			got := nospace.Wrap(err, other)
			t.Logf("in-process: %v", got)
			if !errdefs.IsNoSpace(got) || !errdefs.IsResourceExhausted(got) || !strings.Contains(got.Error(), mnt+" ("+fstype+")") {
				t.Fatalf("in-process write on full %s: %v", fstype, got)
			}
			var ne *nospace.Error
			if !errors.As(got, &ne) || len(ne.FS) != 1 || ne.FS[0].Mount != mnt {
				t.Fatalf("filesystems named: %+v", ne)
			}
			if again := nospace.Wrap(fmt.Errorf("flow: %w", got)); !errors.As(again, &ne) || strings.Count(again.Error(), "filesystem full") != 1 {
				t.Fatalf("wrapped twice: %v", again)
			}

			out, cerr := exec.Command("sh", "-c", "head -c 1048576 /dev/zero > "+filepath.Join(mnt, "child")).CombinedOutput()
			child := nospace.Wrap(fmt.Errorf("sh: %w: %s", cerr, out), other, mnt)
			t.Logf("child: %v", child)
			if !errors.As(child, &ne) || len(ne.FS) != 1 || ne.FS[0].Mount != mnt {
				t.Fatalf("child's write on full %s: %v", fstype, child)
			}

			free()
			if err := os.MkdirAll(filepath.Dir(target), 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(target, make([]byte, 1<<20), 0o600); err != nil {
				t.Fatalf("after freeing space: %v", err)
			}
		})
	}
}

// TestWrapLeavesOtherErrors: errors that are not a full disk pass unchanged.
func TestWrapLeavesOtherErrors(t *testing.T) {
	_, err := os.ReadFile(filepath.Join(t.TempDir(), "absent"))
	if got := nospace.Wrap(err, t.TempDir()); got != err || errdefs.IsNoSpace(got) {
		t.Fatalf("ENOENT became %v", got)
	}
	if nospace.Wrap(nil) != nil {
		t.Fatal("nil")
	}
}
