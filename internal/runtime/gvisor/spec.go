package gvisor

import (
	"slices"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/cubesandbox/cube/internal/agentproto"
	"github.com/cubesandbox/cube/internal/runtime"
	"github.com/cubesandbox/cube/internal/runtime/ocispec"
)

// unsupportedMounts are mounts of ocispec's default spec that gVisor's
// sentry provides itself or cannot mount from the spec: a cgroupfs
// mount of the host hierarchy makes no sense behind the user-space kernel.
var unsupportedMounts = []string{"/sys/fs/cgroup"}

const capSysAdmin = "CAP_SYS_ADMIN"

// SpecFor is ocispec.For adjusted for runsc. It is pure, like ocispec.For.
//
// Resources: runsc (this version) applies linux.resources (CPU quota,
// memory limit, pids) to the cgroup named by linux.cgroupsPath, in which
// it puts the sandbox and gofer processes; the limits therefore bound the
// whole sandbox, sentry included. Rlimits are applied by the sentry.
func SpecFor(s runtime.Spec) (*specs.Spec, error) {
	sp, err := ocispec.For(s)
	if err != nil {
		return nil, err
	}
	sp.Mounts = slices.DeleteFunc(sp.Mounts, func(m specs.Mount) bool {
		return slices.Contains(unsupportedMounts, m.Destination)
	})
	// No OCI seccomp filter: runsc ignores it unless started with
	// --oci-seccomp, and the boundary here is the sentry, which runs
	// under runsc's own host-side filter and implements the sandbox's
	// syscalls itself (keyctl, bpf, userfaultfd, perf_event_open, mount
	// and the others the runc filter refuses never reach the host
	// kernel). Applied inside the sentry it would also refuse the
	// agent's sethostname after a restore (reinit). Dropping it keeps
	// config.json saying what actually applies.
	sp.Linux.Seccomp = nil
	// cube-agent (PID 1) sets a restored clone's hostname, which needs
	// CAP_SYS_ADMIN in the sandbox's UTS namespace. It is granted to PID 1
	// only: the agent drops it from its bounding set at start
	// (agent.DropSysAdminBound), so nothing it starts ever has it. Inside
	// gVisor it reaches the sentry, never the host kernel.
	if c := sp.Process.Capabilities; c != nil {
		c.Bounding = append(c.Bounding, capSysAdmin)
		c.Effective = append(c.Effective, capSysAdmin)
		c.Permitted = append(c.Permitted, capSysAdmin)
		sp.Process.Env = append(sp.Process.Env, agentproto.DropSysAdminEnv+"=1")
	}
	// The sentry does not apply dumpability to /proc/<pid>/fd: the agent
	// lets go of the console (a file on the host) once it serves, so
	// nothing in the sandbox can reach that file (docs/security.md).
	sp.Process.Env = append(sp.Process.Env, agentproto.DetachConsoleEnv+"=1")
	return sp, nil
}
