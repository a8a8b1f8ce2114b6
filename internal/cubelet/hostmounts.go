package cubelet

import (
	"errors"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"strings"

	"github.com/cubesandbox/cube/internal/cubelet/config"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/runtime"
	"github.com/cubesandbox/cube/internal/sandbox"
)

// maxHostMounts bounds one sandbox's binds.
const maxHostMounts = 16

// Destinations a bind may not cover: the runtime mounts its own
// filesystems there, and shadowing them would break or unconfine the
// sandbox.
var reservedDestinations = []string{"/proc", "/sys", "/dev"}

// checkHostMounts validates a create request's host mounts against
// storage.host_mount_allow and returns them with every source resolved
// (symlinks followed), which is what the record keeps and what is bound.
//
// A source is allowed when its resolved path lies under the resolved
// prefix of an allow rule, so a symlink inside an allowed directory that
// points elsewhere is refused. The most specific (longest) matching rule
// decides whether read-write is allowed. cubelet's own data and run
// directories are never allowed, whatever the rules say.
func (n *node) checkHostMounts(ms []sandbox.HostMount) ([]sandbox.HostMount, error) {
	if len(ms) == 0 {
		return nil, nil
	}
	if len(ms) > maxHostMounts {
		return nil, fieldErr("host_mounts", "%d mounts, at most %d", len(ms), maxHostMounts)
	}
	if len(n.cfg.Storage.HostMountAllow) == 0 {
		return nil, fieldErr("host_mounts", "host mounts are not allowed on this node (storage.host_mount_allow is empty)")
	}
	out := make([]sandbox.HostMount, 0, len(ms))
	dests := map[string]bool{}
	for i, m := range ms {
		field := fmt.Sprintf("host_mounts[%d]", i)
		if err := checkDestination(m.Destination); err != nil {
			return nil, &FieldError{Field: field + ".destination", Msg: err.Error()}
		}
		if dests[m.Destination] {
			return nil, fieldErr(field+".destination", "%q is bound twice", m.Destination)
		}
		dests[m.Destination] = true
		src, err := n.allowedSource(m.Source, m.ReadOnly)
		if err != nil {
			return nil, &FieldError{Field: field + ".source", Msg: err.Error()}
		}
		out = append(out, sandbox.HostMount{Source: src, Destination: m.Destination, ReadOnly: m.ReadOnly})
	}
	return out, nil
}

func checkDestination(dst string) error {
	switch {
	case dst == "":
		return errors.New("required")
	case !path.IsAbs(dst) || path.Clean(dst) != dst:
		return fmt.Errorf("%q must be a clean absolute path", dst)
	case dst == "/":
		return errors.New("cannot bind over the sandbox's root")
	}
	for _, r := range reservedDestinations {
		if dst == r || strings.HasPrefix(dst, r+"/") {
			return fmt.Errorf("%q is inside %s, which the runtime owns", dst, r)
		}
	}
	return nil
}

// allowedSource resolves src and returns it if an allow rule permits it
// (with the requested access).
func (n *node) allowedSource(src string, readOnly bool) (string, error) {
	if src == "" {
		return "", errors.New("required")
	}
	if !filepath.IsAbs(src) {
		return "", fmt.Errorf("%q must be an absolute path", src)
	}
	real, err := filepath.EvalSymlinks(src)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return "", fmt.Errorf("%q does not exist on this node", src)
		}
		return "", fmt.Errorf("%q: %v", src, err)
	}
	st, err := os.Stat(real)
	if err != nil {
		return "", fmt.Errorf("%q: %v", src, err)
	}
	if !st.IsDir() && !st.Mode().IsRegular() {
		return "", fmt.Errorf("%q is neither a directory nor a regular file", src)
	}
	for _, own := range []string{n.cfg.Node.DataDir, n.cfg.Node.RunDir} {
		if o := resolve(own); within(real, o) || within(o, real) {
			return "", fmt.Errorf("%q overlaps cubelet's own directory %s", src, own)
		}
	}
	var best *config.HostMountRule
	bestLen := -1
	for i := range n.cfg.Storage.HostMountAllow {
		r := &n.cfg.Storage.HostMountAllow[i]
		p := resolve(r.Prefix)
		if within(real, p) && len(p) > bestLen {
			best, bestLen = r, len(p)
		}
	}
	resolved := ""
	if real != src {
		resolved = fmt.Sprintf(" (resolves to %s)", real)
	}
	switch {
	case best == nil:
		return "", fmt.Errorf("%q%s is not under any prefix in storage.host_mount_allow", src, resolved)
	case best.ReadOnly && !readOnly:
		return "", fmt.Errorf("%q%s may only be bound read-only (storage.host_mount_allow %s is read_only)", src, resolved, best.Prefix)
	}
	return real, nil
}

// hostMountsFor turns a record's host mounts into runtime mounts,
// re-checking each source right before the bind: if a path component was
// replaced by a symlink since create, the source no longer resolves to
// itself and the start is refused.
func (n *node) hostMountsFor(ms []sandbox.HostMount) ([]runtime.Mount, error) {
	var out []runtime.Mount
	for _, m := range ms {
		real, err := n.allowedSource(m.Source, m.ReadOnly)
		if err != nil {
			return nil, fmt.Errorf("host mount %s: %v: %w", m.Destination, err, errdefs.ErrFailedPrecondition)
		}
		if real != m.Source {
			return nil, fmt.Errorf("host mount %s: source %s now resolves to %s: %w", m.Destination, m.Source, real, errdefs.ErrFailedPrecondition)
		}
		out = append(out, runtime.Mount{Source: m.Source, Destination: m.Destination, ReadOnly: m.ReadOnly})
	}
	return out, nil
}

// resolve returns p with symlinks resolved, or p itself when it does not
// exist (a rule for an absent prefix then matches nothing real).
func resolve(p string) string {
	if r, err := filepath.EvalSymlinks(p); err == nil {
		return r
	}
	return filepath.Clean(p)
}

// within reports whether p is dir or inside it.
func within(p, dir string) bool {
	return p == dir || strings.HasPrefix(p, strings.TrimSuffix(dir, "/")+"/")
}
