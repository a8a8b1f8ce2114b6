package vm

import (
	"context"
	"fmt"
	"io"
	"maps"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/agentchan"
	"github.com/cubesandbox/cube/internal/qmp"
)

// TestMeasure prints the medians docs/vm.md reports: the driver's verbs,
// and a raw `qemu -incoming "exec:zstd -dc ..."` restore of the same
// image, in one run. It only runs with CUBE_VM_MEASURE=<iterations>.
func TestMeasure(t *testing.T) {
	n := 0
	if _, err := fmt.Sscan(os.Getenv("CUBE_VM_MEASURE"), &n); err != nil || n <= 0 {
		t.Skip("set CUBE_VM_MEASURE=<iterations> to measure")
	}
	e := newEnv(t)
	d, ctx := e.d, t.Context()
	times := map[string][]time.Duration{}
	var sizes, rss []int64
	timed := func(name string, fn func() error) {
		t.Helper()
		begin := time.Now()
		if err := fn(); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		times[name] = append(times[name], time.Since(begin))
	}
	for i := range n {
		s := e.spec(t, fmt.Sprintf("m%d", i))
		stopAtEnd(t, d, s.ID)
		begin := time.Now()
		timed("cold boot: Start (QEMU running)", func() error { _, err := d.Start(ctx, s); return err })
		agentClient(ctx, t, d, s.ID, bootLimit)
		times["cold boot: to agent ready"] = append(times["cold boot: to agent ready"], time.Since(begin))
		st, _ := d.State(ctx, s.ID)
		kb, err := vmRSS(st.PID)
		if err != nil {
			t.Fatal(err)
		}
		rss = append(rss, kb)
		timed("QMP stop (Pause)", func() error { return d.Pause(ctx, s.ID) })
		timed("QMP cont (Resume)", func() error { return d.Resume(ctx, s.ID) })
		img := filepath.Join(t.TempDir(), "img")
		timed("checkpoint (leaveRunning=false)", func() error { return d.Checkpoint(ctx, s.ID, img, false) })
		fi, err := os.Stat(filepath.Join(img, MemoryFile))
		if err != nil {
			t.Fatal(err)
		}
		sizes = append(sizes, fi.Size())

		r := e.spec(t, fmt.Sprintf("r%d", i))
		copyFile(t, s.Disk, r.Disk)
		stopAtEnd(t, d, r.ID)
		begin = time.Now()
		timed("restore: Restore (running)", func() error { _, err := d.Restore(ctx, r, img); return err })
		agentClient(ctx, t, d, r.ID, 30*time.Second)
		times["restore: to agent ready"] = append(times["restore: to agent ready"], time.Since(begin))
		timed("stop", func() error { return d.Stop(ctx, r.ID) })

		raw := e.spec(t, fmt.Sprintf("x%d", i))
		copyFile(t, s.Disk, raw.Disk)
		timed("raw qemu -incoming exec:zstd (loaded)", func() error { return rawIncoming(ctx, d, raw.BundleDir, raw.Disk, img) })
	}
	names := make([]string, 0, len(times))
	for k := range times {
		names = append(names, k)
	}
	slices.Sort(names)
	t.Logf("accel %s, %d iterations, medians:", d.Accel(), n)
	for _, k := range names {
		t.Logf("  %-40s %v", k, median(times[k]).Round(time.Millisecond))
	}
	slices.Sort(sizes)
	slices.Sort(rss)
	t.Logf("  %-40s %d KiB", MemoryFile+" size (256 MiB guest)", sizes[len(sizes)/2]>>10)
	t.Logf("  %-40s %d MiB", "QEMU RSS at agent ready", rss[len(rss)/2]>>20)
}

// rawIncoming runs QEMU by hand with the snapshot's shape and
// -incoming "exec:zstd -dc IMAGE", and returns once QMP reports the
// migration completed: the floor under the driver's Restore.
func rawIncoming(ctx context.Context, d *Driver, bundle, disk, dir string) error {
	shape, err := ReadShape(dir)
	if err != nil {
		return err
	}
	p := paths{Disk: disk, QMP: filepath.Join(bundle, "qmp.sock"), Agent: filepath.Join(bundle, "agent.sock"),
		Console: filepath.Join(bundle, "console.log"), Log: filepath.Join(bundle, "qemu.log"), PIDFile: filepath.Join(bundle, "qemu.pid")}
	args := qemuArgs(shape, p, false)
	args = append(args, "-incoming", "exec:zstd -dc "+shellQuote(filepath.Join(dir, MemoryFile)))
	if out, err := exec.CommandContext(ctx, d.qemu, args...).CombinedOutput(); err != nil {
		return fmt.Errorf("%v: %s", err, out)
	}
	st := &vmState{QMP: p.QMP}
	b, err := os.ReadFile(p.PIDFile)
	if err != nil {
		return err
	}
	if _, err := fmt.Sscan(strings.TrimSpace(string(b)), &st.PID); err != nil {
		return fmt.Errorf("parse %s %q: %w", p.PIDFile, b, err)
	}
	defer func() {
		_ = syscall.Kill(st.PID, syscall.SIGKILL)
		_ = waitGone(st, killTimeout)
		for _, f := range []string{p.QMP, p.Agent, p.PIDFile} {
			_ = os.Remove(f)
		}
	}()
	c, err := qmp.Dial(ctx, p.QMP)
	if err != nil {
		return err
	}
	defer c.Close()
	return d.waitMigrate(ctx, c.Execute, "")
}

// vmRSS returns the resident set size of process pid in bytes.
func vmRSS(pid int) (int64, error) {
	path := fmt.Sprintf("/proc/%d/status", pid)
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	for _, l := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(l, "VmRSS:") {
			var kb int64
			if _, err := fmt.Sscan(strings.TrimSpace(strings.TrimSuffix(strings.TrimPrefix(l, "VmRSS:"), "kB")), &kb); err != nil {
				return 0, fmt.Errorf("parse %s %q: %w", path, l, err)
			}
			return kb << 10, nil
		}
	}
	return 0, fmt.Errorf("%s: no VmRSS line", path)
}

func median(ds []time.Duration) time.Duration {
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[len(s)/2]
}

// TestMeasureTemplate prints, in one run, a clone's restore from a
// shared-memory template against a restore of a full memory image of the
// same guest (booted the same way, without the template label) and
// against bare QEMU loading each image, plus each kind's host memory
// (Pss) when idle. It only runs with CUBE_VM_MEASURE=<iterations>.
func TestMeasureTemplate(t *testing.T) {
	n := 0
	if _, err := fmt.Sscan(os.Getenv("CUBE_VM_MEASURE"), &n); err != nil || n <= 0 {
		t.Skip("set CUBE_VM_MEASURE=<iterations> to measure")
	}
	e := newEnv(t)
	d, ctx := e.d, t.Context()
	images := map[string]string{}
	var disk string
	for _, kind := range []string{"full", "template"} {
		s := e.spec(t, "src-"+kind)
		if kind == "template" {
			s.Labels = map[string]string{TemplateLabel: "m"}
		}
		stopAtEnd(t, d, s.ID)
		if _, err := d.Start(ctx, s); err != nil {
			t.Fatal(err)
		}
		agentClient(ctx, t, d, s.ID, bootLimit)
		time.Sleep(2 * time.Second)
		images[kind] = filepath.Join(t.TempDir(), kind)
		if err := d.Checkpoint(ctx, s.ID, images[kind], false); err != nil {
			t.Fatal(err)
		}
		disk = s.Disk
	}
	times := map[string][]time.Duration{}
	pss := map[string][]int64{}
	timed := func(name string, fn func() error) {
		t.Helper()
		begin := time.Now()
		if err := fn(); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		times[name] = append(times[name], time.Since(begin))
	}
	for i := range n {
		for _, kind := range []string{"full", "template"} {
			img := images[kind]
			r := e.spec(t, fmt.Sprintf("%s%d", kind, i))
			copyFile(t, disk, r.Disk)
			stopAtEnd(t, d, r.ID)
			begin := time.Now()
			timed(kind+": Restore (running)", func() error { _, err := d.Restore(ctx, r, img); return err })
			agentClient(ctx, t, d, r.ID, 30*time.Second)
			times[kind+": Restore to agent ready"] = append(times[kind+": Restore to agent ready"], time.Since(begin))
			time.Sleep(time.Second)
			st, _ := d.State(ctx, r.ID)
			m, err := SmapsRollup(st.PID)
			if err != nil {
				t.Fatal(err)
			}
			pss[kind+": Pss idle"] = append(pss[kind+": Pss idle"], m["Pss"])
			pss[kind+": Pss beyond shared template pages"] = append(pss[kind+": Pss beyond shared template pages"], m["Pss"]-m["Pss_Shmem"])
			if err := d.Stop(ctx, r.ID); err != nil {
				t.Fatal(err)
			}
			x := e.spec(t, fmt.Sprintf("raw%s%d", kind, i))
			copyFile(t, disk, x.Disk)
			timed("bare qemu -incoming, "+kind+" image (loaded)", func() error { return rawIncomingAny(ctx, d, x.BundleDir, x.Disk, img) })
		}
	}
	t.Logf("accel %s, %d iterations, medians:", d.Accel(), n)
	names := make([]string, 0, len(times))
	for k := range times {
		names = append(names, k)
	}
	slices.Sort(names)
	for _, k := range names {
		t.Logf("  %-50s %v", k, median(times[k]).Round(time.Millisecond))
	}
	for _, k := range []string{"full: Pss idle", "template: Pss idle", "template: Pss beyond shared template pages"} {
		v := slices.Clone(pss[k])
		slices.Sort(v)
		t.Logf("  %-50s %d MiB", k, v[len(v)/2]>>10)
	}
	base := median(times["bare qemu -incoming, full image (loaded)"])
	for _, k := range []string{"template: Restore (running)", "template: Restore to agent ready", "full: Restore (running)"} {
		t.Logf("  %s / bare qemu -incoming of the full image: %.2fx", k, float64(median(times[k]))/float64(base))
	}
}

// rawIncomingAny is rawIncoming for any image, a template's included
// (RawIncoming's command line, cube-bench's qemu-incoming baseline).
func rawIncomingAny(ctx context.Context, d *Driver, bundle, disk, dir string) error {
	args, f, err := RawIncoming(dir, disk, bundle, 0)
	if err != nil {
		return err
	}
	if out, err := exec.CommandContext(ctx, d.qemu, args...).CombinedOutput(); err != nil {
		return fmt.Errorf("%v: %s", err, out)
	}
	pid, err := ReadPIDFile(f.PIDFile)
	if err != nil {
		return err
	}
	st := &vmState{PID: pid, QMP: f.QMP}
	defer func() {
		_ = syscall.Kill(pid, syscall.SIGKILL)
		_ = waitGone(st, killTimeout)
		for _, p := range []string{f.QMP, f.Agent, f.PIDFile} {
			_ = os.Remove(p)
		}
	}()
	return WaitIncoming(ctx, f, false)
}

// TestMeasureTCGKnobs: what QEMU's own memory under TCG costs and what
// its knobs buy, each variant in turn within one run (interleaved, so
// machine load hits each alike): the translation cache's size
// (tb-size), transparent huge pages off (PR_SET_THP_DISABLE) and glibc's
// malloc trimming. For each: a clone of one template restored to agent
// ready, five commands through the agent (the guest translating new code
// paths), then the idle clone's Pss beyond the template's pages and where
// it goes (smapsBreakdown). CUBE_VM_TB_SIZES adds tb-size variants
// (e.g. "16 8": each slows the commands several times over). TCG only.
func TestMeasureTCGKnobs(t *testing.T) {
	n := 0
	if _, err := fmt.Sscan(os.Getenv("CUBE_VM_MEASURE"), &n); err != nil || n <= 0 {
		t.Skip("set CUBE_VM_MEASURE=<iterations> to measure")
	}
	e := newEnv(t)
	d, ctx := e.d, t.Context()
	if d.Accel() != "tcg" {
		t.Skip("TCG only")
	}
	s := e.spec(t, "knob-src")
	s.Labels = map[string]string{TemplateLabel: "knob"}
	stopAtEnd(t, d, s.ID)
	if _, err := d.Start(ctx, s); err != nil {
		t.Fatal(err)
	}
	agentClient(ctx, t, d, s.ID, bootLimit)
	time.Sleep(2 * time.Second)
	img := filepath.Join(t.TempDir(), "tmpl")
	if err := d.Checkpoint(ctx, s.ID, img, false); err != nil {
		t.Fatal(err)
	}
	type variant struct {
		name  string
		tb    int
		env   []string
		noTHP bool
	}
	trim := []string{"MALLOC_TRIM_THRESHOLD_=131072", "MALLOC_TOP_PAD_=0"}
	variants := []variant{
		{"thp on, malloc defaults", 64, nil, false},
		{"thp off", 64, nil, true},
		{"thp off, malloc trim", 64, trim, true},
		{"thp off, malloc trim, arena_max=1", 64, append([]string{"MALLOC_ARENA_MAX=1"}, trim...), true},
	}
	for _, f := range strings.Fields(os.Getenv("CUBE_VM_TB_SIZES")) {
		tb, err := strconv.Atoi(f)
		if err != nil {
			t.Fatal(err)
		}
		variants = append(variants, variant{fmt.Sprintf("tb-size=%d", tb), tb, nil, false})
	}
	was := [3]any{tcgTBSizeMiB, qemuTCGEnv, qemuNoTHP}
	t.Cleanup(func() { tcgTBSizeMiB, qemuTCGEnv, qemuNoTHP = was[0].(int), was[1].([]string), was[2].(bool) })
	times := map[string][]time.Duration{}
	kib := map[string][]int64{}
	for i := range n {
		for j, v := range variants {
			tcgTBSizeMiB, qemuTCGEnv, qemuNoTHP = v.tb, v.env, v.noTHP
			key := fmt.Sprintf("%d %s", j, v.name)
			r := e.spec(t, fmt.Sprintf("k%d-%d", j, i))
			copyFile(t, s.Disk, r.Disk)
			stopAtEnd(t, d, r.ID)
			begin := time.Now()
			if _, err := d.Restore(ctx, r, img); err != nil {
				t.Fatal(err)
			}
			c := agentClient(ctx, t, d, r.ID, 60*time.Second)
			times[key+": restore to agent ready"] = append(times[key+": restore to agent ready"], time.Since(begin))
			begin = time.Now()
			for range 5 {
				run(ctx, t, c, "ls -l /bin >/dev/null; echo $((6*7)) > /tmp/x; cat /tmp/x; date; ps")
			}
			times[key+": 5 commands"] = append(times[key+": 5 commands"], time.Since(begin))
			time.Sleep(2 * time.Second)
			st, _ := d.State(ctx, r.ID)
			m, err := SmapsRollup(st.PID)
			if err != nil {
				t.Fatal(err)
			}
			bd, err := smapsBreakdown(st.PID)
			if err != nil {
				t.Fatal(err)
			}
			// What stays the clone's own however many clones share
			// QEMU's binary and libraries and the template: QEMU's
			// private dirty pages and the guest pages copied on write
			// (the template mapping's shmem pages count as private dirty
			// while one clone alone maps them).
			g, err := TemplateMapping(st.PID)
			if err != nil {
				t.Fatal(err)
			}
			dirty := g["Anonymous"]
			for k, x := range bd {
				if strings.HasPrefix(k, "dirty:") && k != "dirty:template" {
					dirty += x
				}
			}
			kib[key+": Pss beyond shared template pages"] = append(kib[key+": Pss beyond shared template pages"], m["Pss"]-m["Pss_Shmem"])
			kib[key+": own at scale (QEMU private dirty + guest copy on write)"] = append(kib[key+": own at scale (QEMU private dirty + guest copy on write)"], dirty)
			kib[key+": translation cache"] = append(kib[key+": translation cache"], bd["tcg"])
			kib[key+": heap + anon"] = append(kib[key+": heap + anon"], bd["heap"]+bd["anon"])
			t.Logf("%s #%d: %s", key, i, formatBreakdown(bd))
			if err := d.Stop(ctx, r.ID); err != nil {
				t.Fatal(err)
			}
		}
	}
	t.Logf("%d iterations, medians:", n)
	names := make([]string, 0, len(times))
	for k := range times {
		names = append(names, k)
	}
	slices.Sort(names)
	for _, k := range names {
		t.Logf("  %-60s %v", k, median(times[k]).Round(time.Millisecond))
	}
	names = names[:0]
	for k := range kib {
		names = append(names, k)
	}
	slices.Sort(names)
	for _, k := range names {
		v := slices.Clone(kib[k])
		slices.Sort(v)
		t.Logf("  %-60s %.1f MiB", k, float64(v[len(v)/2])/1024)
	}
}

// TestMeasureChannel prints what one agent call over the virtio-serial
// channel costs in each of the ways cubelet makes it (interleaved, one
// VM): on an open HTTP/2 connection; on a new connection (dial, SIGIO
// wake, SYNC/ACK, preface); and the first call after a QMP stop/cont,
// without and with a spare session taken before the stop (a warm-pool
// claim's reinit). It only runs with CUBE_VM_MEASURE=<iterations>.
func TestMeasureChannel(t *testing.T) {
	n := 0
	if _, err := fmt.Sscan(os.Getenv("CUBE_VM_MEASURE"), &n); err != nil || n <= 0 {
		t.Skip("set CUBE_VM_MEASURE=<iterations> to measure")
	}
	e := newEnv(t)
	d, ctx := e.d, t.Context()
	s := e.spec(t, "ch")
	stopAtEnd(t, d, s.ID)
	if _, err := d.Start(ctx, s); err != nil {
		t.Fatal(err)
	}
	agentClient(ctx, t, d, s.ID, bootLimit).CloseIdleConnections()
	sock, err := d.AgentSocket(s.ID)
	if err != nil {
		t.Fatal(err)
	}
	ch := agentchan.NewSerial(sock)
	defer ch.Close()
	health := func() error { return agentCall(ctx, ch, http.MethodGet, "/health", "") }
	i := 0
	reinit := func() error {
		i++
		return agentCall(ctx, ch, http.MethodPost, "/_cube/reinit", reinitBody(fmt.Sprint("m", i)))
	}
	times := spread{}
	timed := func(name string, fn func() error) { t.Helper(); times.time(t, name, fn) }
	freeze := func(spare bool) {
		t.Helper()
		ch.HTTP.CloseIdleConnections()
		if spare {
			if err := ch.Spare(ctx); err != nil {
				t.Fatal(err)
			}
		}
		if err := d.Pause(ctx, s.ID); err != nil {
			t.Fatal(err)
		}
		time.Sleep(300 * time.Millisecond)
		timed("QMP cont", func() error { return d.Resume(ctx, s.ID) })
	}
	settle, _ := time.ParseDuration(os.Getenv("CUBE_VM_SETTLE"))
	for range n {
		_ = health()
		timed("open connection", health)
		if settle > 0 {
			time.Sleep(settle)
			timed("open connection after idling", health)
		}
		ch.HTTP.CloseIdleConnections()
		time.Sleep(50 * time.Millisecond)
		timed("new connection", health)
		freeze(false)
		timed("after stop/cont, new connection", health)
		ch.HTTP.CloseIdleConnections()
		freeze(true)
		timed("after stop/cont, spare session", health)
		_ = health()
		if err := d.Pause(ctx, s.ID); err != nil {
			t.Fatal(err)
		}
		time.Sleep(300 * time.Millisecond)
		timed("QMP cont", func() error { return d.Resume(ctx, s.ID) })
		timed("after stop/cont, open connection", health)
		timed("reinit, open connection", reinit)
		ch.HTTP.CloseIdleConnections()
		freeze(true)
		timed("after stop/cont, spare session: reinit", reinit)
	}
	if con, err := d.ConsoleLog(s.ID); err == nil {
		b, _ := os.ReadFile(con)
		lines := strings.Split(strings.TrimSpace(string(b)), "\n")
		t.Logf("console (last lines):\n%s", strings.Join(lines[max(len(lines)-4, 0):], "\n"))
	}
	t.Logf("accel %s, %d iterations, medians (p10-p90):", d.Accel(), n)
	logSpread(t, times)
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// TestMeasureClaimChannel is TestMeasureChannel's thaw-and-reinit on what
// a warm-pool claim has: a fresh clone of a shared-memory template, its
// restore reinit and a health call done, a spare session taken, stopped,
// then continued and re-initialised (timed). CUBE_VM_MEASURE=<clones>.
func TestMeasureClaimChannel(t *testing.T) {
	n := 0
	if _, err := fmt.Sscan(os.Getenv("CUBE_VM_MEASURE"), &n); err != nil || n <= 0 {
		t.Skip("set CUBE_VM_MEASURE=<iterations> to measure")
	}
	e := newEnv(t)
	d, ctx := e.d, t.Context()
	src := e.spec(t, "src")
	src.Labels = map[string]string{TemplateLabel: "m"}
	stopAtEnd(t, d, src.ID)
	if _, err := d.Start(ctx, src); err != nil {
		t.Fatal(err)
	}
	agentClient(ctx, t, d, src.ID, bootLimit).CloseIdleConnections()
	time.Sleep(2 * time.Second)
	img := filepath.Join(t.TempDir(), "tmpl")
	if err := d.Checkpoint(ctx, src.ID, img, false); err != nil {
		t.Fatal(err)
	}
	times := spread{}
	settle, _ := time.ParseDuration(os.Getenv("CUBE_VM_SETTLE"))
	for i := range n {
		r := e.spec(t, fmt.Sprintf("c%d", i))
		copyFile(t, src.Disk, r.Disk)
		stopAtEnd(t, d, r.ID)
		if _, err := d.Restore(ctx, r, img); err != nil {
			t.Fatal(err)
		}
		sock, err := d.AgentSocket(r.ID)
		if err != nil {
			t.Fatal(err)
		}
		ch := agentchan.NewSerial(sock)
		call := func(method, path, body string) error { return agentCall(ctx, ch, method, path, body) }
		body := func(k int) string { return reinitBody(fmt.Sprintf("c%d-%d", i, k)) }
		timed := func(name string, fn func() error) { t.Helper(); times.time(t, name, fn) }
		timed("restore reinit (new connection)", func() error { return call(http.MethodPost, "/_cube/reinit", body(0)) })
		timed("prepare", func() error { return call(http.MethodPost, "/_cube/prepare", "") })
		if settle > 0 {
			time.Sleep(settle)
			timed("health after settling (open)", func() error { return call(http.MethodGet, "/health", "") })
		}
		ch.CloseIdleConnections()
		if err := ch.Spare(ctx); err != nil {
			t.Fatal(err)
		}
		if err := d.Pause(ctx, r.ID); err != nil {
			t.Fatal(err)
		}
		time.Sleep(500 * time.Millisecond)
		timed("QMP cont", func() error { return d.Resume(ctx, r.ID) })
		timed("claim reinit (spare)", func() error { return call(http.MethodPost, "/_cube/reinit", body(1)) })
		timed("reinit again (open)", func() error { return call(http.MethodPost, "/_cube/reinit", body(2)) })
		timed("health (open)", func() error { return call(http.MethodGet, "/health", "") })
		ch.Close()
		if err := d.Stop(ctx, r.ID); err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("accel %s, %d clones, medians (p10-p90):", d.Accel(), n)
	logSpread(t, times)
}

// agentCall sends one request over the channel and fails on a non-2xx.
func agentCall(ctx context.Context, ch *agentchan.Channel, method, path, body string) error {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, method, agentchan.BaseURL+path, strings.NewReader(body))
	if err != nil {
		return err
	}
	resp, err := ch.HTTP.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<16))
	if resp.StatusCode/100 != 2 {
		return fmt.Errorf("%s %s: %s: %s", method, path, resp.Status, b)
	}
	return nil
}

// reinitBody is a warm-pool claim's reinit of a VM without a NIC:
// hostname, env, clock, entropy, token.
func reinitBody(id string) string {
	return fmt.Sprintf(`{"hostname":%q,"env":{"CUBE_SANDBOX_ID":%q,"FOO":"bar"},"time_unix_ns":%d,`+
		`"entropy":"AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8gISIjJCUmJygpKissLS4vMDEyMzQ1Njc4OTo7PD0+Pw==",`+
		`"access_token":""}`, id, id, time.Now().UnixNano())
}

// spread collects durations by name.
type spread map[string][]time.Duration

// time runs fn and records how long it took under name; an error fails t.
func (s spread) time(t *testing.T, name string, fn func() error) {
	t.Helper()
	begin := time.Now()
	if err := fn(); err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	s[name] = append(s[name], time.Since(begin))
}

// logSpread logs each series' median and p10-p90.
func logSpread(t *testing.T, times spread) {
	t.Helper()
	for _, k := range slices.Sorted(maps.Keys(times)) {
		v := slices.Sorted(slices.Values(times[k]))
		t.Logf("  %-40s %6.2f ms (%.2f-%.2f)", k, ms(v[len(v)/2]), ms(v[len(v)/10]), ms(v[len(v)*9/10]))
	}
}
