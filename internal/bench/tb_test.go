package bench

import (
	"bytes"
	"context"
	"errors"
	"os"
	"strings"
	"testing"
)

// The cluster harness ends its goroutine on Fatal and Skip and leaves
// teardown to Cleanup: benchTB must turn those into errors and run the
// cleanups newest first, a Fatal in one not stopping the others.
func TestBenchTB(t *testing.T) {
	var log bytes.Buffer
	tb := newBenchTB(context.Background(), "x", t.TempDir(), &log)
	var order []int
	var dir string
	err := tb.do(func() {
		tb.Cleanup(func() { order = append(order, 1) })
		tb.Cleanup(func() { order = append(order, 2); tb.Fatal("cleanup two failed") })
		tb.Cleanup(func() { order = append(order, 3) })
		dir = tb.TempDir()
		tb.Logf("about to fail %d", 42)
		tb.Fatalf("boom %d", 7)
		order = append(order, 99) // never: Fatal ends the goroutine
	})
	if err == nil || errors.Is(err, ErrSkip) || !strings.Contains(err.Error(), "boom 7") {
		t.Fatalf("do = %v, want the Fatal's message", err)
	}
	if _, err := os.Stat(dir); err != nil {
		t.Fatalf("TempDir %s: %v", dir, err)
	}
	cerr := tb.cleanup()
	if cerr == nil || !strings.Contains(cerr.Error(), "cleanup two failed") || strings.Contains(cerr.Error(), "boom") {
		t.Errorf("cleanup = %v, want only the cleanup's failure", cerr)
	}
	if got := order; len(got) != 3 || got[0] != 3 || got[1] != 2 || got[2] != 1 {
		t.Errorf("cleanups ran in order %v, want [3 2 1]", got)
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("TempDir %s left after cleanup: %v", dir, err)
	}
	if !strings.Contains(log.String(), "about to fail 42") {
		t.Errorf("log = %q", log.String())
	}

	skip := newBenchTB(context.Background(), "y", t.TempDir(), nil)
	if err := skip.do(func() { skip.Skip("no root") }); !errors.Is(err, ErrSkip) || !strings.Contains(err.Error(), "no root") {
		t.Errorf("skip: do = %v, want ErrSkip", err)
	}
	ok := newBenchTB(context.Background(), "z", t.TempDir(), nil)
	if err := ok.do(func() {}); err != nil || ok.cleanup() != nil {
		t.Errorf("nothing failed: %v", err)
	}
}
