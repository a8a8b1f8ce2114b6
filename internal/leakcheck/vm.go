package leakcheck

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// KindVM is a vm driver state directory left under Scope.VMRoot.
const KindVM = "vm"

// vmLeaks reports what a QEMU micro-VM leaves when it is not stopped
// properly: state dirs under VMRoot, and QEMU processes whose QMP socket
// lies in a bundle under RunDir. A daemonized QEMU keeps the host root, so
// the root check in processes() does not see it; its command line names
// the bundle, but only processes() with RunDir/sandboxes bundles catches
// that, and VM bundles may live elsewhere under RunDir.
func vmLeaks(s Scope) []Leak {
	var leaks []Leak
	if root := canon(s.VMRoot); root != "" {
		ents, _ := os.ReadDir(root)
		for _, e := range ents {
			leaks = append(leaks, Leak{Kind: KindVM, What: filepath.Join(root, e.Name())})
		}
	}
	run := canon(s.RunDir)
	if run == "" {
		return leaks
	}
	procs, _ := os.ReadDir("/proc")
	sandboxes := join(run, "sandboxes")
	for _, e := range procs {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == os.Getpid() {
			continue
		}
		cmd, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil {
			continue
		}
		cl := strings.ReplaceAll(string(cmd), "\x00", " ")
		if strings.Contains(cl, sandboxes) {
			continue // processes() reports it
		}
		// A jailed QEMU names its bundle in -name (vm.nameMarker).
		if strings.Contains(cl, "-qmp unix:"+run+"/") || strings.Contains(cl, "-name cube-vm:"+run+"/") {
			comm, _ := os.ReadFile(filepath.Join("/proc", e.Name(), "comm"))
			leaks = append(leaks, Leak{Kind: KindProcess, What: fmt.Sprintf("pid %d (%s) QEMU under %s", pid, strings.TrimSpace(string(comm)), run)})
		}
	}
	return leaks
}
