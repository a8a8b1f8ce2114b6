package vm

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/runtime"
)

// TestRestoreFailures takes one checkpoint (of a VM still booting: a
// restore does not need the agent) and breaks restores of it in every way
// the driver must survive without leaving anything behind; newEnv's
// cleanup runs the leak checker over the whole test.
func TestRestoreFailures(t *testing.T) {
	e := newEnv(t)
	d, ctx := e.d, t.Context()
	src := e.spec(t, "src")
	stopAtEnd(t, d, src.ID)
	if _, err := d.Start(ctx, src); err != nil {
		t.Fatal(err)
	}
	img := filepath.Join(t.TempDir(), "img")
	if err := d.Checkpoint(ctx, src.ID, img, false); err != nil {
		t.Fatal(err)
	}

	gone := func(t *testing.T, s runtime.Spec) {
		t.Helper()
		if _, err := d.State(ctx, s.ID); !errdefs.IsNotFound(err) {
			t.Errorf("State(%s) after failed restore = %v, want ErrNotFound", s.ID, err)
		}
		wantNoFiles(t, s.BundleDir)
		// Its uid is free again: no allocation file names it.
		uids, _ := filepath.Glob(filepath.Join(d.uids.dir, "*"))
		for _, f := range uids {
			if b, _ := os.ReadFile(f); string(b) == d.stateDir(s.ID) {
				t.Errorf("failed restore of %s left its uid allocated: %s", s.ID, f)
			}
		}
	}
	variant := func(t *testing.T, edit func(dir string)) string {
		dir := filepath.Join(t.TempDir(), "img")
		if err := os.MkdirAll(dir, 0o700); err != nil {
			t.Fatal(err)
		}
		for _, f := range []string{MemoryFile, ShapeFile} {
			copyFile(t, filepath.Join(img, f), filepath.Join(dir, f))
		}
		edit(dir)
		return dir
	}

	t.Run("Corrupt", func(t *testing.T) {
		dir := variant(t, func(dir string) {
			f := filepath.Join(dir, MemoryFile)
			fi, _ := os.Stat(f)
			if err := os.Truncate(f, fi.Size()/2); err != nil {
				t.Fatal(err)
			}
		})
		s := e.spec(t, "corrupt")
		stopAtEnd(t, d, s.ID)
		_, err := d.Restore(ctx, s, dir)
		if err == nil {
			t.Fatal("restore of a truncated image succeeded")
		}
		t.Logf("truncated image: %v", err)
		gone(t, s)
	})
	t.Run("OtherAccel", func(t *testing.T) {
		dir := variant(t, func(dir string) {
			f := filepath.Join(dir, ShapeFile)
			b, _ := os.ReadFile(f)
			other := map[string]string{"tcg": "kvm", "kvm": "tcg"}[d.Accel()]
			b = []byte(strings.Replace(string(b), `"accel": "`+d.Accel()+`"`, `"accel": "`+other+`"`, 1))
			if err := os.WriteFile(f, b, 0o600); err != nil {
				t.Fatal(err)
			}
		})
		s := e.spec(t, "accel")
		stopAtEnd(t, d, s.ID)
		if _, err := d.Restore(ctx, s, dir); !errors.Is(err, errdefs.ErrFailedPrecondition) {
			t.Fatalf("restore of another accelerator's image = %v, want ErrFailedPrecondition", err)
		}
		gone(t, s)
	})
	t.Run("NoShape", func(t *testing.T) {
		dir := variant(t, func(dir string) { _ = os.Remove(filepath.Join(dir, ShapeFile)) })
		s := e.spec(t, "noshape")
		if _, err := d.Restore(ctx, s, dir); !errdefs.IsNotFound(err) {
			t.Fatalf("restore without vm.json = %v, want ErrNotFound", err)
		}
		gone(t, s)
	})
	t.Run("Cancelled", func(t *testing.T) {
		s := e.spec(t, "cancel")
		stopAtEnd(t, d, s.ID)
		cctx, cancel := context.WithCancel(ctx)
		defer cancel()
		// Cancel once QEMU exists: mid-launch or mid-load.
		go func() {
			for cctx.Err() == nil {
				if st, err := d.load(s.ID); err == nil && st.PID > 0 {
					cancel()
					return
				}
				time.Sleep(time.Millisecond)
			}
		}()
		_, err := d.Restore(cctx, s, img)
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("cancelled restore = %v, want context.Canceled", err)
		}
		gone(t, s)
	})
	t.Run("ShapeKept", func(t *testing.T) {
		s := e.spec(t, "shape")
		stopAtEnd(t, d, s.ID)
		s.Limits = runtime.Limits{MilliCPU: 2000, MemoryMiB: 512}
		st, err := d.Restore(ctx, s, img)
		if err != nil {
			t.Fatal(err)
		}
		note, _ := d.ShapeNote(s.ID)
		if !strings.Contains(note, "512 MiB asked, snapshot has 256 MiB") {
			t.Errorf("ShapeNote = %q", note)
		}
		cmd, _ := os.ReadFile(filepath.Join("/proc", itoa(st.PID), "cmdline"))
		if !strings.Contains(string(cmd), "\x00-m\x00256M\x00") || !strings.Contains(string(cmd), "\x00-smp\x001\x00") {
			t.Errorf("restored QEMU does not run the snapshot's shape: %q", cmd)
		}
		if err := inCgroup(s.CgroupPath, st.PID); err != nil {
			t.Error(err)
		}
		if err := d.Stop(ctx, s.ID); err != nil {
			t.Fatal(err)
		}
		gone(t, s)
	})
	t.Run("BadSpec", func(t *testing.T) {
		s := e.spec(t, "nodisk")
		s.Disk = ""
		if _, err := d.Start(ctx, s); !errdefs.IsInvalidArgument(err) {
			t.Errorf("Start without a disk = %v, want ErrInvalidArgument", err)
		}
		s = e.spec(t, "../x")
		if _, err := d.Start(ctx, s); !errdefs.IsInvalidArgument(err) {
			t.Errorf("Start with id ../x = %v, want ErrInvalidArgument", err)
		}
		if err := d.Pause(ctx, "absent"); !errdefs.IsNotFound(err) {
			t.Errorf("Pause(absent) = %v", err)
		}
		if err := d.Checkpoint(ctx, "absent", t.TempDir(), true); !errdefs.IsNotFound(err) {
			t.Errorf("Checkpoint(absent) = %v", err)
		}
	})
}

func itoa(i int) string { return strconv.Itoa(i) }
