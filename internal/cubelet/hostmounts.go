package cubelet

import (
	"fmt"

	"github.com/cubesandbox/cube/internal/cubelet/actions"
	"github.com/cubesandbox/cube/internal/cubelet/config"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/sandbox"
)

// maxHostMounts bounds one sandbox's binds.
const maxHostMounts = 16

// checkHostMounts validates a create request's host mounts against
// storage.host_mount_allow and returns them with every source resolved
// (symlinks followed), which is what the record keeps and what is bound.
//
// A source is allowed when its resolved path lies under the resolved
// prefix of an allow rule, so a symlink inside an allowed directory that
// points elsewhere is refused. The most specific (longest) matching rule
// decides whether read-write is allowed. cubelet's own data and run
// directories are never allowed, whatever the rules say.
func checkHostMounts(cfg *config.Config, ms []sandbox.HostMount) ([]sandbox.HostMount, error) {
	if len(ms) == 0 {
		return nil, nil
	}
	if len(ms) > maxHostMounts {
		return nil, errdefs.FieldErrorf("host_mounts", "%d mounts, at most %d", len(ms), maxHostMounts)
	}
	if len(cfg.Storage.HostMountAllow) == 0 {
		return nil, errdefs.FieldErrorf("host_mounts", "host mounts are not allowed on this node (storage.host_mount_allow is empty)")
	}
	out := make([]sandbox.HostMount, 0, len(ms))
	dests := map[string]bool{}
	for i, m := range ms {
		field := fmt.Sprintf("host_mounts[%d]", i)
		if err := actions.CheckDestination(m.Destination); err != nil {
			return nil, &errdefs.FieldError{Field: field + ".destination", Msg: err.Error()}
		}
		if dests[m.Destination] {
			return nil, errdefs.FieldErrorf(field+".destination", "%q is bound twice", m.Destination)
		}
		dests[m.Destination] = true
		src, err := actions.AllowedSource(cfg, m.Source, m.ReadOnly)
		if err != nil {
			return nil, &errdefs.FieldError{Field: field + ".source", Msg: err.Error()}
		}
		out = append(out, sandbox.HostMount{Source: src, Destination: m.Destination, ReadOnly: m.ReadOnly})
	}
	return out, nil
}
