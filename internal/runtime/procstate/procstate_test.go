package procstate

import (
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// ownCgroup is this process's cgroup as /proc/self/cgroup names it on
// its first line.
func ownCgroup(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		t.Fatal(err)
	}
	parts := strings.SplitN(strings.SplitN(strings.TrimSpace(string(b)), "\n", 2)[0], ":", 3)
	if len(parts) != 3 {
		t.Fatalf("/proc/self/cgroup: %q", b)
	}
	return parts[2]
}

func TestAlive(t *testing.T) {
	self, cg := os.Getpid(), ownCgroup(t)
	for _, c := range []struct {
		name   string
		pid    int
		cgroup string
		want   bool
	}{
		{"itself in its cgroup", self, cg, true},
		{"itself, cgroup not checked", self, "", true},
		// A reused PID: the right number in another sandbox's cgroup.
		{"itself in another cgroup", self, "/cube-procstate-test/not-this-one", false},
		{"no such pid", 1 << 22, "", false},
		{"pid 0", 0, "", false},
	} {
		got, err := Alive(c.pid, c.cgroup)
		if err != nil || got != c.want {
			t.Errorf("%s: Alive(%d, %q) = %v, %v; want %v", c.name, c.pid, c.cgroup, got, err, c.want)
		}
	}

	// A zombie: exited, not reaped yet.
	cmd := exec.Command("/bin/true")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Wait() })
	deadline := time.Now().Add(5 * time.Second)
	for {
		got, err := Alive(cmd.Process.Pid, "")
		if err != nil {
			t.Fatal(err)
		}
		if !got {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("an exited, unreaped child (a zombie) still counts as alive")
		}
		time.Sleep(10 * time.Millisecond)
	}
}
