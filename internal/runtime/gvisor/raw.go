package gvisor

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"

	"github.com/cubesandbox/cube/internal/errdefs"
)

// A raw restore is runsc run by hand, with no driver around it: the floor
// a restore through cubelet is compared with (cube-bench's runsc-restore
// baseline). It must be the command line the driver runs, shim included,
// so it is built here rather than copied.

// RawGlobal are runsc's global flags as the driver passes them for a
// sandbox whose bundle is bundle (--network follows its config.json).
func RawGlobal(root, platform, bundle, logFile string) []string {
	args := []string{"--root", root, "--platform=" + platform, "--network=" + networkOf(bundle)}
	if logFile != "" {
		args = append(args, "--log", logFile, "--log-format", "json")
	}
	return args
}

// RawRestore returns the command (binary and argv) that restores the
// memory image in dir as sandbox id on bundle, detached, exactly as the
// driver's Restore runs it: wrapped in the netns shim when the bundle
// joins a network namespace.
func RawRestore(bin, root, platform, bundle, dir, id, logFile string) (string, []string, error) {
	if _, err := os.Stat(filepath.Join(dir, CheckpointFile)); err != nil {
		return "", nil, fmt.Errorf("raw restore %s: no memory image in %s: %w", id, dir, errdefs.ErrNotFound)
	}
	args := append(RawGlobal(root, platform, bundle, logFile),
		"restore", "--image-path", dir, "--detach", "--bundle", bundle, RunscID(id))
	if networkOf(bundle) != "sandbox" {
		return bin, args, nil
	}
	return "unshare", append([]string{"--mount", "--propagation", "private", "/bin/sh", "-c", netnsShim, bin}, args...), nil
}

// RawWake is the argv (after RawGlobal) that wakes a quiesced agent of a
// restored sandbox, as cubelet does after every restore.
func RawWake(id string) []string {
	return []string{"kill", RunscID(id), strconv.Itoa(int(WakeSignal))}
}

// RunscID is the ID runsc knows sandbox id by (see runscID).
func RunscID(id string) string { return runscID(id) }

// RawGiveBackNet puts the addresses and routes runsc took from the
// network namespace of bundle's sandbox back, as the driver's Stop does
// after `runsc delete`: a bare restore needs the namespace as
// network-agent handed it over.
func RawGiveBackNet(bundle string) error {
	sp, err := readSpec(bundle)
	if err != nil {
		return err
	}
	return restoreNet(sp, bundle)
}
