// Package testbin builds the project's commands for tests that run them as
// processes (daemons, the agent, probes).
//
// Each test process builds into a directory of its own,
// $TMPDIR/cube-testbin/<pid>-<random>, so concurrent test processes (and
// worktrees) never run each other's binaries. Test binaries have no exit
// hook to remove it, so every process sweeps the directories of processes
// that are gone before it builds: what is left on disk is bounded by the
// test processes alive.
package testbin

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
)

// Root is the module root, found from this source file; in a -trimpath
// binary (cube-bench, whose cluster scenarios build the daemons) the
// source path is module-relative, and Root is the first directory from
// the working directory up that holds a go.mod ("" if none).
func Root() string {
	_, file, _, _ := runtime.Caller(0)
	if filepath.IsAbs(file) {
		return filepath.Clean(filepath.Join(filepath.Dir(file), "..", ".."))
	}
	dir, err := os.Getwd()
	if err != nil {
		return ""
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir
		}
		up := filepath.Dir(dir)
		if up == dir {
			return ""
		}
		dir = up
	}
}

var (
	dirOnce sync.Once
	dir     string
	dirErr  error

	mu     sync.Mutex
	builds = map[string]*build{}
)

type build struct {
	once sync.Once
	path string
	err  error
}

// Build builds ./cmd/<name> with the build tags tags ("" for a release
// build) once per test process and returns the binary's path:
// <process dir>/<tags or "release">/<name>. Builds are static (CGO off)
// and -trimpath.
func Build(t testing.TB, name, tags string) string {
	t.Helper()
	flavour := tags
	if flavour == "" {
		flavour = "release"
	}
	key := flavour + "/" + name
	mu.Lock()
	b := builds[key]
	if b == nil {
		b = &build{}
		builds[key] = b
	}
	mu.Unlock()
	b.once.Do(func() {
		d, err := processDir()
		if err != nil {
			b.err = err
			return
		}
		b.path = filepath.Join(d, flavour, name)
		args := []string{"build", "-trimpath"}
		if tags != "" {
			args = append(args, "-tags", tags)
		}
		cmd := exec.Command("go", append(args, "-o", b.path, "./cmd/"+name)...)
		cmd.Dir = Root()
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			b.err = fmt.Errorf("build %s: %v\n%s", name, err, out)
		}
	})
	if b.err != nil {
		t.Fatal(b.err)
	}
	return b.path
}

// processDir makes this process's directory, first removing those of
// processes that no longer exist.
func processDir() (string, error) {
	dirOnce.Do(func() {
		base := filepath.Join(os.TempDir(), "cube-testbin")
		if dirErr = os.MkdirAll(base, 0o755); dirErr != nil {
			return
		}
		sweep(base)
		dir, dirErr = os.MkdirTemp(base, strconv.Itoa(os.Getpid())+"-")
		if dirErr == nil {
			// Daemons a test runs as other users (a sandbox's IDs) may
			// need to execute what is here.
			dirErr = os.Chmod(dir, 0o755)
		}
	})
	return dir, dirErr
}

// sweep removes the directories of dead processes under base.
func sweep(base string) {
	ents, err := os.ReadDir(base)
	if err != nil {
		return
	}
	for _, e := range ents {
		pidStr, _, ok := strings.Cut(e.Name(), "-")
		pid, err := strconv.Atoi(pidStr)
		if !ok || err != nil || pid <= 0 {
			continue
		}
		if err := syscall.Kill(pid, 0); errors.Is(err, syscall.ESRCH) {
			_ = os.RemoveAll(filepath.Join(base, e.Name()))
		}
	}
}
