package leakcheck

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// runscLeaks reports what a gVisor sandbox leaves when it is not stopped
// properly: runsc's state files under RunscRoot, and the runsc-sandbox and
// runsc-gofer processes (and any runsc command) started with that root.
// Neither shows up in the other checks: gVisor's processes keep the host
// root, and their command lines name the bundle only at start.
func runscLeaks(s Scope) []Leak {
	root := canon(s.RunscRoot)
	if root == "" {
		return nil
	}
	var leaks []Leak
	ents, _ := os.ReadDir(root)
	for _, e := range ents {
		leaks = append(leaks, Leak{Kind: KindRunsc, What: filepath.Join(root, e.Name())})
	}
	self := os.Getpid()
	procs, _ := os.ReadDir("/proc")
	for _, e := range procs {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == self {
			continue
		}
		cmd, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil {
			continue
		}
		args := strings.Split(strings.TrimRight(string(cmd), "\x00"), "\x00")
		for i, a := range args {
			if a == "--root="+root || (a == "--root" && i+1 < len(args) && args[i+1] == root) {
				comm, _ := os.ReadFile(filepath.Join("/proc", e.Name(), "comm"))
				leaks = append(leaks, Leak{Kind: KindProcess, What: fmt.Sprintf("pid %d (%s) of runsc root %s", pid, strings.TrimSpace(string(comm)), root)})
				break
			}
		}
	}
	return leaks
}
