package gvisor

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/failpoint"
	"github.com/cubesandbox/cube/internal/runtime"
	"github.com/cubesandbox/cube/internal/runtime/cgroups"
)

// slotFiles says which of sandbox id's runsc slots have a state file.
func slotFiles(d *Driver, id string) [2]bool {
	var out [2]bool
	for i, rid := range slotIDs(id) {
		_, err := os.Stat(d.statePath(rid))
		out[i] = err == nil
	}
	return out
}

// waitReaped waits for the background reaps of sandbox id to finish.
func waitReaped(t *testing.T, d *Driver, id string) {
	t.Helper()
	for _, rid := range slotIDs(id) {
		d.reapMu.Lock()
		done := d.reaps[rid]
		d.reapMu.Unlock()
		if done == nil {
			continue
		}
		select {
		case <-done:
		case <-time.After(time.Minute):
			t.Fatalf("background reap of %s still running after a minute", rid)
		}
	}
}

// TestRestoreSwapsSlots: a snapshot that keeps the sandbox running
// restores it into its other runsc slot, and the checkpointed one is
// deleted in the background: each round the sandbox runs on (memory and
// files intact) in the slot the previous round did not use, the other
// slot's state is gone once the reap finished, List names the sandbox
// once, and the restored copy runs in the sandbox's cgroup with its
// limits. A Stop right after a swap (racing the background delete) leaves
// nothing (checked by newTestDriver and cgroupParent).
func TestRestoreSwapsSlots(t *testing.T) {
	requireRunsc(t)
	d, parent := newTestDriver(t), cgroupParent(t)
	id := "swap"
	spec := startCounter(t, d, parent, id)
	prev := readState(t, d, id)
	for r := range 3 {
		dir := filepath.Join(t.TempDir(), "img")
		if err := d.Checkpoint(t.Context(), id, dir, true); err != nil {
			t.Fatalf("round %d: Checkpoint: %v", r, err)
		}
		_, rid, _, err := d.lookup(t.Context(), id)
		if err != nil {
			t.Fatal(err)
		}
		if want := slotIDs(id)[(r+1)%2]; rid != want {
			t.Fatalf("round %d: restored into %s, want %s", r, rid, want)
		}
		prev = wantContinued(t, d, id, prev)
		waitReaped(t, d, id)
		files := slotFiles(d, id)
		if files[r%2] || !files[(r+1)%2] {
			t.Fatalf("round %d: slot state files %v after the reap; want only %s", r, files, rid)
		}
		all, err := d.List(t.Context())
		if err != nil || len(all) != 1 || all[0].ID != id || all[0].Status != runtime.StatusRunning {
			t.Fatalf("round %d: List = %+v, %v; want %s running once", r, all, err, id)
		}
		t.Logf("round %d: running in slot %s, memory intact, old slot reaped", r, rid)
	}
	st, err := cgroups.ReadStats(mustMounts(t), spec.CgroupPath)
	if err != nil {
		t.Fatal(err)
	}
	// The limit set at start (the guest's plus the sentry overhead) holds.
	if want := spec.Limits.MemoryMiB<<20 + d.MemoryOverhead(); st.MemoryLimit != want || st.Pids == 0 {
		t.Fatalf("cgroup %s after the swaps: limit %d, %d tasks; want %d and the sandbox's processes",
			spec.CgroupPath, st.MemoryLimit, st.Pids, want)
	}
	// Stop while the background delete of the last swap is in flight.
	if err := d.Checkpoint(t.Context(), id, filepath.Join(t.TempDir(), "img"), true); err != nil {
		t.Fatal(err)
	}
	if err := d.Stop(t.Context(), id); err != nil {
		t.Fatalf("Stop racing the background reap: %v", err)
	}
	if files := slotFiles(d, id); files[0] || files[1] {
		t.Fatalf("after Stop: slot state files %v; want none", files)
	}
}

// TestRetiredSlotReapedAfterCrash: the background delete of the retired
// slot fails (or the process that ran it died): the retired slot is left
// next to the running copy. The sandbox still reads as running, once in
// List; a new driver on the same root (cubelet restarted) reaps the
// retired slot with ReapRetired, the sandbox untouched. A restore in place
// cut short between the retirement and the launch (its caller killed)
// leaves the retired slot alone; a new driver's RestoreInPlace finishes
// it. Nothing is left after Stop.
func TestRetiredSlotReapedAfterCrash(t *testing.T) {
	requireRunsc(t)
	d, parent := newTestDriver(t), cgroupParent(t)
	id := "swap-crash"
	startCounter(t, d, parent, id)
	prev := readState(t, d, id)

	boom := errors.New("reap failed (test)")
	if err := failpoint.EnableFunc(FailpointReap, func(context.Context) error { return boom }); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { failpoint.Disable(FailpointReap) })
	if err := d.Checkpoint(t.Context(), id, filepath.Join(t.TempDir(), "img"), true); err != nil {
		t.Fatal(err)
	}
	waitReaped(t, d, id)
	failpoint.Disable(FailpointReap)
	if files := slotFiles(d, id); !files[0] || !files[1] {
		t.Fatalf("failed reap: slot state files %v; want both", files)
	}
	if all, err := d.List(t.Context()); err != nil || len(all) != 1 || all[0].Status != runtime.StatusRunning {
		t.Fatalf("List with a retired slot = %+v, %v; want the sandbox once, running", all, err)
	}
	prev = wantContinued(t, d, id, prev)

	restarted, err := New(Config{Root: d.root, Checkpoint: true, Logger: slog.New(slog.NewTextHandler(tWriter{t}, nil))})
	if err != nil {
		t.Fatal(err)
	}
	if err := restarted.ReapRetired(t.Context()); err != nil {
		t.Fatalf("ReapRetired: %v", err)
	}
	if files := slotFiles(d, id); files[0] || !files[1] {
		t.Fatalf("after ReapRetired: slot state files %v; want only slot B", files)
	}
	prev = wantContinued(t, d, id, prev)
	t.Logf("failed background reap: retired slot left, reaped at restart, sandbox ran on")

	// A restore in place killed after the retirement, before the launch.
	dir := filepath.Join(t.TempDir(), "img")
	if err := d.Checkpoint(t.Context(), id, dir, false); err != nil {
		t.Fatal(err)
	}
	if err := failpoint.Enable(FailpointRestoreStopped, "error(crash)"); err != nil {
		t.Fatal(err)
	}
	if _, err := d.RestoreInPlace(t.Context(), id, dir); err == nil {
		t.Fatal("RestoreInPlace survived its failpoint")
	}
	failpoint.Disable(FailpointRestoreStopped)
	if st, err := d.State(t.Context(), id); err != nil || st.Status != runtime.StatusStopped {
		t.Fatalf("cut-short restore: %+v, %v; want stopped", st, err)
	}
	restarted, err = New(Config{Root: d.root, Checkpoint: true, Logger: slog.New(slog.NewTextHandler(tWriter{t}, nil))})
	if err != nil {
		t.Fatal(err)
	}
	if err := restarted.ReapRetired(t.Context()); err != nil {
		t.Fatalf("ReapRetired: %v", err)
	}
	if _, err := restarted.RestoreInPlace(t.Context(), id, dir); err != nil {
		t.Fatalf("RestoreInPlace after the cut-short one: %v", err)
	}
	wantContinued(t, restarted, id, prev)
	if err := restarted.Stop(t.Context(), id); err != nil {
		t.Fatal(err)
	}
	if files := slotFiles(d, id); files[0] || files[1] {
		t.Fatalf("after Stop: slot state files %v; want none", files)
	}
	t.Logf("cut-short restore in place: finished by a new driver, nothing left after Stop")
}

func mustMounts(t *testing.T) []string {
	t.Helper()
	m, err := cgroups.Mounts()
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// TestSwapWaitsForReapInFlight: runsc's delete of a retired slot removes
// its state file before it returns, so a background reap can still be in
// flight on a slot lookup no longer sees. The reap here removes the state
// file and then blocks (its failpoint) until released a second later: the
// next swap, which launches into that very slot, and Stop each return only
// after the release, and the sandbox runs on after the swap (a launch that
// did not wait would have the reap delete the slot it now runs in).
func TestSwapWaitsForReapInFlight(t *testing.T) {
	requireRunsc(t)
	d, parent := newTestDriver(t), cgroupParent(t)
	id := "swap-inflight"
	startCounter(t, d, parent, id)
	prev := readState(t, d, id)
	const hold = time.Second
	// blockReap makes the next background reap remove its slot's state
	// file, as runsc's delete does first, then wait for release.
	blockReap := func(rid string) (release func()) {
		ch := make(chan struct{})
		if err := failpoint.EnableFunc(FailpointReap, func(ctx context.Context) error {
			if err := os.Remove(d.statePath(rid)); err != nil {
				return err
			}
			select {
			case <-ch:
			case <-ctx.Done():
			}
			return nil
		}); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { failpoint.Disable(FailpointReap) })
		return func() { close(ch) }
	}
	for _, step := range []string{"swap", "stop"} {
		_, cur, _, err := d.lookup(t.Context(), id)
		if err != nil {
			t.Fatal(err)
		}
		release := blockReap(cur)
		if err := d.Checkpoint(t.Context(), id, filepath.Join(t.TempDir(), "img"), true); err != nil {
			t.Fatalf("%s: Checkpoint: %v", step, err)
		}
		// The reap runs in the background: wait until it removed the file.
		for end := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
			_, _, retired, err := d.lookup(t.Context(), id)
			if err == nil && retired == "" {
				break
			}
			if time.Now().After(end) {
				t.Fatalf("%s: lookup = retired %q, %v; want the retired slot's state gone while its reap runs", step, retired, err)
			}
		}
		failpoint.Disable(FailpointReap)
		go func() { time.Sleep(hold); release() }()
		begin := time.Now()
		switch step {
		case "swap":
			err = d.Checkpoint(t.Context(), id, filepath.Join(t.TempDir(), "img"), true)
		case "stop":
			err = d.Stop(t.Context(), id)
		}
		took := time.Since(begin)
		t.Logf("%s with a reap in flight on a slot lookup does not see: %v after %s", step, err, took.Round(time.Millisecond))
		if err != nil {
			t.Fatalf("%s: %v", step, err)
		}
		if took < hold*9/10 {
			t.Fatalf("%s returned after %s, before the reap in flight ended (%s)", step, took, hold)
		}
		if step == "swap" {
			waitReaped(t, d, id)
			prev = wantContinued(t, d, id, prev)
		}
	}
	if files := slotFiles(d, id); files[0] || files[1] {
		t.Fatalf("after Stop: slot state files %v; want none", files)
	}
}

// TestNoLockLeftByRacingVerbs: runsc creates a slot's lock file before it
// finds the slot's state, so a `runsc list` that ran while a background
// reap deleted a retired slot left the lock file behind (one round in ten
// here). List now reads the state files and never runs runsc: rounds of
// swaps, each followed at once by Lists racing its reap, leave no lock
// file of a retired slot. A lock file another runsc left anyway (planted
// here, as runsc leaves it: empty, no state) is removed by Stop, and the
// root is empty after it (newTestDriver's check).
func TestNoLockLeftByRacingVerbs(t *testing.T) {
	requireRunsc(t)
	d, parent := newTestDriver(t), cgroupParent(t)
	id := "swap-locks"
	startCounter(t, d, parent, id)
	for r := range 10 {
		if err := d.Checkpoint(t.Context(), id, filepath.Join(t.TempDir(), "img"), true); err != nil {
			t.Fatal(err)
		}
		for range 8 {
			if all, err := d.List(t.Context()); err != nil || len(all) != 1 || all[0].ID != id {
				t.Fatalf("round %d: List = %+v, %v; want %s once", r, all, err, id)
			}
		}
		waitReaped(t, d, id)
		_, cur, _, err := d.lookup(t.Context(), id)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := os.Stat(d.lockPath(otherSlot(id, cur))); err == nil {
			t.Fatalf("round %d: the retired slot's lock file is left after its reap", r)
		}
	}
	_, cur, _, err := d.lookup(t.Context(), id)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(d.lockPath(otherSlot(id, cur)), nil, 0o640); err != nil {
		t.Fatal(err)
	}
	if err := d.Stop(t.Context(), id); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(d.lockPath(otherSlot(id, cur))); err == nil {
		t.Fatal("Stop left the stale lock file of the other slot")
	}
}
