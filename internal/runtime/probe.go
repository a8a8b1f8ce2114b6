package runtime

import (
	"fmt"
	"os"
	"syscall"
)

// ProbeFiles is the usual Prober body: every binary is a regular file
// with an execute bit, and root is a directory this process may write
// (access(2) with W_OK fails with EROFS on a read-only filesystem).
func ProbeFiles(root string, binaries ...string) error {
	for _, b := range binaries {
		fi, err := os.Stat(b)
		if err != nil {
			return fmt.Errorf("binary: %w", err)
		}
		if !fi.Mode().IsRegular() || fi.Mode().Perm()&0o111 == 0 {
			return fmt.Errorf("binary %s: not an executable file (%s)", b, fi.Mode())
		}
	}
	fi, err := os.Stat(root)
	if err != nil {
		return fmt.Errorf("state directory: %w", err)
	}
	if !fi.IsDir() {
		return fmt.Errorf("state directory %s: not a directory", root)
	}
	if err := syscall.Access(root, 2 /* W_OK */); err != nil {
		return fmt.Errorf("state directory %s: not writable: %w", root, err)
	}
	return nil
}
