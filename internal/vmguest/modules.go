package vmguest

import (
	"bufio"
	"debug/elf"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"github.com/cubesandbox/cube/internal/errdefs"
)

// RootModules are the drivers a guest on QEMU's microvm needs: the
// virtio-mmio bus (discovered through ACPI), the root disk, the NIC, the
// agent's virtio-serial port, entropy, and vsock for hosts with
// vhost-vsock. Their dependencies are added from each module's .modinfo,
// since the kernel package ships no modules.dep (depmod runs at install).
var RootModules = []string{
	"virtio_mmio", "virtio_blk", "virtio_net", "virtio_console", "virtio_rng",
	"vmw_vsock_virtio_transport",
}

// moduleSet is one kernel's modules: name -> path, and the built-in names.
type moduleSet struct {
	paths   map[string]string
	builtin map[string]bool
}

// modName normalises a module name as the kernel does ('-' == '_').
func modName(s string) string { return strings.ReplaceAll(s, "-", "_") }

func scanModules(modDir string) (*moduleSet, error) {
	ms := &moduleSet{paths: map[string]string{}, builtin: map[string]bool{}}
	err := filepath.WalkDir(filepath.Join(modDir, "kernel"), func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.IsDir() && strings.HasSuffix(p, ".ko") {
			ms.paths[modName(strings.TrimSuffix(d.Name(), ".ko"))] = p
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("vmguest: scan modules: %w", err)
	}
	f, err := os.Open(filepath.Join(modDir, "modules.builtin"))
	if err != nil {
		return nil, fmt.Errorf("vmguest: modules.builtin: %w", err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		base := filepath.Base(strings.TrimSpace(sc.Text()))
		if base != "" {
			ms.builtin[modName(strings.TrimSuffix(base, ".ko"))] = true
		}
	}
	return ms, sc.Err()
}

// modinfoDepends reads the "depends=" entry of a module's .modinfo section.
func modinfoDepends(path string) ([]string, error) {
	f, err := elf.Open(path)
	if err != nil {
		return nil, fmt.Errorf("vmguest: %s: %w", path, err)
	}
	defer f.Close()
	sec := f.Section(".modinfo")
	if sec == nil {
		return nil, fmt.Errorf("vmguest: %s: no .modinfo: %w", path, errdefs.ErrInvalidArgument)
	}
	data, err := sec.Data()
	if err != nil {
		return nil, fmt.Errorf("vmguest: %s: %w", path, err)
	}
	for _, kv := range strings.Split(string(data), "\x00") {
		if v, ok := strings.CutPrefix(kv, "depends="); ok {
			if v == "" {
				return nil, nil
			}
			return strings.Split(v, ","), nil
		}
	}
	return nil, nil
}

// resolve returns the modules to load, dependencies first, skipping those
// built into the kernel. A root that is neither a module nor built in is
// an error: the guest would boot without a device it needs.
func (ms *moduleSet) resolve(roots []string) ([]string, error) {
	var order []string
	state := map[string]int{} // 1 visiting, 2 done
	var visit func(name string) error
	visit = func(name string) error {
		name = modName(name)
		switch state[name] {
		case 1:
			return fmt.Errorf("vmguest: module dependency cycle at %s: %w", name, errdefs.ErrInvalidArgument)
		case 2:
			return nil
		}
		path, ok := ms.paths[name]
		if !ok {
			if ms.builtin[name] {
				state[name] = 2
				return nil
			}
			return fmt.Errorf("vmguest: module %s: %w", name, errdefs.ErrNotFound)
		}
		state[name] = 1
		deps, err := modinfoDepends(path)
		if err != nil {
			return err
		}
		for _, d := range deps {
			if err := visit(d); err != nil {
				return err
			}
		}
		state[name] = 2
		order = append(order, name)
		return nil
	}
	for _, r := range roots {
		if err := visit(r); err != nil {
			return nil, err
		}
	}
	return order, nil
}
