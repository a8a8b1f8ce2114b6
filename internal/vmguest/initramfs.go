package vmguest

import (
	"bytes"
	"compress/gzip"
	_ "embed"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/cubesandbox/cube/internal/errdefs"
)

//go:embed init.sh
var initScript []byte

// initApplets are the busybox applets init.sh uses.
var initApplets = []string{"sh", "mount", "umount", "cat", "insmod", "usleep", "switch_root"}

// initramfs builds the gzip'd newc archive: busybox, /init, the modules in
// load order (flat under /lib/modules, listed in /etc/modules) and the
// /dev/console node the kernel opens before /init runs.
func initramfs(busybox string, modules []string, modPaths map[string]string) ([]byte, error) {
	bb, err := os.ReadFile(busybox)
	if err != nil {
		return nil, fmt.Errorf("vmguest: busybox %s (install busybox-static): %w", busybox, errdefs.ErrFailedPrecondition)
	}
	var buf bytes.Buffer
	zw, _ := gzip.NewWriterLevel(&buf, gzip.BestCompression)
	c := &cpioWriter{w: zw}
	steps := []func() error{
		func() error { return c.dir("bin") },
		func() error { return c.file("bin/busybox", 0o755, bb) },
	}
	for _, a := range initApplets {
		steps = append(steps, func() error { return c.symlink("bin/"+a, "busybox") })
	}
	for _, d := range []string{"dev", "proc", "sys", "newroot", "etc", "lib", "lib/modules"} {
		steps = append(steps, func() error { return c.dir(d) })
	}
	steps = append(steps,
		func() error { return c.char("dev/console", 0o600, 5, 1) },
		func() error { return c.file("init", 0o755, initScript) },
		func() error { return c.file("etc/modules", 0o644, []byte(strings.Join(modules, "\n")+"\n")) },
	)
	for _, m := range modules {
		steps = append(steps, func() error {
			data, err := os.ReadFile(modPaths[m])
			if err != nil {
				return err
			}
			return c.file("lib/modules/"+m+".ko", 0o644, data)
		})
	}
	steps = append(steps, c.close, zw.Close)
	for _, s := range steps {
		if err := s(); err != nil {
			return nil, fmt.Errorf("vmguest: initramfs: %w", err)
		}
	}
	return buf.Bytes(), nil
}

// writeFileAtomic writes via a temporary name and a rename, so a reader
// (or a crashed build) never sees half a file.
func writeFileAtomic(path string, data []byte, perm os.FileMode) error {
	tmp, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.Write(data); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Chmod(perm); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), path)
}
