package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	pb "github.com/cubesandbox/cube/api/cubelet/v1"
	"github.com/cubesandbox/cube/internal/agent/agenttest"
	"github.com/cubesandbox/cube/internal/cubelet"
	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
	"github.com/cubesandbox/cube/internal/runtime/vm"
	"github.com/cubesandbox/cube/internal/sandbox"
)

// vmPoolEntries lists the QEMU pids of the node's VM pool entries (the
// vm driver's state, which names them by the entry's ID).
func vmPoolEntries(t *testing.T, env *cubelettest.Env) map[string]int {
	t.Helper()
	ents, _ := os.ReadDir(env.Config.VM.Root)
	out := map[string]int{}
	for _, e := range ents {
		if !strings.HasPrefix(e.Name(), "pool-") {
			continue
		}
		var st struct {
			PID int `json:"pid"`
		}
		if b, err := os.ReadFile(filepath.Join(env.Config.VM.Root, e.Name(), "state.json")); err == nil && json.Unmarshal(b, &st) == nil {
			out[e.Name()] = st.PID
		}
	}
	return out
}

// vmShell runs script in the VM sandbox sb through its slot address, with
// its access token.
func vmShell(t *testing.T, svc *cubelet.Service, sb *sandbox.Record, script string) string {
	t.Helper()
	hc := tokenClient(sb.AccessToken)
	defer hc.CloseIdleConnections()
	return strings.TrimSpace(agenttest.Shell(context.Background(), t, hc, agentURL(t, svc, sb.ID, ""), script))
}

// TestWarmPoolVM: a VM template keeps a pool only while it is warm, its
// entries are clones of the warm snapshot (they map the template's RAM)
// paused with QMP stop, and a claimed one is indistinguishable from a
// cold create of a warm template (the control, in the same run): hostname,
// env, token, its own MAC, the snapshot's shape. Close leaves no entry,
// a crashed cubelet's entry is adopted and claimed by the next, a
// template pooled on runc and then warmed on vm replaces its runc entries
// by VM clones, and a template delete drains the pool.
func TestWarmPoolVM(t *testing.T) {
	env, svc := vmEnv(t, strings.ReplaceAll(poolTOML, "busybox = 2", "vmpool = 1\nrcpool = 1"))
	ctx := context.Background()
	for _, id := range []string{"vmpool", "vmplain"} { // vmplain: warm, no pool: the control
		if _, err := svc.ImportTemplateFrom(ctx, cubelet.TemplateImport{TemplateID: id, Source: env.Image, Runtime: "vm"}, nil); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		if entries := vmPoolEntries(t, env); len(entries) != 0 {
			t.Errorf("VM pool entries left: %v", entries)
		}
	})
	// Not warm: no pool (an entry would be a cold boot).
	time.Sleep(2 * time.Second)
	if n := svc.PoolReady("vmpool"); n != 0 || len(vmPoolEntries(t, env)) != 0 {
		t.Fatalf("pool of a VM template that is not warm: %d ready, entries %v", n, vmPoolEntries(t, env))
	}
	for _, id := range []string{"vmpool", "vmplain"} {
		start := time.Now()
		if _, err := svc.WarmTemplate(ctx, id, "vm"); err != nil {
			t.Fatalf("warm %s: %v", id, err)
		}
		t.Logf("warm %s: %v", id, time.Since(start))
	}
	start := time.Now()
	waitPool(t, svc, "vmpool", 1)
	t.Logf("pool filled (one clone, paused) %v after the warm", time.Since(start))
	entries := vmPoolEntries(t, env)
	if len(entries) != 1 {
		t.Fatalf("VM pool entries: %v", entries)
	}
	for id, pid := range entries {
		// What an unclaimed entry costs: its QEMU's Pss, of which the
		// share of the template's RAM (Pss_Shmem: mapped privately from
		// the shared file, so counted as file-backed shmem pages), and
		// its private dirty pages (its own however many QEMUs share
		// the binary and libraries; shmem pages mapped by it alone count
		// too).
		r, err := vm.SmapsRollup(pid)
		if err != nil {
			t.Fatal(err)
		}
		m, _ := vm.TemplateMapping(pid)
		t.Logf("pool entry %s (paused): Pss %.1f MiB, Pss_Shmem %.1f MiB, Rss %.1f MiB, Private_Dirty %.1f MiB; template mapping Rss %.1f MiB of which copied %.1f MiB",
			id, float64(r["Pss"])/1024, float64(r["Pss_Shmem"])/1024, float64(r["Rss"])/1024, float64(r["Private_Dirty"])/1024, float64(m["Rss"])/1024, float64(m["Anonymous"])/1024)
		if m["Rss"] == 0 {
			t.Fatalf("pool entry %s maps none of the template's RAM: %v", id, m)
		}
	}

	var recs []*sandbox.Record
	for _, c := range []struct{ tmpl, id string }{{"vmpool", "vm-pooled"}, {"vmplain", "vm-cold"}} {
		start := time.Now()
		res, err := svc.Create(ctx, cubelet.CreateRequest{SandboxID: c.id, TemplateID: c.tmpl, Runtime: "vm",
			Env: map[string]string{"FOO": "bar"}, AccessToken: "tok-" + c.id})
		if err != nil {
			t.Fatalf("create %s: %v", c.id, err)
		}
		took := time.Since(start)
		cleanupDelete(t, svc, c.id)
		if res.Pooled != (c.tmpl == "vmpool") || !res.Warm || res.Sandbox.Runtime != "vm" { // both restored from a warm snapshot
			t.Fatalf("%s: pooled %v warm %v runtime %s", c.id, res.Pooled, res.Warm, res.Sandbox.Runtime)
		}
		t.Logf("%s: create %v; timings %+v", c.id, took, res.Timings)
		recs = append(recs, res.Sandbox)
	}
	pooled, cold := recs[0], recs[1]
	// What an unclaimed entry costs against a paused sandbox created from
	// the warm template (the control, paused for the measure).
	if _, err := svc.Pause(ctx, cold.ID); err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Second)
	if r, err := vm.SmapsRollup(cold.Container.PID); err == nil {
		t.Logf("%s (warm create, paused): Pss %.1f MiB, Pss_Shmem %.1f MiB, Rss %.1f MiB, Private_Dirty %.1f MiB",
			cold.ID, float64(r["Pss"])/1024, float64(r["Pss_Shmem"])/1024, float64(r["Rss"])/1024, float64(r["Private_Dirty"])/1024)
	}
	if _, err := svc.Resume(ctx, cold.ID); err != nil {
		t.Fatal(err)
	}
	if pooled.Resources != cold.Resources || pooled.SourceSnapshotID == "" || pooled.HostKey() == pooled.ID {
		t.Fatalf("pooled %+v (source %q, host key %q), cold %+v", pooled.Resources, pooled.SourceSnapshotID, pooled.HostKey(), cold.Resources)
	}
	macs := map[string]string{}
	for i, sb := range recs {
		out := vmShell(t, svc, sb, "hostname; echo FOO=$FOO; echo ID=$CUBE_SANDBOX_ID; echo T=$CUBE_TEMPLATE_ID")
		if want := sb.ID + "\nFOO=bar\nID=" + sb.ID + "\nT=" + sb.TemplateID; out != want {
			t.Fatalf("%s: %q, want %q", sb.ID, out, want)
		}
		wantRefused(t, svc, sb.ID, "", recs[1-i].AccessToken)
		wantServed(t, svc, sb.ID, sb.AccessToken)
		mac := vmShell(t, svc, sb, "cat /sys/class/net/eth0/address")
		if prev, dup := macs[mac]; dup || mac == "" {
			t.Fatalf("%s: eth0 %q (also %s's)", sb.ID, mac, prev)
		}
		macs[mac] = sb.ID
	}

	// Refill, then the claimed sandbox pauses, resumes and deletes like
	// any other.
	waitPool(t, svc, "vmpool", 1)
	if _, err := svc.Pause(ctx, pooled.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := svc.Resume(ctx, pooled.ID); err != nil {
		t.Fatal(err)
	}
	if got := vmShell(t, svc, pooled, "hostname"); got != pooled.ID {
		t.Fatalf("hostname after resume %q", got)
	}
	for _, sb := range recs {
		if _, err := svc.Delete(ctx, sb.ID); err != nil {
			t.Fatal(err)
		}
	}

	// A template pooled on runc and then warmed on vm: the runc entry,
	// which its creates would no longer claim, is destroyed, and the pool
	// refills with VM clones that serve them.
	env.ImportBusybox(t, svc, "rcpool")
	waitPool(t, svc, "rcpool", 1)
	var runcEntry string
	for _, id := range poolContainers(t, env) {
		if _, isVM := vmPoolEntries(t, env)[id]; !isVM {
			runcEntry = id
		}
	}
	if runcEntry == "" {
		t.Fatalf("no runc pool entry for rcpool: %v", poolContainers(t, env))
	}
	if _, err := svc.WarmTemplate(ctx, "rcpool", "vm"); err != nil {
		t.Fatalf("warm rcpool: %v", err)
	}
	for deadline := time.Now().Add(time.Minute); ; {
		_, err := os.Stat(filepath.Join(env.Config.Node.RunDir, "sandboxes", runcEntry))
		if os.IsNotExist(err) && svc.PoolReady("rcpool") == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after warming rcpool on vm: runc entry %s: %v; pool %+v", runcEntry, err, svc.Pools())
		}
		time.Sleep(50 * time.Millisecond)
	}
	res, err := svc.Create(ctx, cubelet.CreateRequest{SandboxID: "vm-rc", TemplateID: "rcpool", AccessToken: "tok-rc"})
	if err != nil || !res.Pooled || res.Sandbox.Runtime != "vm" {
		t.Fatalf("create of rcpool after its warm: %+v, %v", res, err)
	}
	if got := vmShell(t, svc, res.Sandbox, "hostname"); got != res.Sandbox.ID {
		t.Fatalf("hostname %q", got)
	}
	if _, err := svc.Delete(ctx, res.Sandbox.ID); err != nil {
		t.Fatal(err)
	}
	if err := svc.DeleteTemplate(ctx, "rcpool"); err != nil {
		t.Fatal(err)
	}

	// Close destroys every entry; a template delete drains the pool.
	if err := svc.Close(); err != nil {
		t.Fatal(err)
	}
	if left := vmPoolEntries(t, env); len(left) != 0 {
		t.Fatalf("VM pool entries after Close: %v", left)
	}

	// A crashed cubelet's entries (QEMU outlives it) are adopted by the
	// next one, not refilled, and serve a create.
	extra := fmt.Sprintf("[vm]\nguest_dir = %q\naccel = %q\n[sandbox]\nagent_ready_timeout = \"120s\"\n[network]\nagent_socket = %q\n%s",
		env.Config.VM.GuestDir, env.Config.VM.Accel, env.Config.Network.AgentSocket, strings.ReplaceAll(poolTOML, "busybox = 2", "vmpool = 1"))
	d := startDaemon(t, env, env.WriteConfig(t, extra), "")
	for deadline := time.Now().Add(2 * time.Minute); ; {
		r, err := d.client.GetTemplate(ctx, &pb.GetTemplateRequest{TemplateId: "vmpool"})
		if err == nil && r.Template.PoolReady == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("daemon's pool: %v, %v\n%s", r, err, tail(d.log))
		}
		time.Sleep(50 * time.Millisecond)
	}
	before := vmPoolEntries(t, env)
	d.kill()
	svc = env.Start(t)
	waitPool(t, svc, "vmpool", 1)
	if st := svc.Pools(); len(st) == 0 || st[0].Refills != 0 {
		t.Fatalf("restart refilled instead of adopting: %+v (entries before %v, now %v)", st, before, vmPoolEntries(t, env))
	}
	res, err = svc.Create(ctx, cubelet.CreateRequest{SandboxID: "vm-after-restart", TemplateID: "vmpool", AccessToken: "tok-after"})
	if err != nil || !res.Pooled {
		t.Fatalf("create after restart: pooled %v, %v", res != nil && res.Pooled, err)
	}
	if got := vmShell(t, svc, res.Sandbox, "hostname"); got != res.Sandbox.ID {
		t.Fatalf("hostname after restart claim %q", got)
	}
	if _, err := svc.Delete(ctx, res.Sandbox.ID); err != nil {
		t.Fatal(err)
	}
	waitPool(t, svc, "vmpool", 1)
	if err := svc.DeleteTemplate(ctx, "vmpool"); err != nil {
		t.Fatalf("delete template: %v", err)
	}
	if left := vmPoolEntries(t, env); len(left) != 0 {
		t.Fatalf("VM pool entries after template delete: %v", left)
	}
	if err := svc.DeleteTemplate(ctx, "vmplain"); err != nil {
		t.Fatal(err)
	}
	env.AssertNoLeaks(t)
}
