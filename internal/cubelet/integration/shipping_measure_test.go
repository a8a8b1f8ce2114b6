package integration

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/cubelet"
	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
	"github.com/cubesandbox/cube/internal/lifecycle"
	"github.com/cubesandbox/cube/internal/network/nettest"
	"github.com/cubesandbox/cube/internal/objstore/objstoretest"
	"github.com/cubesandbox/cube/internal/sandbox"
)

// TestMeasureCrossNodeResume times what docs/cluster.md reports as the
// cross-node resume of a 512 MiB gVisor guest: a sandbox with a 512 MiB
// memory limit is paused, snapshotted with its memory and exported as
// store.export_on_pause does (all before the clock starts), then resumed
// on a second node (its own pool, the same object store) under its own ID:
// the import of the snapshot, the restore, and the agent answering
// /health, timed from the import call to that answer. Two guests: "idle"
// (busybox and its agent) and "filled", whose guest wrote
// CUBE_XFER_FILL_MIB (320 by default) MiB of random bytes into a tmpfs
// (/tmp, memory of the guest), checked intact after the resume. It
// only runs with CUBE_XFER_MEASURE=<rounds>.
func TestMeasureCrossNodeResume(t *testing.T) {
	n := 0
	if _, err := fmt.Sscan(os.Getenv("CUBE_XFER_MEASURE"), &n); err != nil || n <= 0 {
		t.Skip("set CUBE_XFER_MEASURE=<rounds> to measure")
	}
	fill := 320
	if v := os.Getenv("CUBE_XFER_FILL_MIB"); v != "" {
		if _, err := fmt.Sscan(v, &fill); err != nil || fill <= 0 || fill > 480 {
			t.Fatalf("CUBE_XFER_FILL_MIB=%q: want 1..480", v)
		}
	}
	cubelettest.RequireRoot(t)
	requireRunsc(t)
	srv := objstoretest.Start(t)
	ctx := context.Background()
	start := func() *cubelet.Service {
		env := cubelettest.New(t, storeTOML(srv))
		env.StartNetworkAgent(t, nettest.Options{PoolSize: 2})
		svc := env.Start(t)
		env.ImportBusybox(t, svc, "busybox")
		t.Cleanup(func() {
			deleteAll(t, svc, mustList(t, svc))
			sns, _ := svc.ListSnapshots(ctx, cubelet.SnapshotFilter{})
			for _, sn := range sns {
				_ = svc.DeleteSnapshot(ctx, sn.ID)
			}
		})
		return svc
	}
	svc1, svc2 := start(), start()

	guests := []string{"idle", "filled"}
	if v := os.Getenv("CUBE_XFER_GUESTS"); v != "" {
		guests = strings.Split(v, ",")
	}
	for _, guest := range guests {
		for round := range n {
			id := fmt.Sprintf("xm-%s-%d", guest, round)
			a := mustCreate(t, svc1, cubelet.CreateRequest{SandboxID: id, Runtime: "gvisor", Resources: sandbox.Resources{MemoryMiB: 512}})
			agentReady(t, svc1, a.ID)
			want, path := "", ""
			if guest == "filled" {
				// gVisor mounts a tmpfs at /tmp: its pages are the
				// sandbox's memory, so they are in the memory image.
				// Written and digested in the background (longer than
				// one agent call may take under load), then polled.
				path = "/tmp/fill"
				if out := shell(t, svc1, a.ID, fmt.Sprintf(`grep -q ' /tmp tmpfs ' /proc/mounts || { echo /tmp is not a tmpfs; exit 0; }
(head -c %d /dev/urandom > %[2]s && md5sum %[2]s > %[2]s.sum.part && mv %[2]s.sum.part %[2]s.sum) </dev/null >/dev/null 2>&1 &`, fill<<20, path)); out != "" {
					t.Fatal(out)
				}
				for deadline := time.Now().Add(5 * time.Minute); want == ""; time.Sleep(time.Second) {
					if time.Now().After(deadline) {
						t.Fatalf("%s: filling %s with %d MiB did not finish", id, path, fill)
					}
					out := shell(t, svc1, a.ID, fmt.Sprintf(`cat %[1]s.sum 2>/dev/null && wc -c < %[1]s; true`, path))
					if sum, size, ok := strings.Cut(out, "\n"); ok {
						if strings.TrimSpace(size) != fmt.Sprint(fill<<20) {
							t.Fatalf("%s: %s holds %s bytes, want %d MiB", id, path, size, fill)
						}
						want, _, _ = strings.Cut(sum, " ")
					}
				}
			}
			if _, err := svc1.Pause(ctx, a.ID); err != nil {
				t.Fatal(err)
			}
			begin := time.Now()
			sn := mustSnapshot(t, svc1, cubelet.SnapshotRequest{SandboxID: a.ID})
			if !sn.HasMemory {
				t.Fatalf("snapshot %+v: want memory", sn)
			}
			tookSnap := time.Since(begin)
			begin = time.Now()
			_, etr, err := svc1.ExportSnapshot(ctx, sn.ID)
			if err != nil {
				t.Fatalf("export: %v", err)
			}
			tookExport := time.Since(begin)
			// As a move does: the original goes before the copy runs.
			if _, err := svc1.Delete(ctx, a.ID); err != nil {
				t.Fatal(err)
			}
			if err := svc1.DeleteSnapshot(ctx, sn.ID); err != nil {
				t.Fatal(err)
			}

			begin = time.Now()
			imp, err := svc2.ImportSnapshot(ctx, sn.ID, false)
			if err != nil {
				t.Fatalf("import: %v", err)
			}
			tookImport := time.Since(begin)
			if _, err := svc2.Clone(ctx, cubelet.CloneRequest{SnapshotID: sn.ID, Count: 1, SandboxIDs: []string{a.ID}}); err != nil {
				t.Fatalf("resume on node 2: %v", err)
			}
			tookClone := time.Since(begin) - tookImport
			agentReady(t, svc2, a.ID)
			total := time.Since(begin)
			t.Logf("%-6s round %d: snapshot %v, export %v (%d MiB logical, %.1f MiB stored, %.1f MiB sent); "+
				"RESUME ON NODE 2 %v = import %v (%.1f MiB received, %.1f MiB from the template) + restore %v + agent answers %v",
				guest, round, tookSnap.Round(time.Millisecond), tookExport.Round(time.Millisecond), etr.LogicalBytes>>20,
				float64(etr.StoredBytes)/(1<<20), float64(etr.Sent)/(1<<20),
				total.Round(time.Millisecond), tookImport.Round(time.Millisecond), float64(imp.Transfer.Received)/(1<<20),
				float64(imp.Transfer.Reused)/(1<<20), tookClone.Round(time.Millisecond),
				(total - tookImport - tookClone).Round(time.Millisecond))
			mustState(t, svc2, a.ID, lifecycle.Running)
			if want != "" {
				if sum, _, _ := strings.Cut(shell(t, svc2, a.ID, "md5sum "+path), " "); sum != want {
					t.Fatalf("%s: %s digests to %q after the resume, want %s", id, path, sum, want)
				}
			}
			if _, err := svc2.Delete(ctx, a.ID); err != nil {
				t.Fatal(err)
			}
			if err := svc2.DeleteSnapshot(ctx, sn.ID); err != nil {
				t.Fatal(err)
			}
			if err := svc2.DeleteExported(ctx, sn.ID); err != nil {
				t.Fatal(err)
			}
		}
	}
}
