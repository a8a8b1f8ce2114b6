package actions

import (
	"fmt"
	"path/filepath"

	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/nospace"
	"github.com/cubesandbox/cube/internal/runtime/cgroups"
	"github.com/cubesandbox/cube/internal/sandbox"
)

// imageMargin is room a memory image may need beyond the memory the
// sandbox uses (runtime and device state, file metadata).
const imageMargin = 64 << 20

// checkImageRoom refuses, before the runtime is touched, a memory image
// that the filesystem holding dir has no room for. A checkpoint that runs
// out of space part way cannot be undone: runsc has stopped the sandbox
// and the partial image cannot restore it, so the sandbox would be lost.
// The image is at most what the sandbox's cgroup holds (its memory, page
// cache included) plus imageMargin; a sandbox whose use cannot be read is
// let through (the runtime's own error then reports a full disk).
func (n *Node) checkImageRoom(rec *sandbox.Record, dir string) error {
	cg := n.Cfg.CgroupPath(rec.HostKey())
	if rec.Container != nil && rec.Container.CgroupPath != "" {
		cg = rec.Container.CgroupPath
	}
	used, _ := cgroups.MemoryUsage(cg) // unreadable: 0, let through
	if used == 0 {
		return nil
	}
	need := uint64(used) + imageMargin
	var st unix.Statfs_t
	p := dir
	for unix.Statfs(p, &st) != nil {
		if parent := filepath.Dir(p); parent != p {
			p = parent
			continue
		}
		return nil
	}
	free := st.Bavail * uint64(st.Bsize)
	if free >= need {
		return nil
	}
	return nospace.Wrap(fmt.Errorf("memory image of %s needs up to %d MiB (its memory in use and %d MiB), %d MiB free under %s: %w",
		rec.ID, need>>20, imageMargin>>20, free>>20, dir, errdefs.ErrNoSpace), dir)
}
