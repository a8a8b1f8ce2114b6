package imagebuild

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"

	v1 "github.com/google/go-containerregistry/pkg/v1"

	"github.com/cubesandbox/cube/internal/errdefs"
)

// Resolve returns pkgs and everything they depend on (Depends and
// Pre-Depends, recursively, as apt on this machine resolves them), sorted,
// less the packages in exclude. Virtual packages are left out: a real
// package providing them is in the closure.
func Resolve(ctx context.Context, pkgs, exclude []string) ([]string, error) {
	args := append([]string{"depends", "--recurse", "--no-recommends", "--no-suggests", "--no-conflicts",
		"--no-breaks", "--no-replaces", "--no-enhances"}, pkgs...)
	out, err := exec.CommandContext(ctx, "apt-cache", args...).Output()
	if err != nil {
		return nil, fmt.Errorf("apt-cache depends %v: %w", pkgs, exitErr(err))
	}
	skip := map[string]bool{}
	for _, p := range exclude {
		skip[p] = true
	}
	set := map[string]bool{}
	for _, line := range strings.Split(string(out), "\n") {
		if line == "" || strings.HasPrefix(line, " ") || strings.HasPrefix(line, "<") {
			continue
		}
		name := strings.TrimSuffix(strings.TrimSpace(line), ":amd64")
		if !skip[name] {
			set[name] = true
		}
	}
	names := make([]string, 0, len(set))
	for n := range set {
		names = append(names, n)
	}
	sort.Strings(names)
	return names, nil
}

// Download fetches the named packages' .deb files (the versions apt would
// install) into cacheDir and returns their paths in the order of pkgs. A
// file already there is reused: its name carries the version.
func Download(ctx context.Context, cacheDir string, pkgs []string) ([]string, error) {
	if err := os.MkdirAll(cacheDir, 0o755); err != nil {
		return nil, err
	}
	names, err := debFileNames(ctx, pkgs)
	if err != nil {
		return nil, err
	}
	files := make([]string, len(pkgs))
	var missing []string
	for i, p := range pkgs {
		files[i] = filepath.Join(cacheDir, names[p])
		if _, err := os.Stat(files[i]); err != nil {
			missing = append(missing, p)
		}
	}
	if len(missing) > 0 {
		cmd := exec.CommandContext(ctx, "apt-get", append([]string{"download", "-qq"}, missing...)...)
		cmd.Dir = cacheDir
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		if err := cmd.Run(); err != nil {
			return nil, fmt.Errorf("apt-get download: %w: %s", err, strings.TrimSpace(stderr.String()))
		}
	}
	for _, f := range files {
		if _, err := os.Stat(f); err != nil {
			return nil, fmt.Errorf("apt-get download left no %s: %w", filepath.Base(f), errdefs.ErrNotFound)
		}
	}
	return files, nil
}

// debFileNames are the names apt-get download gives the packages' files:
// name_version_arch.deb with the version's epoch colon escaped (one
// apt-cache call for all of them).
func debFileNames(ctx context.Context, pkgs []string) (map[string]string, error) {
	out, err := exec.CommandContext(ctx, "apt-cache", append([]string{"show", "--no-all-versions"}, pkgs...)...).Output()
	if err != nil {
		return nil, fmt.Errorf("apt-cache show: %w", exitErr(err))
	}
	names := map[string]string{}
	for _, rec := range strings.Split(string(out), "\n\n") {
		var pkg, version, arch string
		for _, line := range strings.Split(rec, "\n") {
			if v, ok := strings.CutPrefix(line, "Package: "); ok {
				pkg = v
			} else if v, ok := strings.CutPrefix(line, "Version: "); ok {
				version = v
			} else if v, ok := strings.CutPrefix(line, "Architecture: "); ok {
				arch = v
			}
		}
		if pkg != "" && version != "" && arch != "" {
			if _, seen := names[pkg]; !seen {
				names[pkg] = pkg + "_" + strings.ReplaceAll(version, ":", "%3a") + "_" + arch + ".deb"
			}
		}
	}
	for _, p := range pkgs {
		if names[p] == "" {
			return nil, fmt.Errorf("apt-cache show %s: no version: %w", p, errdefs.ErrNotFound)
		}
	}
	return names, nil
}

// DebLayer unpacks the data of the given .deb files, in order, into one
// layer (maintainer scripts are not run: the images hold programs and
// their libraries, not a configured system). Documentation and manual
// pages are left out.
func DebLayer(ctx context.Context, tmpDir string, debs []string) (v1.Layer, error) {
	w, err := newLayerWriter(tmpDir)
	if err != nil {
		return nil, err
	}
	for _, deb := range debs {
		if err := w.addDeb(ctx, deb); err != nil {
			w.abort()
			return nil, fmt.Errorf("unpack %s: %w", filepath.Base(deb), err)
		}
	}
	return w.finish()
}

var debSkip = []string{"usr/share/doc/", "usr/share/man/", "usr/share/info/", "usr/share/lintian/", "usr/share/locale/"}

func (w *layerWriter) addDeb(ctx context.Context, deb string) error {
	cmd := exec.CommandContext(ctx, "dpkg-deb", "--fsys-tarfile", deb)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		return err
	}
	if err := cmd.Start(); err != nil {
		return err
	}
	copyErr := w.copyTar(out, debSkip)
	_, _ = io.Copy(io.Discard, out)
	if err := cmd.Wait(); err != nil {
		return fmt.Errorf("dpkg-deb: %w: %s", err, strings.TrimSpace(stderr.String()))
	}
	return copyErr
}

func exitErr(err error) error {
	var ee *exec.ExitError
	if errors.As(err, &ee) && len(ee.Stderr) > 0 {
		return fmt.Errorf("%w: %s", err, strings.TrimSpace(string(ee.Stderr)))
	}
	return err
}
