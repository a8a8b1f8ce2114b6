package actions

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/cubesandbox/cube/internal/cubelet/config"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/hostbind"
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
	via := ""
	if resolved != src {
		via = fmt.Sprintf(" (resolves to %s)", resolved)
	}
	if _, err := allowedPath(cfg, resolved, readOnly); err != nil {
		return "", fmt.Errorf("%q%s %v", src, via, err)
	}
	return resolved, nil
}

// allowedPath checks a resolved path against the rules and returns the
// prefix (resolved) of the rule that allows it.
func allowedPath(cfg *config.Config, resolved string, readOnly bool) (string, error) {
	for _, own := range []string{cfg.Node.DataDir, cfg.Node.RunDir} {
		if o := resolve(own); within(resolved, o) || within(o, resolved) {
			return "", fmt.Errorf("overlaps cubelet's own directory %s", own)
		}
	}
	var best *config.HostMountRule
	prefix := ""
	for i := range cfg.Storage.HostMountAllow {
		r := &cfg.Storage.HostMountAllow[i]
		p := resolve(r.Prefix)
		if within(resolved, p) && (best == nil || len(p) > len(prefix)) {
			best, prefix = r, p
		}
	}
	switch {
	case best == nil:
		return "", errors.New("is not under any prefix in storage.host_mount_allow")
	case best.ReadOnly && !readOnly:
		return "", fmt.Errorf("may only be bound read-only (storage.host_mount_allow %s is read_only)", best.Prefix)
	}
	return prefix, nil
}

// HostMountsDir is where a sandbox's host mounts are staged for its
// runtime while it starts (hostbind): in its run directory, root's alone.
func (n *Node) HostMountsDir(id string) string {
	return filepath.Join(n.Cfg.SandboxRunDir(id), "hostmounts")
}

// StageHostMounts turns a record's host mounts into runtime mounts for
// sandbox id. Each source is checked again by name (the allow rules may
// have changed, a component may have become a symlink since create: the
// start is refused), then bound by descriptor onto a staging path in
// HostMountsDir (hostbind.Stage), which is what the runtime binds, so a
// swap after the check cannot redirect the bind. The caller calls unstage
// once the runtime has started (or failed to): the sandbox keeps its own
// copy of the mounts. stage false (a runtime that boots a disk and binds
// nothing of the host) checks only.
func (n *Node) StageHostMounts(ctx context.Context, id string, ms []sandbox.HostMount, stage bool) (mounts []runtime.Mount, unstage func(), err error) {
	unstage = func() {}
	if len(ms) == 0 {
		return nil, unstage, nil
	}
	dir := n.HostMountsDir(id)
	if stage {
		// Left by a start that died before cleaning up.
		if err := hostbind.Unstage(dir); err != nil {
			return nil, unstage, err
		}
		if err := os.Mkdir(dir, 0o700); err != nil {
			return nil, unstage, fmt.Errorf("host mounts: %w", err)
		}
		unstage = func() {
			if err := hostbind.Unstage(dir); err != nil {
				slog.WarnContext(ctx, "host mount staging left behind; removed at destroy", "sandbox", id, "err", err)
			}
		}
	}
	for i, m := range ms {
		resolved, err := AllowedSource(n.Cfg, m.Source, m.ReadOnly)
		if err == nil && resolved != m.Source {
			err = fmt.Errorf("source %s now resolves to %s", m.Source, resolved)
		}
		if err != nil {
			unstage()
			return nil, func() {}, fmt.Errorf("host mount %s: %v: %w", m.Destination, err, errdefs.ErrFailedPrecondition)
		}
		if !stage {
			continue
		}
		root, err := allowedPath(n.Cfg, resolved, m.ReadOnly)
		if err != nil { // AllowedSource just passed: only a config change races here
			unstage()
			return nil, func() {}, fmt.Errorf("host mount %s: %v: %w", m.Destination, err, errdefs.ErrFailedPrecondition)
		}
		target := filepath.Join(dir, strconv.Itoa(i))
		err = hostbind.Stage(ctx, hostbind.Request{
			Root: root, Source: m.Source, Target: target, ReadOnly: m.ReadOnly,
			Check: func(p string) error { _, err := allowedPath(n.Cfg, p, m.ReadOnly); return err },
		})
		if err != nil {
			unstage()
			return nil, func() {}, fmt.Errorf("host mount %s: %w", m.Destination, err)
		}
		mounts = append(mounts, runtime.Mount{Source: target, Destination: m.Destination, ReadOnly: m.ReadOnly})
	}
	return mounts, unstage, nil
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
