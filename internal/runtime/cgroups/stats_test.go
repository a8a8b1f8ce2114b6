package cgroups

import (
	"bufio"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/testenv"
)

const hogEnv = "CUBE_CGROUPS_TEST_HOG"

// TestHogHelper is the child process of TestReadStats, not a test: once
// its parent has moved it into the cgroup (a line on stdin) it allocates
// and touches 64 MiB, burns 300 ms of CPU time, says so and waits for stdin
// to close.
func TestHogHelper(t *testing.T) {
	if os.Getenv(hogEnv) == "" {
		t.Skip("helper process")
	}
	in := bufio.NewReader(os.Stdin)
	_, _ = in.ReadString('\n')
	buf := make([]byte, 64<<20)
	for i := 0; i < len(buf); i += 4096 {
		buf[i] = 1
	}
	// Burn 300 ms of CPU time (not wall time: the host may be busy).
	x := 0
	for cpuTime() < 300*time.Millisecond {
		for i := 0; i < 1e6; i++ {
			x++
		}
	}
	os.Stdout.WriteString("ready " + strconv.Itoa(x%2) + "\n")
	_, _ = in.ReadString('\n')
	buf[len(buf)-1] = 2 // keep buf alive until here
	os.Exit(0)
}

func cpuTime() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// TestReadStats moves a process that allocates 64 MiB and burns 300 ms of
// CPU into a fresh cgroup with a 256 MiB limit and checks each figure.
func TestReadStats(t *testing.T) {
	testenv.RequireRoot(t, "creates cgroups")
	mounts, err := Mounts()
	if err != nil {
		t.Fatal(err)
	}
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	path := "/cube-cgstats-" + hex.EncodeToString(b)
	if _, err := ReadStats(mounts, path); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("ReadStats of a missing cgroup: %v, want ErrNotExist", err)
	}
	var made []string
	t.Cleanup(func() {
		for _, d := range made {
			_ = rmdirRetry(d, 2*time.Second)
		}
	})
	const limit = 256 << 20
	for _, m := range mounts {
		d := filepath.Join(m, path)
		if err := os.Mkdir(d, 0o755); err != nil {
			continue
		}
		made = append(made, d)
		for _, f := range []string{"memory.max", "memory.limit_in_bytes"} {
			_ = os.WriteFile(filepath.Join(d, f), []byte(strconv.Itoa(limit)), 0o644)
		}
	}
	if len(made) == 0 {
		testenv.Missing(t, "no writable cgroup hierarchy")
	}

	cmd := exec.Command(os.Args[0], "-test.run=^TestHogHelper$")
	cmd.Env = append(os.Environ(), hogEnv+"=1")
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = stdin.Close()
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	for _, d := range made {
		if err := os.WriteFile(filepath.Join(d, "cgroup.procs"), []byte(strconv.Itoa(cmd.Process.Pid)), 0o644); err != nil {
			t.Logf("join %s: %v", d, err)
		}
	}
	if _, err := stdin.Write([]byte("go\n")); err != nil {
		t.Fatal(err)
	}
	if _, err := bufio.NewReader(stdout).ReadString('\n'); err != nil {
		t.Fatalf("helper: %v", err)
	}
	st, err := ReadStats(mounts, path)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("stats: %+v", st)
	if st.RSS < 64<<20 || st.Memory < st.RSS {
		t.Errorf("RSS %d, memory %d: want RSS >= 64 MiB and memory >= RSS", st.RSS, st.Memory)
	}
	if st.MemoryLimit != limit {
		t.Errorf("memory limit %d, want %d", st.MemoryLimit, limit)
	}
	// The helper's 300 ms include its start-up before it joined the
	// cgroup (tens of ms); the cgroup sees the rest.
	if st.CPU < 200*time.Millisecond {
		t.Errorf("CPU %s, want at least 200 ms of the 300 ms the helper burnt", st.CPU)
	}
	if st.Pids < 1 {
		t.Errorf("pids %d, want >= 1", st.Pids)
	}
}
