// Package procstate tells whether a host PID is still a given sandbox's
// process, from /proc alone: drivers and cubelet ask it where exec'ing
// the runtime's own state command would cost more than the answer is
// worth.
package procstate

import (
	"bytes"
	"fmt"
	"os"
	"strings"
	"syscall"
)

// Alive reports whether pid is the sandbox's process: it exists, is not a
// zombie (a sandbox whose parent does not reap it is dead all the same)
// and sits in the sandbox's cgroup (cgroup, as the runtime's spec names
// it; "" skips that check), so a PID freed by a dead sandbox and reused
// by another process does not make it look alive. An error means /proc
// answered something this cannot read, and the caller should ask the
// runtime.
func Alive(pid int, cgroup string) (bool, error) {
	if pid <= 0 || syscall.Kill(pid, 0) != nil {
		return false, nil
	}
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false, nil // exited since the kill
	}
	// The state is the first field after the command, which is in
	// parentheses and may itself contain ") ".
	if i := bytes.LastIndexByte(stat, ')'); i < 0 || i+2 >= len(stat) {
		return false, fmt.Errorf("/proc/%d/stat: %q", pid, stat)
	} else if st := stat[i+2]; st == 'Z' || st == 'X' {
		return false, nil
	}
	if cgroup == "" {
		return true, nil
	}
	cg, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	if err != nil {
		return false, nil // exited since the kill
	}
	for line := range strings.SplitSeq(strings.TrimSpace(string(cg)), "\n") {
		parts := strings.SplitN(line, ":", 3)
		if len(parts) == 3 && (parts[2] == cgroup || strings.HasPrefix(parts[2], cgroup+"/")) {
			return true, nil
		}
	}
	return false, nil
}
