package actions

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

// Destinations a bind may not cover: the runtime mounts its own
// filesystems there, and shadowing them would break or unconfine the
// sandbox.
var reservedDestinations = []string{"/proc", "/sys", "/dev"}

// CheckDestination checks where a host mount is bound in the sandbox.
func CheckDestination(dst string) error {
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

// AllowedSource resolves src and returns it if an allow rule of
// storage.host_mount_allow permits it (with the requested access).
// cubelet's own data and run directories are never allowed.
func AllowedSource(cfg *config.Config, src string, readOnly bool) (string, error) {
	if src == "" {
		return "", errors.New("required")
	}
	if !filepath.IsAbs(src) {
		return "", fmt.Errorf("%q must be an absolute path", src)
	}
	resolved, err := filepath.EvalSymlinks(src)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return "", fmt.Errorf("%q does not exist on this node", src)
		}
		return "", fmt.Errorf("%q: %v", src, err)
	}
	st, err := os.Stat(resolved)
	if err != nil {
		return "", fmt.Errorf("%q: %v", src, err)
	}
	if !st.IsDir() && !st.Mode().IsRegular() {
		return "", fmt.Errorf("%q is neither a directory nor a regular file", src)
	}
	for _, own := range []string{cfg.Node.DataDir, cfg.Node.RunDir} {
		if o := resolve(own); within(resolved, o) || within(o, resolved) {
			return "", fmt.Errorf("%q overlaps cubelet's own directory %s", src, own)
		}
	}
	var best *config.HostMountRule
	bestLen := -1
	for i := range cfg.Storage.HostMountAllow {
		r := &cfg.Storage.HostMountAllow[i]
		p := resolve(r.Prefix)
		if within(resolved, p) && len(p) > bestLen {
			best, bestLen = r, len(p)
		}
	}
	via := ""
	if resolved != src {
		via = fmt.Sprintf(" (resolves to %s)", resolved)
	}
	switch {
	case best == nil:
		return "", fmt.Errorf("%q%s is not under any prefix in storage.host_mount_allow", src, via)
	case best.ReadOnly && !readOnly:
		return "", fmt.Errorf("%q%s may only be bound read-only (storage.host_mount_allow %s is read_only)", src, via, best.Prefix)
	}
	return resolved, nil
}

// HostMountsFor turns a record's host mounts into runtime mounts,
// re-checking each source right before the bind: if a path component was
// replaced by a symlink since create, the source no longer resolves to
// itself and the start is refused.
func (n *Node) HostMountsFor(ms []sandbox.HostMount) ([]runtime.Mount, error) {
	var out []runtime.Mount
	for _, m := range ms {
		resolved, err := AllowedSource(n.Cfg, m.Source, m.ReadOnly)
		if err != nil {
			return nil, fmt.Errorf("host mount %s: %v: %w", m.Destination, err, errdefs.ErrFailedPrecondition)
		}
		if resolved != m.Source {
			return nil, fmt.Errorf("host mount %s: source %s now resolves to %s: %w", m.Destination, m.Source, resolved, errdefs.ErrFailedPrecondition)
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
