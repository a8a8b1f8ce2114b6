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
	return RawRestoreAs(bin, root, platform, bundle, dir, RunscID(id), logFile)
}

// RawRestoreAs is RawRestore under runsc ID rid (RunscSlots).
func RawRestoreAs(bin, root, platform, bundle, dir, rid, logFile string) (string, []string, error) {
	if _, err := os.Stat(filepath.Join(dir, CheckpointFile)); err != nil {
		return "", nil, fmt.Errorf("raw restore %s: no memory image in %s: %w", rid, dir, errdefs.ErrNotFound)
	}
	args := append(RawGlobal(root, platform, bundle, logFile),
		"restore", "--image-path", dir, "--detach", "--bundle", bundle, rid)
	if networkOf(bundle) != "sandbox" {
		return bin, args, nil
	}
	return "unshare", append([]string{"--mount", "--propagation", "private", "/bin/sh", "-c", netnsShim, bin}, args...), nil
}

// RawWake is the argv (after RawGlobal) that wakes a quiesced agent of a
// restored sandbox, as cubelet does after every restore.
func RawWake(id string) []string { return RawWakeAs(RunscID(id)) }

// RawWakeAs is RawWake for the sandbox under runsc ID rid.
func RawWakeAs(rid string) []string {
	return []string{"kill", rid, strconv.Itoa(int(WakeSignal))}
}

// RawCheckpoint is the argv (after RawGlobal) of a bare `runsc checkpoint`
// of the sandbox under runsc ID rid into dir.
func RawCheckpoint(rid, dir string) []string {
	return []string{"checkpoint", "--image-path", dir, rid}
}

// RunscID is the ID runsc knows a freshly started sandbox id by (its slot
// A, see runscID).
func RunscID(id string) string { return runscID(id) }

// RunscSlots are the two runsc IDs sandbox id may run under (slots.go): a
// bare restore next to a checkpointed sandbox uses the second.
func RunscSlots(id string) [2]string { return slotIDs(id) }

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

// RawKillCheckpointed sends SIGKILL once to every process in the cgroup of
// bundle's sandbox, as the driver does right after a checkpoint: the
// checkpointed sandbox process does not exit by itself for a long time,
// and its netstack, still attached to the slot's interface, answered the
// restored copy's connections with resets (its listener was closed).
func RawKillCheckpointed(bundle string) error {
	sp, err := readSpec(bundle)
	if err != nil {
		return err
	}
	if sp.Linux != nil && sp.Linux.CgroupsPath != "" {
		killOnce(sp.Linux.CgroupsPath)
	}
	return nil
}

// RawSaveNet records the addresses and routes of bundle's network
// namespace in the bundle, as the driver does before every launch, so
// that RawGiveBackNet can put them back after runsc took them.
func RawSaveNet(bundle string) error {
	sp, err := readSpec(bundle)
	if err != nil {
		return err
	}
	return saveNet(sp, bundle)
}
