package cubelet

import "github.com/cubesandbox/cube/internal/nospace"

// noSpace turns a full filesystem in err into an errdefs.ErrNoSpace that
// names it (package nospace). Every flow's error passes through it (the
// engine's WithErrorWrap) and so does a template import's: an action that
// hit ENOSPC, or a runtime that printed it, is reported as the node's full
// data dir (store, templates), pool (disks, snapshots, memory images) or
// run dir (bundles, runtime state) rather than as an internal error. The store names its
// own filesystem.
func (s *Service) noSpace(err error) error {
	// The pool is its own filesystem when it is a loop-mounted image.
	return nospace.Wrap(err, s.cfg.Node.DataDir, s.cfg.PoolDir(), s.cfg.Node.RunDir)
}
