package vm

import (
	"log/slog"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/runtime"
)

// TestAdoptAndKillHung: a second driver on the same Root (a restarted
// cubelet) sees the VM, and stops it even when QEMU no longer answers QMP
// (SIGSTOPped): Stop falls back to SIGKILL and still removes everything.
func TestAdoptAndKillHung(t *testing.T) {
	e := newEnv(t)
	ctx := t.Context()
	s := e.spec(t, "hung")
	stopAtEnd(t, e.d, s.ID)
	st, err := e.d.Start(ctx, s)
	if err != nil {
		t.Fatal(err)
	}
	d2, err := New(Config{GuestDir: e.d.guestDir, Accel: e.d.accel, Root: e.d.root, Logger: slog.New(slog.NewTextHandler(tWriter{t}, nil))})
	if err != nil {
		t.Fatal(err)
	}
	all, err := d2.List(ctx)
	if err != nil || len(all) != 1 || all[0].ID != s.ID || all[0].PID != st.PID || all[0].Status != runtime.StatusRunning {
		t.Fatalf("second driver List = %+v, %v", all, err)
	}
	if err := syscall.Kill(st.PID, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	begin := time.Now()
	if err := d2.Stop(ctx, s.ID); err != nil {
		t.Fatalf("Stop of a hung QEMU: %v", err)
	}
	t.Logf("Stop of a hung QEMU took %v", time.Since(begin))
	if _, err := e.d.State(ctx, s.ID); !errdefs.IsNotFound(err) {
		t.Fatalf("State after Stop = %v", err)
	}
	// Not our child: its zombie, if any, is init's to reap.
	if alive(&vmState{PID: st.PID, QMP: filepath.Join(s.BundleDir, "qmp.sock")}) {
		t.Errorf("QEMU pid %d still runs", st.PID)
	}
	wantNoFiles(t, s.BundleDir)
}
