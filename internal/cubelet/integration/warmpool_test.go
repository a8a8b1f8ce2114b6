package integration

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	pb "github.com/cubesandbox/cube/api/cubelet/v1"
	"github.com/cubesandbox/cube/internal/agentproto"
	"github.com/cubesandbox/cube/internal/cubelet"
	"github.com/cubesandbox/cube/internal/cubelet/actions"
	"github.com/cubesandbox/cube/internal/cubelet/agentclient"
	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/network/nettest"
	"github.com/cubesandbox/cube/internal/network/policy"
	"github.com/cubesandbox/cube/internal/nsdial"
	"github.com/cubesandbox/cube/internal/runtime/cgroups"
	"github.com/cubesandbox/cube/internal/sandbox"
)

const poolTOML = `
[warm_pool]
max = 3
refill_interval = "0s"
[warm_pool.templates]
busybox = 2
`

// waitPool waits until template id's pool holds want ready entries.
func waitPool(t *testing.T, svc *cubelet.Service, id string, want int) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for svc.PoolReady(id) != want {
		if time.Now().After(deadline) {
			t.Fatalf("pool of %s: %d ready, want %d (%+v)", id, svc.PoolReady(id), want, svc.Pools())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// poolContainers lists the runc containers of pool entries on the node
// (their run directories).
func poolContainers(t *testing.T, env *cubelettest.Env) []string {
	t.Helper()
	ents, _ := os.ReadDir(filepath.Join(env.Config.Node.RunDir, "sandboxes"))
	var out []string
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), "pool-") {
			out = append(out, e.Name())
		}
	}
	return out
}

// cgroupValue reads a file of the sandbox's cgroup in whichever hierarchy
// has it.
func cgroupValue(t *testing.T, sb *sandbox.Record, names ...string) string {
	t.Helper()
	dirs, err := cgroups.Dirs(sb.Container.CgroupPath)
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range dirs {
		for _, n := range names {
			if b, err := os.ReadFile(filepath.Join(d, n)); err == nil {
				return strings.TrimSpace(string(b))
			}
		}
	}
	t.Fatalf("no %v under %v", names, dirs)
	return ""
}

// TestWarmPool: a sandbox claimed from a warm pool is indistinguishable
// from a cold one to whoever uses it (hostname, env through the agent,
// files, limits, access token, network policy), the pool refills, its
// entries are hidden from every listing and count, and none is left after
// the template's delete. The control is a cold create of the same image
// under a template without a pool, in the same run.
func TestWarmPool(t *testing.T) {
	env := cubelettest.New(t, poolTOML)
	_ = env.StartNetworkAgent(t, nettest.Options{PoolSize: 8})
	svc := env.Start(t)
	env.ImportBusybox(t, svc, "busybox")
	env.ImportBusybox(t, svc, "cold") // no pool: the control
	ctx := context.Background()
	w := nettest.NewWorld(t)
	waitPool(t, svc, "busybox", 2)

	// Hidden: no listing, count or lookup shows an entry.
	if l, _ := svc.List(ctx, cubelet.ListFilter{}); len(l) != 0 {
		t.Fatalf("pool entries listed: %+v", l)
	}
	if info, _ := svc.Info(ctx); len(info.SandboxesByState) != 0 {
		t.Fatalf("pool entries counted: %+v", info.SandboxesByState)
	}
	entries := poolContainers(t, env)
	if len(entries) != 2 {
		t.Fatalf("pool run directories: %v", entries)
	}
	for _, id := range entries {
		// What an unclaimed entry costs: its cgroup's memory (page cache
		// included), compared below with a paused cold sandbox's.
		used, _ := cgroups.MemoryUsage("/" + env.Config.Node.CgroupParent + "/" + id)
		t.Logf("pool entry %s (frozen): cgroup memory %.1f MiB", id, float64(used)/(1<<20))
	}
	if got := gaugeValue(t, svc, "cubelet_warm_pool_ready", "busybox"); got != 2 {
		t.Fatalf("cubelet_warm_pool_ready{template=busybox} = %v, want 2", got)
	}
	if _, err := svc.Get(ctx, entries[0]); !errdefs.IsNotFound(err) {
		t.Fatalf("get of a pool entry: %v", err)
	}
	if _, err := svc.Delete(ctx, entries[0]); !errdefs.IsNotFound(err) {
		t.Fatalf("delete of a pool entry: %v", err)
	}
	if rep := svc.NodeReport(ctx); len(rep.SandboxesByState) != 0 {
		t.Fatalf("node report counts pool entries: %+v", rep.SandboxesByState)
	} else {
		for _, tr := range rep.Templates {
			if tr.Id == "busybox" && tr.Pool != 2 {
				t.Fatalf("node report: busybox pool %d, want 2", tr.Pool)
			}
		}
	}

	no := false
	req := func(tmpl, id, token string) cubelet.CreateRequest {
		return cubelet.CreateRequest{
			SandboxID: id, TemplateID: tmpl, Labels: map[string]string{"team": "a"},
			Env:         map[string]string{"FOO": "bar"},
			Resources:   sandbox.Resources{MilliCPU: 500, MemoryMiB: 96, Pids: 77},
			Network:     netPolicy(t, policy.Spec{AllowInternet: &no, Allow: []string{cidr(w.Addrs[0])}}),
			AccessToken: token,
		}
	}
	warmRes, err := svc.Create(ctx, req("busybox", "pooled-one", "tok-pooled"))
	if err != nil {
		t.Fatalf("pooled create: %v", err)
	}
	coldRes, err := svc.Create(ctx, req("cold", "cold-one", "tok-cold"))
	if err != nil {
		t.Fatalf("cold create: %v", err)
	}
	cleanupDelete(t, svc, "pooled-one")
	cleanupDelete(t, svc, "cold-one")
	if !warmRes.Pooled || coldRes.Pooled {
		t.Fatalf("pooled: warm %v cold %v", warmRes.Pooled, coldRes.Pooled)
	}
	t.Logf("pooled create timings: %+v", warmRes.Timings)
	if _, err := svc.Pause(ctx, "cold-one"); err != nil {
		t.Fatal(err)
	}
	used, _ := cgroups.MemoryUsage(coldRes.Sandbox.Container.CgroupPath)
	t.Logf("cold sandbox, paused: cgroup memory %.1f MiB", float64(used)/(1<<20))
	if _, err := svc.Resume(ctx, "cold-one"); err != nil {
		t.Fatal(err)
	}
	t.Logf("cold create timings: %+v", coldRes.Timings)

	for _, sb := range []*sandbox.Record{warmRes.Sandbox, coldRes.Sandbox} {
		t.Run(sb.ID, func(t *testing.T) {
			// Identity and env as the agent's processes see them.
			out := shInTok(t, sb, sb.AccessToken, "hostname; echo FOO=$FOO; echo ID=$CUBE_SANDBOX_ID; echo T=$CUBE_TEMPLATE_ID; ls /; id -u")
			want := "" + sb.ID + "\nFOO=bar\nID=" + sb.ID + "\nT=" + sb.TemplateID + "\n"
			if !strings.HasPrefix(out, want) {
				t.Fatalf("identity: %q, want prefix %q", out, want)
			}
			t.Logf("%s: %q", sb.ID, out)
			// Limits.
			if v := cgroupValue(t, sb, "pids.max"); v != "77" {
				t.Fatalf("pids.max %q, want 77", v)
			}
			if v := cgroupValue(t, sb, "memory.limit_in_bytes", "memory.max"); v != "100663296" {
				t.Fatalf("memory limit %q, want 96 MiB", v)
			}
			if v := cgroupValue(t, sb, "cpu.cfs_quota_us", "cpu.max"); !regexp.MustCompile(`^50000( 100000)?$`).MatchString(v) {
				t.Fatalf("cpu quota %q, want 50000 per 100000", v)
			}
			// Token: refused without it (and with the other sandbox's), served with it.
			wantRefused(t, svc, sb.ID, "", "tok-"+map[bool]string{true: "cold", false: "pooled"}[sb.ID == "pooled-one"])
			wantServed(t, svc, sb.ID, sb.AccessToken)
			// Network policy.
			p := sbProbe{t: t, pid: sb.Container.PID, port: w.Port}
			p.ok(w.Addrs[0])
			p.blocked(w.Addrs[1])
		})
	}
	if warmRes.Sandbox.HostKey() == warmRes.Sandbox.ID || coldRes.Sandbox.HostKey() != coldRes.Sandbox.ID {
		t.Fatalf("host keys: pooled %q cold %q", warmRes.Sandbox.HostKey(), coldRes.Sandbox.HostKey())
	}

	// Refill: the claimed entry is replaced.
	waitPool(t, svc, "busybox", 2)
	if st := svc.Pools(); len(st) == 0 || st[0].Hits != 1 || st[0].Refills < 3 {
		t.Fatalf("pool stats after one claim: %+v", st)
	}

	// The claimed sandbox pauses, resumes and deletes like any other, and
	// releases what the entry held.
	if _, err := svc.Pause(ctx, "pooled-one"); err != nil {
		t.Fatal(err)
	}
	if _, err := svc.Resume(ctx, "pooled-one"); err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"pooled-one", "cold-one"} {
		if _, err := svc.Delete(ctx, id); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := os.Stat(filepath.Join(env.Config.Node.RunDir, "sandboxes", warmRes.Sandbox.HostKey())); !os.IsNotExist(err) {
		t.Fatalf("run directory of the claimed entry after delete: %v", err)
	}

	// Template delete drains its pool: nothing left on the node.
	if err := svc.DeleteTemplate(ctx, "busybox"); err != nil {
		t.Fatalf("delete template: %v", err)
	}
	if left := poolContainers(t, env); len(left) != 0 {
		t.Fatalf("pool entries after template delete: %v", left)
	}
	env.AssertNoLeaks(t)
}

// gaugeValue reads metric name with label template=tmpl from the
// service's registry (what /metrics serves).
func gaugeValue(t *testing.T, svc *cubelet.Service, name, tmpl string) float64 {
	t.Helper()
	mfs, err := svc.Metrics().Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "template" && l.GetValue() == tmpl {
					return m.GetGauge().GetValue()
				}
			}
		}
	}
	t.Fatalf("no %s{template=%q}", name, tmpl)
	return 0
}

// shInTok is shIn with an access token.
func shInTok(t *testing.T, sb *sandbox.Record, token, script string) string {
	t.Helper()
	out, code := shInWith(t, sb, tokenClient(token), script)
	if code != 0 {
		t.Fatalf("%q exited %d: %s", script, code, out)
	}
	return out
}

// waitFrozenEntries waits until n pool entries exist and are frozen (their
// records say Paused a moment later: the daemon is then given another
// half second).
func waitFrozenEntries(t *testing.T, env *cubelettest.Env, n int) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		ids := poolContainers(t, env)
		frozen := 0
		for _, id := range ids {
			if freezerState(t, env, id) == "FROZEN" {
				frozen++
			}
		}
		if frozen == n && len(ids) == n {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("pool entries %v: %d frozen, want %d", ids, frozen, n)
		}
		time.Sleep(50 * time.Millisecond)
	}
	time.Sleep(500 * time.Millisecond)
}

// TestWarmPoolRestart: entries a killed cubelet left are adopted by the
// next one (no refill needed), entries no longer configured are
// destroyed, and Close leaves none behind.
func TestWarmPoolRestart(t *testing.T) {
	env := cubelettest.New(t, poolTOML)
	svc := env.Start(t)
	env.ImportBusybox(t, svc, "busybox")
	if err := svc.Close(); err != nil {
		t.Fatal(err)
	}
	d := startDaemon(t, env, env.WriteConfig(t, poolTOML), "")
	waitFrozenEntries(t, env, 2)
	before := poolContainers(t, env)
	d.kill()

	svc = env.Start(t)
	waitPool(t, svc, "busybox", 2)
	if st := svc.Pools(); st[0].Refills != 0 {
		t.Fatalf("restart refilled instead of adopting: %+v (entries before %v, now %v)", st, before, poolContainers(t, env))
	}
	res, err := svc.Create(context.Background(), cubelet.CreateRequest{TemplateID: "busybox", SandboxID: "after-restart"})
	if err != nil || !res.Pooled {
		t.Fatalf("create after restart: pooled %v, %v", res != nil && res.Pooled, err)
	}
	if _, err := svc.Delete(context.Background(), "after-restart"); err != nil {
		t.Fatal(err)
	}
	if err := svc.Close(); err != nil {
		t.Fatal(err)
	}
	if left := poolContainers(t, env); len(left) != 0 {
		t.Fatalf("pool entries after Close: %v", left)
	}
	env.AssertNoLeaks(t)

	// A restart with the pool off destroys what it finds.
	env.Config.WarmPool.Templates = nil
	d = startDaemon(t, env, env.WriteConfig(t, poolTOML), "")
	waitFrozenEntries(t, env, 2)
	d.kill()
	_ = env.Start(t)
	for deadline := time.Now().Add(30 * time.Second); len(poolContainers(t, env)) != 0; {
		if time.Now().After(deadline) {
			t.Fatalf("entries of a pool no longer configured: %v", poolContainers(t, env))
		}
		time.Sleep(50 * time.Millisecond)
	}
	env.AssertNoLeaks(t)
}

// TestWarmPoolGvisor: a gVisor template's pool. The claimed sandbox gets
// its hostname from the agent's reinit (gVisor's kernel lets the agent
// set it), its env and token like a cold gVisor sandbox of the same run
// (the control), and the pool drains with the template.
func TestWarmPoolGvisor(t *testing.T) {
	cubelettest.RequireRoot(t)
	requireRunsc(t)
	env := cubelettest.New(t, "[gvisor]\ncheckpoint = false\n"+strings.ReplaceAll(poolTOML, "busybox = 2", "gv = 1"))
	_ = env.StartNetworkAgent(t, nettest.Options{PoolSize: 4})
	svc := env.Start(t)
	ctx := context.Background()
	for _, id := range []string{"gv", "gv-cold"} {
		if _, err := svc.ImportTemplateFrom(ctx, cubelet.TemplateImport{TemplateID: id, Source: env.Image, Runtime: "gvisor"}, nil); err != nil {
			t.Fatal(err)
		}
	}
	waitPool(t, svc, "gv", 1)
	var recs []*sandbox.Record
	for _, c := range []struct{ tmpl, id string }{{"gv", "gv-pooled"}, {"gv-cold", "gv-cold-one"}} {
		res, err := svc.Create(ctx, cubelet.CreateRequest{SandboxID: c.id, TemplateID: c.tmpl,
			Env: map[string]string{"FOO": "bar"}, AccessToken: "tok-" + c.id})
		if err != nil {
			t.Fatalf("create %s: %v", c.id, err)
		}
		cleanupDelete(t, svc, c.id)
		if res.Pooled != (c.tmpl == "gv") || res.Sandbox.Runtime != "gvisor" {
			t.Fatalf("%s: pooled %v runtime %s", c.id, res.Pooled, res.Sandbox.Runtime)
		}
		t.Logf("%s timings: %+v", c.id, res.Timings)
		recs = append(recs, res.Sandbox)
	}
	for i, sb := range recs {
		out := shInTok(t, sb, sb.AccessToken, "hostname; echo FOO=$FOO; echo ID=$CUBE_SANDBOX_ID")
		if want := sb.ID + "\nFOO=bar\nID=" + sb.ID + "\n"; out != want {
			t.Fatalf("%s: %q, want %q", sb.ID, out, want)
		}
		wantRefused(t, svc, sb.ID, "", recs[1-i].AccessToken)
		wantServed(t, svc, sb.ID, sb.AccessToken)
	}
	for _, sb := range recs {
		if _, err := svc.Delete(ctx, sb.ID); err != nil {
			t.Fatal(err)
		}
	}
	waitPool(t, svc, "gv", 1)
	if err := svc.DeleteTemplate(ctx, "gv"); err != nil {
		t.Fatal(err)
	}
	if left := poolContainers(t, env); len(left) != 0 {
		t.Fatalf("pool entries after template delete: %v", left)
	}
	env.AssertNoLeaks(t)
}

// TestWarmPoolDeadEntry: entries whose container was killed while frozen
// never serve a create: the create still succeeds (cold, or from an entry
// refilled meanwhile), nothing of the dead entries is left, and the pool
// refills. Control: the same create before the kill is served from the
// pool.
func TestWarmPoolDeadEntry(t *testing.T) {
	env := cubelettest.New(t, poolTOML)
	svc := env.Start(t)
	env.ImportBusybox(t, svc, "busybox")
	ctx := context.Background()
	waitPool(t, svc, "busybox", 2)
	res, err := svc.Create(ctx, cubelet.CreateRequest{TemplateID: "busybox", SandboxID: "control"})
	if err != nil || !res.Pooled {
		t.Fatalf("control create: pooled %v, %v", res != nil && res.Pooled, err)
	}
	if _, err := svc.Delete(ctx, "control"); err != nil {
		t.Fatal(err)
	}
	waitPool(t, svc, "busybox", 2)
	killed := poolContainers(t, env)
	for _, id := range killed {
		b, err := os.ReadFile(filepath.Join(env.Config.Node.RunDir, "sandboxes", id, "bundle", "init.pid"))
		if err != nil {
			t.Fatal(err)
		}
		pid, _ := strconv.Atoi(strings.TrimSpace(string(b)))
		if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
			t.Fatalf("kill entry %s (pid %d): %v", id, pid, err)
		}
	}
	t.Logf("killed frozen entries %v", killed)
	res, err = svc.Create(ctx, cubelet.CreateRequest{TemplateID: "busybox", SandboxID: "after-kill"})
	if err != nil {
		t.Fatalf("create after the entries died: %v", err)
	}
	t.Logf("create after the kill: pooled %v, timings %+v", res.Pooled, res.Timings)
	for _, id := range killed {
		if res.Sandbox.HostKey() == id {
			t.Fatalf("create after the kill was served by dead entry %s", id)
		}
	}
	if err := agentclient.WaitAgent(ctx, res.Sandbox.Container.PID); err != nil {
		t.Fatalf("agent of the create after the kill: %v", err)
	}
	out, err := exec.Command("nsenter", "-t", strconv.Itoa(res.Sandbox.Container.PID), "-u", "hostname").Output()
	if err != nil || string(out) != "after-kill\n" {
		t.Fatalf("hostname %q, %v", out, err)
	}
	if _, err := svc.Delete(ctx, "after-kill"); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(60 * time.Second)
	for {
		left := map[string]bool{}
		for _, id := range poolContainers(t, env) {
			left[id] = true
		}
		gone := true
		for _, id := range killed {
			gone = gone && !left[id]
		}
		if gone && svc.PoolReady("busybox") == 2 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("dead entries %v still there (now %v), pool %+v", killed, left, svc.Pools())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestWarmPoolClaimCrash: a cubelet killed in the middle of a claim, after
// the entry's thaw and the sandbox's limits and hostname but before the
// sandbox's record replaced the entry's (a claim writes it alongside),
// leaves the entry's record naming a thawed container that carries the
// crashed claim's limits and hostname. The next cubelet destroys that
// entry, never serves it, and refills; the other entry, still frozen, is
// adopted (the control: an untouched entry survives the same restart).
func TestWarmPoolClaimCrash(t *testing.T) {
	env := cubelettest.New(t, poolTOML)
	svc := env.Start(t)
	env.ImportBusybox(t, svc, "busybox")
	if err := svc.Close(); err != nil {
		t.Fatal(err)
	}
	d := startDaemon(t, env, env.WriteConfig(t, poolTOML),
		cubelet.FailpointClaimRecord+"=sleep(60s);"+actions.FailpointClaimReinit+"=kill")
	waitFrozenEntries(t, env, 2)
	entries := poolContainers(t, env)
	ctx := context.Background()
	if _, err := d.client.CreateSandbox(ctx, &pb.CreateSandboxRequest{
		SandboxId: "crashed", TemplateId: "busybox", Resources: &pb.Resources{MemoryMib: 96},
	}); err == nil {
		t.Fatal("the claim survived its kill failpoint")
	}
	d.waitDead(t)
	var thawed, frozen string
	for _, id := range entries {
		if freezerState(t, env, id) == "FROZEN" {
			frozen = id
		} else {
			thawed = id
		}
	}
	if thawed == "" || frozen == "" {
		t.Fatalf("entries %v after the crash: want one thawed by the claim, one frozen", entries)
	}
	t.Logf("claim crashed with entry %s thawed; %s still frozen", thawed, frozen)

	svc = env.Start(t)
	deadline := time.Now().Add(60 * time.Second)
	for {
		left := map[string]bool{}
		for _, id := range poolContainers(t, env) {
			left[id] = true
		}
		if !left[thawed] && svc.PoolReady("busybox") == 2 {
			if !left[frozen] {
				t.Fatalf("the frozen entry %s was not adopted (entries now %v)", frozen, left)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("thawed entry %s still there or pool not refilled: entries %v, pool %+v", thawed, left, svc.Pools())
		}
		time.Sleep(50 * time.Millisecond)
	}
	if st := svc.Pools(); st[0].Refills < 1 {
		t.Fatalf("pool %+v: the destroyed entry was not replaced by a refill", st)
	}
	for _, id := range []string{"first", "second"} {
		res, err := svc.Create(ctx, cubelet.CreateRequest{TemplateID: "busybox", SandboxID: id})
		if err != nil || !res.Pooled {
			t.Fatalf("create %s after the restart: pooled %v, %v", id, res != nil && res.Pooled, err)
		}
		if res.Sandbox.HostKey() == thawed {
			t.Fatalf("create %s was served by the crashed claim's entry %s", id, thawed)
		}
		want := strconv.FormatInt(env.Config.Sandbox.DefaultMemoryMiB<<20, 10)
		if v := cgroupValue(t, res.Sandbox, "memory.limit_in_bytes", "memory.max"); v != want {
			t.Fatalf("create %s: memory limit %s, want the default %s", id, v, want)
		}
		if _, err := svc.Delete(ctx, id); err != nil {
			t.Fatal(err)
		}
	}
	if err := svc.Close(); err != nil {
		t.Fatal(err)
	}
	if left := poolContainers(t, env); len(left) != 0 {
		t.Fatalf("pool entries after Close: %v", left)
	}
	env.AssertNoLeaks(t)
}

// TestWarmPoolClaimFinished: a cubelet killed in a claim after the
// sandbox's record replaced the entry's (state creating, with the entry's
// token) finishes the claim at its next start: the sandbox is running with
// its own hostname, env, limits and token, whether the kill came before
// the agent's reinit or after it (the reinit then sees its own token).
// The control is the same create in a cubelet without the failpoint
// (TestWarmPool checks a finished claim the same way).
func TestWarmPoolClaimFinished(t *testing.T) {
	for _, tc := range []struct {
		name, failpoints string
		killAfter        time.Duration // 0: the failpoint kills
	}{
		// The record write runs alongside the claim: the hang holds the
		// claim before its reinit until the write is surely done.
		{"before reinit", actions.FailpointClaimReinit + "=hang", 3 * time.Second},
		{"after reinit", cubelet.FailpointClaimRunning + "=kill", 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			env := cubelettest.New(t, poolTOML)
			svc := env.Start(t)
			env.ImportBusybox(t, svc, "busybox")
			if err := svc.Close(); err != nil {
				t.Fatal(err)
			}
			d := startDaemon(t, env, env.WriteConfig(t, poolTOML), tc.failpoints)
			waitFrozenEntries(t, env, 2)
			ctx := context.Background()
			errc := make(chan error, 1)
			go func() {
				_, err := d.client.CreateSandbox(ctx, &pb.CreateSandboxRequest{
					SandboxId: "claimed", TemplateId: "busybox", AccessToken: "tok-claimed",
					Env: map[string]string{"FOO": "bar"}, Resources: &pb.Resources{MemoryMib: 96, Pids: 77},
				})
				errc <- err
			}()
			if tc.killAfter > 0 {
				time.Sleep(tc.killAfter)
				d.kill()
			} else {
				d.waitDead(t)
			}
			if err := <-errc; err == nil {
				t.Fatal("the claim was answered despite its failpoint")
			}

			svc = env.Start(t)
			sb, err := svc.Get(ctx, "claimed")
			if err != nil {
				t.Fatalf("claimed sandbox after the restart: %v", err)
			}
			if sb.State != "running" || sb.PoolToken != "" || sb.HostKey() == sb.ID {
				t.Fatalf("claimed sandbox after the restart: state %s, pool token set %v, host key %s", sb.State, sb.PoolToken != "", sb.HostKey())
			}
			out, err := exec.Command("nsenter", "-t", strconv.Itoa(sb.Container.PID), "-u", "hostname").Output()
			if err != nil || string(out) != "claimed\n" {
				t.Fatalf("hostname %q, %v", out, err)
			}
			if v := cgroupValue(t, sb, "memory.limit_in_bytes", "memory.max"); v != "100663296" {
				t.Fatalf("memory limit %q, want 96 MiB", v)
			}
			if v := cgroupValue(t, sb, "pids.max"); v != "77" {
				t.Fatalf("pids.max %q, want 77", v)
			}
			// The agent's env, and its token: refused without it, served with it.
			if code, _ := agentGet(t, sb, "", "/envs"); code != http.StatusUnauthorized {
				t.Fatalf("GET /envs without a token: %d, want 401", code)
			}
			code, body := agentGet(t, sb, "tok-claimed", "/envs")
			if code != http.StatusOK || !strings.Contains(body, `"FOO":"bar"`) || !strings.Contains(body, `"CUBE_SANDBOX_ID":"claimed"`) {
				t.Fatalf("GET /envs with the sandbox's token: %d %s", code, body)
			}
			if _, err := svc.Delete(ctx, "claimed"); err != nil {
				t.Fatal(err)
			}
			if err := svc.Close(); err != nil {
				t.Fatal(err)
			}
			if left := poolContainers(t, env); len(left) != 0 {
				t.Fatalf("pool entries after Close: %v", left)
			}
			env.AssertNoLeaks(t)
		})
	}
}

// agentGet calls path on the agent of sb, which has no network slot,
// from inside its network namespace, with token ("" = none).
func agentGet(t *testing.T, sb *sandbox.Record, token, path string) (int, string) {
	t.Helper()
	c := nsdial.HTTPClient(fmt.Sprintf("/proc/%d/ns/net", sb.Container.PID))
	defer c.CloseIdleConnections()
	if token != "" {
		c.Transport = tokenTransport{token: token, base: c.Transport}
	}
	resp, err := c.Get(fmt.Sprintf("http://127.0.0.1:%d%s", agentproto.Port, path))
	if err != nil {
		t.Fatalf("GET %s: %v", path, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}
