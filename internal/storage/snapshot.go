package storage

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/errdefs"
)

// SnapshotsDir holds one directory per snapshot.
func (p *Pool) SnapshotsDir() string { return filepath.Join(p.dir, "snapshots") }

// SnapshotDir holds every file of one snapshot.
func (p *Pool) SnapshotDir(snapshotID string) string {
	return filepath.Join(p.SnapshotsDir(), snapshotID)
}

// SnapshotDiskPath is the snapshot's disk image, a clone of the sandbox
// disk taken while the sandbox was frozen.
func (p *Pool) SnapshotDiskPath(snapshotID string) string {
	return filepath.Join(p.SnapshotDir(snapshotID), "disk.img")
}

// SnapshotMemoryDir is where a runtime that can checkpoint writes the
// snapshot's memory image.
func (p *Pool) SnapshotMemoryDir(snapshotID string) string {
	return filepath.Join(p.SnapshotDir(snapshotID), "memory")
}

// RemoveSnapshot deletes a snapshot's directory; removing what is not
// there is not an error.
func (p *Pool) RemoveSnapshot(snapshotID string) error {
	if err := ValidateID(snapshotID); err != nil {
		return err
	}
	if err := os.RemoveAll(p.SnapshotDir(snapshotID)); err != nil {
		return fmt.Errorf("storage: remove snapshot %s: %w", snapshotID, err)
	}
	return nil
}

// Exchange atomically swaps the files at a and b (renameat2
// RENAME_EXCHANGE): at every instant each name holds a complete file, so
// a crash mid-rollback never leaves a sandbox without a disk.
func Exchange(a, b string) error {
	if err := unix.Renameat2(unix.AT_FDCWD, a, unix.AT_FDCWD, b, unix.RENAME_EXCHANGE); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return fmt.Errorf("storage: exchange %s and %s: %w", a, b, errdefs.ErrNotFound)
		}
		return fmt.Errorf("storage: exchange %s and %s: %w", a, b, err)
	}
	return nil
}

// Syncfs flushes the whole filesystem mounted at path (syncfs(2)), so a
// clone of its loop image taken afterwards holds every write made so far.
func Syncfs(path string) error {
	f, err := os.Open(path)
	if err != nil {
		return fmt.Errorf("storage: syncfs: %w", err)
	}
	defer f.Close()
	if err := unix.Syncfs(int(f.Fd())); err != nil {
		return fmt.Errorf("storage: syncfs %s: %w", path, err)
	}
	return nil
}
