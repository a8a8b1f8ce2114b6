package leakcheck

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestRunscLeaks(t *testing.T) {
	root := t.TempDir()
	if got := runscLeaks(Scope{RunscRoot: root}); len(got) != 0 {
		t.Fatalf("empty root: %v", got)
	}
	state := filepath.Join(root, "sb_sandbox:sb.state")
	if err := os.WriteFile(state, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	// A process started with the root, as runsc's sandbox and gofer are.
	cmd := exec.Command("/bin/sh", "-c", "sleep 30", "runsc-sandbox", "--root="+root)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	deadline := time.Now().Add(5 * time.Second)
	for {
		got := runscLeaks(Scope{RunscRoot: root})
		var s []string
		for _, l := range got {
			s = append(s, l.String())
		}
		all := strings.Join(s, "\n")
		if strings.Contains(all, "runsc: "+state) && strings.Contains(all, "of runsc root "+root) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("leaks = %q, want the state file and the process", all)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if got := runscLeaks(Scope{}); len(got) != 0 {
		t.Fatalf("no root in scope: %v", got)
	}
}
