package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"runtime"
	"strings"
	"sync"
	"testing"
)

// benchTB is the testing.TB that cube-bench hands the cluster harness
// (test/cluster/clusterenv), which builds and tears down its system
// through one: Fatal ends the calling goroutine (as in a test) after
// recording the failure, Cleanup functions run last-in first-out when
// cleanup is called, and Log goes to a file (the daemons' output). Only
// call the harness from inside do, which turns a Fatal into an error.
type benchTB struct {
	testing.TB // nil: satisfies the interface's unexported method; every exported one is below

	name string
	ctx  context.Context
	log  io.Writer
	dir  string // TempDir's parent

	mu       sync.Mutex
	errs     []string
	failed   bool
	cleanups []func()
	tmp      int
}

var _ testing.TB = (*benchTB)(nil)

// errSkipNow is what SkipNow records: the harness skips when a
// prerequisite (root, a binary) is missing.
var errSkipNow = errors.New("skipped")

func newBenchTB(ctx context.Context, name, dir string, log io.Writer) *benchTB {
	if log == nil {
		log = io.Discard
	}
	return &benchTB{name: name, ctx: ctx, dir: dir, log: log}
}

// do runs f on a goroutine of its own (Fatal and Skip end it with
// runtime.Goexit) and returns the failures it recorded, wrapped in
// ErrSkip for a skip.
func (t *benchTB) do(f func()) error {
	done := make(chan bool)
	go func() {
		finished := false
		defer func() { done <- finished }()
		f()
		finished = true
	}()
	finished := <-done
	t.mu.Lock()
	defer t.mu.Unlock()
	err := t.errLocked()
	if !finished && err == nil {
		err = errors.New(t.name + ": the harness stopped without saying why")
	}
	return err
}

func (t *benchTB) errLocked() error {
	if len(t.errs) == 0 {
		return nil
	}
	err := errors.New(strings.Join(t.errs, "; "))
	if !t.failed {
		return fmt.Errorf("%w: %w", ErrSkip, err)
	}
	return err
}

// cleanup runs the registered cleanups, newest first, and returns what
// they reported (a leak the harness found is an error).
func (t *benchTB) cleanup() error {
	t.mu.Lock()
	n := len(t.errs)
	t.mu.Unlock()
	for {
		t.mu.Lock()
		if len(t.cleanups) == 0 {
			t.mu.Unlock()
			break
		}
		f := t.cleanups[len(t.cleanups)-1]
		t.cleanups = t.cleanups[:len(t.cleanups)-1]
		t.mu.Unlock()
		// A Fatal inside a cleanup ends only that cleanup.
		_ = t.do(f)
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if len(t.errs) == n {
		return nil
	}
	return errors.New(strings.Join(t.errs[n:], "; "))
}

func (t *benchTB) record(failed bool, msg string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.errs = append(t.errs, msg)
	t.failed = t.failed || failed
	fmt.Fprintln(t.log, msg)
}

func (t *benchTB) ArtifactDir() string       { return t.TempDir() }
func (t *benchTB) Attr(string, string)       {}
func (t *benchTB) Cleanup(f func())          { t.mu.Lock(); t.cleanups = append(t.cleanups, f); t.mu.Unlock() }
func (t *benchTB) Error(args ...any)         { t.record(true, fmt.Sprint(args...)) }
func (t *benchTB) Errorf(f string, a ...any) { t.record(true, fmt.Sprintf(f, a...)) }
func (t *benchTB) Fail()                     { t.mu.Lock(); t.failed = true; t.mu.Unlock() }
func (t *benchTB) FailNow()                  { t.Fail(); runtime.Goexit() }
func (t *benchTB) Failed() bool              { t.mu.Lock(); defer t.mu.Unlock(); return t.failed }
func (t *benchTB) Fatal(args ...any)         { t.Error(args...); runtime.Goexit() }
func (t *benchTB) Fatalf(f string, a ...any) {
	t.Errorf(f, a...)
	runtime.Goexit()
}
func (t *benchTB) Helper()                  {}
func (t *benchTB) Log(args ...any)          { fmt.Fprintln(t.log, args...) }
func (t *benchTB) Logf(f string, a ...any)  { fmt.Fprintf(t.log, f+"\n", a...) }
func (t *benchTB) Name() string             { return t.name }
func (t *benchTB) Setenv(k, v string)       { t.Fatalf("Setenv(%s) is not available to a bench", k) }
func (t *benchTB) Chdir(dir string)         { t.Fatalf("Chdir(%s) is not available to a bench", dir) }
func (t *benchTB) Skip(args ...any)         { t.record(false, fmt.Sprint(args...)); runtime.Goexit() }
func (t *benchTB) SkipNow()                 { t.record(false, errSkipNow.Error()); runtime.Goexit() }
func (t *benchTB) Skipf(f string, a ...any) { t.record(false, fmt.Sprintf(f, a...)); runtime.Goexit() }
func (t *benchTB) Skipped() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return !t.failed && len(t.errs) > 0
}
func (t *benchTB) Context() context.Context { return t.ctx }
func (t *benchTB) Output() io.Writer        { return t.log }

// TempDir makes a directory below the bench's, removed by cleanup.
func (t *benchTB) TempDir() string {
	t.mu.Lock()
	t.tmp++
	n := t.tmp
	t.mu.Unlock()
	d, err := os.MkdirTemp(t.dir, fmt.Sprintf("%s-%03d-", t.name, n))
	if err != nil {
		t.Fatalf("TempDir: %v", err)
	}
	t.Cleanup(func() {
		if err := os.RemoveAll(d); err != nil {
			t.Errorf("remove %s: %v", d, err)
		}
	})
	return d
}
