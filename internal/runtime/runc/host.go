package runc

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"
)

// capSysResource is CAP_SYS_RESOURCE's bit in /proc/self/status CapEff.
const capSysResource = 24

// fitRlimits lowers hard limits the host would refuse. Without
// CAP_SYS_RESOURCE (cubelet itself running in a restricted container)
// runc's setrlimit fails for anything above our own hard limit and the
// whole start fails; a lower NOFILE is the better outcome. ocispec.For stays
// pure, so this host-dependent step happens here, at Start.
func fitRlimits(sp *specs.Spec) (lowered bool) {
	if sp.Process == nil || hasCap(capSysResource) {
		return false
	}
	for i, rl := range sp.Process.Rlimits {
		res, ok := rlimitResources[rl.Type]
		if !ok {
			continue
		}
		var cur unix.Rlimit
		if unix.Getrlimit(res, &cur) != nil || cur.Max == unix.RLIM_INFINITY {
			continue
		}
		if rl.Hard > cur.Max {
			sp.Process.Rlimits[i].Hard = cur.Max
			sp.Process.Rlimits[i].Soft = min(rl.Soft, cur.Max)
			lowered = true
		}
	}
	return lowered
}

var rlimitResources = map[string]int{
	"RLIMIT_NOFILE": unix.RLIMIT_NOFILE,
	"RLIMIT_NPROC":  unix.RLIMIT_NPROC,
	"RLIMIT_CORE":   unix.RLIMIT_CORE,
}

func hasCap(bit uint) bool {
	f, err := os.Open("/proc/self/status")
	if err != nil {
		return false
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		v, ok := strings.CutPrefix(sc.Text(), "CapEff:")
		if !ok {
			continue
		}
		mask, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64)
		return err == nil && mask&(1<<bit) != 0
	}
	return false
}

// bindMaskedDirs masks the directories under /sys among spec's masked
// paths with a read-only bind of empty, an empty directory it creates,
// instead of runc's way, an empty read-only tmpfs over each. Every tmpfs
// is a superblock of its own, and the kernel keeps per memory cgroup a
// slot for every memcg-aware shrinker, one per superblock: with a
// sandbox's cgroup and superblocks both growing with the number of
// sandboxes, that memory grows with its square (operating-cubelet.md,
// "Many sandboxes on one node"). A bind makes no superblock. Directories
// under /proc are lateMounts' (runc refuses other mounts inside /proc).
// Which paths are directories is read from the host's /sys, whose
// layout the sandbox's sysfs shares; a path the host lacks stays masked
// the usual way (runc skips what does not exist).
// With need, empty is made even when nothing here binds it (lateMounts
// does).
func bindMaskedDirs(spec *specs.Spec, empty string, need bool) error {
	if spec.Linux == nil {
		return nil
	}
	var binds []specs.Mount
	keep := spec.Linux.MaskedPaths[:0]
	for _, p := range spec.Linux.MaskedPaths {
		if strings.HasPrefix(p, "/sys/") && isDir(p) {
			binds = append(binds, specs.Mount{Destination: p, Type: "bind", Source: empty,
				Options: []string{"bind", "ro", "nosuid", "nodev", "noexec", "rprivate"}})
			continue
		}
		keep = append(keep, p)
	}
	if len(binds) == 0 && !need {
		return nil
	}
	if err := os.MkdirAll(filepath.Dir(empty), 0o700); err != nil {
		return err
	}
	if err := os.Mkdir(empty, 0o555); errors.Is(err, os.ErrExist) {
		// What runc binds into the sandbox must be an empty directory,
		// whatever was left at its path.
		if st, err := os.Lstat(empty); err != nil {
			return err
		} else if !st.IsDir() {
			return fmt.Errorf("%s is not a directory", empty)
		}
		if ents, err := os.ReadDir(empty); err != nil || len(ents) > 0 {
			return errors.Join(err, fmt.Errorf("%s is not empty", empty))
		}
	} else if err != nil {
		return err
	}
	spec.Linux.MaskedPaths = keep
	spec.Mounts = append(spec.Mounts, binds...)
	return nil
}

func isDir(p string) bool {
	st, err := os.Lstat(p)
	return err == nil && st.IsDir()
}
