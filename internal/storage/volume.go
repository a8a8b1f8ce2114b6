package storage

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"github.com/cubesandbox/cube/internal/errdefs"
)

// Volumes live in the pool beside template images and sandbox disks:
//
//	Dir/volumes/<volumeID>/volume.img   ext4 image, its size the volume's capacity
//
// A volume outlives the sandboxes that mount it; the image's size is the
// limit a sandbox meets (ENOSPC) when it writes past the capacity.

// MinVolumeMiB is the smallest volume image: below it mkfs.ext4's own
// metadata leaves next to nothing for files.
const MinVolumeMiB = 4

// VolumeImagePath is where volume volumeID's image lives.
func (p *Pool) VolumeImagePath(volumeID string) string {
	return filepath.Join(p.dir, "volumes", volumeID, "volume.img")
}

// CreateVolumeImage makes volume volumeID's image of sizeMiB (an empty
// ext4 filesystem whose root directory anyone may write, sticky like
// /tmp, since the sandbox's user is not root). It reports whether it made
// it: an image already there is kept as it is (a volume made by an
// earlier mount). A failure leaves no file behind.
func (p *Pool) CreateVolumeImage(ctx context.Context, volumeID string, sizeMiB int64) (created bool, err error) {
	if err := ValidateID(volumeID); err != nil {
		return false, err
	}
	img := p.VolumeImagePath(volumeID)
	if _, err := os.Stat(img); err == nil {
		return false, nil
	} else if !errors.Is(err, os.ErrNotExist) {
		return false, fmt.Errorf("storage: volume %s: %w", volumeID, err)
	}
	if sizeMiB < MinVolumeMiB {
		return false, fmt.Errorf("storage: volume %s: size %d MiB is below the minimum %d MiB: %w", volumeID, sizeMiB, MinVolumeMiB, errdefs.ErrInvalidArgument)
	}
	dir := filepath.Dir(img)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return false, fmt.Errorf("storage: volume %s: %w", volumeID, err)
	}
	// Formatted under a temporary name and renamed, so an image that
	// exists is always a complete filesystem.
	tmp := img + ".tmp"
	_ = os.Remove(tmp)
	defer func() {
		if err != nil {
			_ = os.Remove(tmp)
			_ = os.Remove(dir) // only when empty: an earlier image stays
		}
	}()
	f, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return false, fmt.Errorf("storage: volume %s: %w", volumeID, err)
	}
	err = f.Truncate(sizeMiB << 20)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return false, fmt.Errorf("storage: volume %s: %w", volumeID, err)
	}
	out, err := exec.CommandContext(ctx, "mkfs.ext4", "-q", "-F", "-L", "cube-volume",
		"-m", "0", "-E", "root_owner=0:0", tmp).CombinedOutput()
	if err != nil {
		return false, fmt.Errorf("storage: volume %s: mkfs.ext4: %w: %s", volumeID, err, strings.TrimSpace(string(out)))
	}
	if err := os.Rename(tmp, img); err != nil {
		return false, fmt.Errorf("storage: volume %s: %w", volumeID, err)
	}
	return true, nil
}

// RemoveVolumeImage deletes volume volumeID's image; it reports whether
// there was one. The caller makes sure nothing has it mounted.
func (p *Pool) RemoveVolumeImage(volumeID string) (existed bool, err error) {
	if err := ValidateID(volumeID); err != nil {
		return false, err
	}
	dir := filepath.Dir(p.VolumeImagePath(volumeID))
	if _, err := os.Stat(dir); errors.Is(err, os.ErrNotExist) {
		return false, nil
	}
	if err := os.RemoveAll(dir); err != nil {
		return true, fmt.Errorf("storage: remove volume %s: %w", volumeID, err)
	}
	return true, nil
}
