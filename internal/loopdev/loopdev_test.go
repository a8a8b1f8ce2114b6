package loopdev

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/testenv"
)

func requireRoot(t *testing.T) {
	t.Helper()
	testenv.RequireRoot(t, "loop-control ioctls")
	if _, err := os.Stat(controlPath); err != nil {
		t.Skipf("no %s: %v", controlPath, err)
	}
}

func backingFile(t *testing.T, dir, name string) string {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(p, 1<<20); err != nil {
		t.Fatal(err)
	}
	return p
}

// detachAllUnder is the safety net: whatever a failed test left bound to a
// file in dir is unbound.
func detachAllUnder(t *testing.T, dir string) {
	t.Cleanup(func() {
		devs, _ := List()
		for _, d := range devs {
			if filepath.Dir(d.BackingFile) == dir {
				_ = Detach(d.Path)
			}
		}
	})
}

func TestAttachDetach(t *testing.T) {
	requireRoot(t)
	dir := t.TempDir()
	detachAllUnder(t, dir)
	f := backingFile(t, dir, "a.img")

	dev, err := Attach(context.Background(), f, true)
	if err != nil {
		t.Fatal(err)
	}
	found, err := FindByBacking(f)
	if err != nil || len(found) != 1 || found[0].Path != dev {
		t.Fatalf("FindByBacking = %v, %v; want [%s]", found, err, dev)
	}
	if _, err := os.ReadFile(fmt.Sprintf("/sys/block/%s/ro", filepath.Base(dev))); err != nil {
		t.Fatal(err)
	}
	if ro, _ := os.ReadFile(fmt.Sprintf("/sys/block/%s/ro", filepath.Base(dev))); string(ro) != "1\n" {
		t.Errorf("read-only attach: ro = %q", ro)
	}
	if err := Detach(dev); err != nil {
		t.Fatal(err)
	}
	if err := Detach(dev); err != nil {
		t.Fatalf("second Detach: %v", err)
	}
	if err := Detach("/dev/loop-does-not-exist"); err != nil {
		t.Fatalf("Detach of absent device: %v", err)
	}
	waitGone(t, f)
}

func TestAttachMissingFile(t *testing.T) {
	requireRoot(t)
	_, err := Attach(context.Background(), filepath.Join(t.TempDir(), "nope"), false)
	if !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("err = %v, want ErrNotFound", err)
	}
}

func TestAutoclearFreesOnLastClose(t *testing.T) {
	requireRoot(t)
	dir := t.TempDir()
	detachAllUnder(t, dir)
	f := backingFile(t, dir, "auto.img")

	var seen string
	dev, err := AttachAutoclear(context.Background(), f, false, func(dev string) error {
		seen = dev
		if got, _ := FindByBacking(f); len(got) != 1 {
			return fmt.Errorf("device not bound during use: %v", got)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if dev != seen {
		t.Fatalf("dev %s != seen %s", dev, seen)
	}
	waitGone(t, f)

	boom := errors.New("boom")
	if _, err := AttachAutoclear(context.Background(), f, false, func(string) error { return boom }); !errors.Is(err, boom) {
		t.Fatalf("err = %v, want boom", err)
	}
	waitGone(t, f)
}

func TestConcurrentAttach(t *testing.T) {
	requireRoot(t)
	const n = 50
	dir := t.TempDir()
	detachAllUnder(t, dir)
	files := make([]string, n)
	for i := range files {
		files[i] = backingFile(t, dir, fmt.Sprintf("c%02d.img", i))
	}

	devs := make([]string, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() { devs[i], errs[i] = Attach(context.Background(), files[i], false) })
	}
	wg.Wait()

	seen := map[string]int{}
	for i := range n {
		if errs[i] != nil {
			t.Errorf("attach %d: %v", i, errs[i])
			continue
		}
		if j, dup := seen[devs[i]]; dup {
			t.Errorf("%s handed to both %d and %d", devs[i], j, i)
		}
		seen[devs[i]] = i
		got, err := FindByBacking(files[i])
		if err != nil || len(got) != 1 || got[0].Path != devs[i] {
			t.Errorf("FindByBacking(%s) = %v, %v; want %s", files[i], got, err, devs[i])
		}
	}
	for i := range n {
		wg.Go(func() {
			if devs[i] != "" {
				if err := Detach(devs[i]); err != nil {
					t.Errorf("detach %s: %v", devs[i], err)
				}
			}
		})
	}
	wg.Wait()
	for _, f := range files {
		waitGone(t, f)
	}
}

func TestAttachHonoursContext(t *testing.T) {
	requireRoot(t)
	dir := t.TempDir()
	detachAllUnder(t, dir)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := Attach(ctx, backingFile(t, dir, "x.img"), false); !errors.Is(err, context.Canceled) {
		t.Fatalf("err = %v, want context.Canceled", err)
	}
}

// waitGone allows for the kernel finishing an autoclear/clear after the
// last close returned.
func waitGone(t *testing.T, file string) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		got, err := FindByBacking(file)
		if err != nil {
			t.Fatal(err)
		}
		if len(got) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s still bound: %v", file, got)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
