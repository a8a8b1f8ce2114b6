package leakcheck

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

func TestVMLeaks(t *testing.T) {
	run, root := t.TempDir(), t.TempDir()
	if err := os.Mkdir(filepath.Join(root, "vm1"), 0o700); err != nil {
		t.Fatal(err)
	}
	// A stand-in whose command line looks like a QEMU of this scope.
	cmd := exec.Command("sh", "-c", "sleep 30", "qemu", "-qmp", "unix:"+run+"/b/vm1/qmp.sock,server=on,wait=off")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	// A jailed QEMU names its bundle instead.
	jailed := exec.Command("sh", "-c", "sleep 30", "qemu", "-name", "cube-vm:"+run+"/b/vm2")
	if err := jailed.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = jailed.Process.Kill(); _ = jailed.Wait() })
	leaks, err := Check(context.Background(), Scope{RunDir: run, VMRoot: root})
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, l := range leaks {
		got = append(got, l.String())
	}
	all := strings.Join(got, "\n")
	if !strings.Contains(all, "vm: "+filepath.Join(canon(root), "vm1")) || strings.Count(all, "QEMU under") != 2 {
		t.Fatalf("leaks = %v, want the state dir and the process", got)
	}
	_ = cmd.Process.Kill()
	_ = cmd.Wait()
	_ = jailed.Process.Kill()
	_ = jailed.Wait()
	_ = os.Remove(filepath.Join(root, "vm1"))
	if leaks, _ := Check(context.Background(), Scope{RunDir: run, VMRoot: root}); len(leaks) != 0 {
		t.Fatalf("after cleanup: %v", leaks)
	}
}
