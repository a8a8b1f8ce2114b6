package gvisor

import (
	"slices"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/cubesandbox/cube/internal/runtime"
	"github.com/cubesandbox/cube/internal/runtime/runc"
)

// unsupportedMounts are mounts of runc's default spec that gVisor's
// sentry provides itself or cannot mount from the spec: a cgroupfs
// mount of the host hierarchy makes no sense behind the user-space kernel.
var unsupportedMounts = []string{"/sys/fs/cgroup"}

// SpecFor is runc.SpecFor adjusted for runsc. It is pure, like runc's.
//
// Resources: runsc (this version) applies linux.resources (CPU quota,
// memory limit, pids) to the cgroup named by linux.cgroupsPath, in which
// it puts the sandbox and gofer processes; the limits therefore bound the
// whole sandbox, sentry included. Rlimits are applied by the sentry.
func SpecFor(s runtime.Spec) (*specs.Spec, error) {
	sp, err := runc.SpecFor(s)
	if err != nil {
		return nil, err
	}
	sp.Mounts = slices.DeleteFunc(sp.Mounts, func(m specs.Mount) bool {
		return slices.Contains(unsupportedMounts, m.Destination)
	})
	return sp, nil
}
