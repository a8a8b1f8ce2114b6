package vm

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/runtime"
	"github.com/cubesandbox/cube/internal/testenv"
)

// TestTemplateSharedMemory boots a template VM (RAM in a shared file),
// snapshots it while it keeps running, and restores five clones that map
// its RAM privately: each sees what the template had in memory (a tmpfs
// file and a process's argv), none sees another's writes or the
// template's later ones, the snapshot's RAM file is unchanged by them, an
// idle clone's own memory (Pss beyond the template's shared pages) is
// logged, a clone's own snapshot restores, a broken snapshot leaves
// nothing, and deleting the template while clones run harms none of them.
func TestTemplateSharedMemory(t *testing.T) {
	e := newEnv(t)
	d, ctx := e.d, t.Context()
	spec := e.spec(t, "tmpl")
	spec.Labels = map[string]string{TemplateLabel: "t1"}
	stopAtEnd(t, d, spec.ID)
	if _, err := d.Start(ctx, spec); err != nil {
		t.Fatal(err)
	}
	if s := mustLoad(t, d, spec.ID).Shape; !s.RAMObject || !s.SharedRAM {
		t.Fatalf("template VM shape %+v: want RAMObject and SharedRAM", s)
	}
	c := agentClient(ctx, t, d, spec.ID, bootLimit)
	marker := fmt.Sprintf("%d", 100000+time.Now().UnixNano()%1e8)
	run(ctx, t, c, "mkdir -p /run/m && mount -t tmpfs t /run/m && echo "+marker+" >/run/m/v")
	run(ctx, t, c, "setsid sleep "+marker+" </dev/null >/dev/null 2>&1 &")
	const probe = "cat /run/m/v; cat /proc/[0-9]*/cmdline | tr '\\0' ' ' | grep -o 'sleep [0-9]*' | head -1"
	want := marker + "\nsleep " + marker

	img := filepath.Join(t.TempDir(), "tmpl")
	begin := time.Now()
	if err := d.Checkpoint(ctx, spec.ID, img, true); err != nil {
		t.Fatal(err)
	}
	t.Logf("template checkpoint (device state + RAM file copy): %v", time.Since(begin))
	wantState(t, d, spec.ID, runtime.StatusRunning)
	zst, err := os.Stat(filepath.Join(img, MemoryFile))
	if err != nil {
		t.Fatal(err)
	}
	ram := filepath.Join(img, RAMFile)
	rfi, err := os.Stat(ram)
	if err != nil {
		t.Fatal(err)
	}
	var rst unix.Stat_t
	_ = unix.Stat(ram, &rst)
	t.Logf("%s: %d KiB (device state only); %s: %d MiB, %d MiB allocated", MemoryFile, zst.Size()>>10, RAMFile, rfi.Size()>>20, rst.Blocks*512>>20)
	if zst.Size() > 4<<20 {
		t.Errorf("%s is %d KiB: the stream carried RAM (x-ignore-shared not in effect)", MemoryFile, zst.Size()>>10)
	}
	if rfi.Size() != 256<<20 {
		t.Errorf("%s is %d bytes, want the guest's 256 MiB", RAMFile, rfi.Size())
	}
	// The template runs on and changes its memory: the snapshot's RAM
	// must be a copy, not the file the template still writes.
	run(ctx, t, c, "echo after-snapshot >/run/m/v")
	sum := fileSHA(t, ram)

	// A broken snapshot (RAM file of the wrong size, a truncated stream)
	// fails the restore and leaves nothing.
	bad := filepath.Join(t.TempDir(), "bad")
	if err := os.MkdirAll(bad, 0o700); err != nil {
		t.Fatal(err)
	}
	copyFile(t, filepath.Join(img, ShapeFile), filepath.Join(bad, ShapeFile))
	copyFile(t, filepath.Join(img, MemoryFile), filepath.Join(bad, MemoryFile))
	if err := os.WriteFile(filepath.Join(bad, RAMFile), []byte("short"), 0o600); err != nil {
		t.Fatal(err)
	}
	bs := e.spec(t, "bad1")
	if _, err := d.Restore(ctx, bs, bad); !errdefs.IsInvalidArgument(err) {
		t.Errorf("restore with a short RAM file: %v, want InvalidArgument", err)
	}
	copyFile(t, ram, filepath.Join(bad, RAMFile))
	if err := os.Truncate(filepath.Join(bad, MemoryFile), zst.Size()/2); err != nil {
		t.Fatal(err)
	}
	if _, err := d.Restore(ctx, bs, bad); err == nil {
		t.Errorf("restore of a truncated device stream succeeded")
	} else {
		t.Logf("truncated device stream: %v", err)
	}
	if _, err := d.State(ctx, bs.ID); !errdefs.IsNotFound(err) {
		t.Errorf("failed restores left %s: %v", bs.ID, err)
	}
	wantNoFiles(t, bs.BundleDir)
	if err := os.RemoveAll(bad); err != nil {
		t.Fatal(err)
	}
	if err := d.Stop(ctx, spec.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(sharedRAMPath(spec.BundleDir)); err == nil {
		t.Errorf("Stop left the template VM's RAM file in its bundle")
	}

	// Five clones at once.
	const n = 5
	specs := make([]runtime.Spec, n)
	errs := make([]error, n)
	for i := range specs {
		specs[i] = e.spec(t, fmt.Sprintf("c%d", i))
		stopAtEnd(t, d, specs[i].ID)
	}
	begin = time.Now()
	var wg sync.WaitGroup
	for i := range specs {
		wg.Go(func() {
			b := time.Now()
			_, errs[i] = d.Restore(ctx, specs[i], img)
			t.Logf("restore %s: %v", specs[i].ID, time.Since(b))
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	t.Logf("restore of %d clones at once: %v", n, time.Since(begin))
	clients := make([]*http.Client, n)
	for i, s := range specs {
		clients[i] = agentClient(ctx, t, d, s.ID, 30*time.Second)
		if got := strings.TrimSpace(run(ctx, t, clients[i], probe)); got != want {
			t.Errorf("%s: %q, want %q (the template's memory at its snapshot)", s.ID, got, want)
		}
		if sh := mustLoad(t, d, s.ID).Shape; sh.SharedRAM || !sh.RAMObject {
			t.Errorf("%s: clone shape %+v: want RAMObject, not SharedRAM", s.ID, sh)
		}
	}
	// Copy on write: a clone's write is its own.
	run(ctx, t, clients[0], "echo c0 >/run/m/v")
	if got := strings.TrimSpace(run(ctx, t, clients[1], "cat /run/m/v")); got != marker {
		t.Errorf("c1 reads %q after c0 wrote: want %q", got, marker)
	}
	run(ctx, t, clients[1], "echo c1 >/run/m/v")
	if got := strings.TrimSpace(run(ctx, t, clients[0], "cat /run/m/v")); got != "c0" {
		t.Errorf("c0 reads %q after c1 wrote: want c0", got)
	}

	// Host memory of idle clones.
	time.Sleep(2 * time.Second)
	for _, s := range specs {
		st := wantState(t, d, s.ID, runtime.StatusRunning)
		m, err := SmapsRollup(st.PID)
		if err != nil {
			t.Fatal(err)
		}
		g, err := TemplateMapping(st.PID)
		if err != nil {
			t.Fatal(err)
		}
		own := m["Pss"] - m["Pss_Shmem"]
		t.Logf("%s idle: Rss %d MiB, Pss %d MiB = template pages (Pss_Shmem, shared by every clone) %d MiB + beyond them %d MiB "+
			"(guest pages written since the restore, copied on write: %d MiB; QEMU itself, TCG's translation cache included: %d MiB)",
			s.ID, m["Rss"]>>10, m["Pss"]>>10, m["Pss_Shmem"]>>10, own>>10, g["Anonymous"]>>10, (own-g["Anonymous"])>>10)
		// Under TCG QEMU runs without transparent huge pages (the
		// jail helper's PR_SET_THP_DISABLE); this test process, the
		// control, has them.
		if d.Accel() == "tcg" {
			if got, self := thpEnabled(t, st.PID), thpEnabled(t, os.Getpid()); got != "0" || self != "1" {
				t.Errorf("%s: THP_enabled %q (the test's own: %q), want 0 under TCG", s.ID, got, self)
			}
		}
		if bd, err := smapsBreakdown(st.PID); err == nil {
			t.Logf("%s idle: %s", s.ID, formatBreakdown(bd))
		}
		if g["Rss"] == 0 {
			t.Errorf("%s: no resident page of the template mapping", s.ID)
		}
		if m["Pss_Shmem"] == 0 {
			t.Errorf("%s maps none of the template's pages", s.ID)
		}
		// A restore that copied the guest in would own its 256 MiB.
		if own > 160<<10 {
			t.Errorf("%s owns %d MiB beyond the template's pages: the RAM was copied", s.ID, own>>10)
		}
	}
	if got := fileSHA(t, ram); got != sum {
		t.Errorf("the snapshot's %s changed while clones ran", RAMFile)
	}

	// A snapshot of a clone is an ordinary full image (anonymous RAM
	// object) and restores with the clone's memory.
	cimg := filepath.Join(t.TempDir(), "c0img")
	if err := d.Checkpoint(ctx, specs[0].ID, cimg, false); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(cimg, RAMFile)); err == nil {
		t.Errorf("a clone's snapshot has a RAM file")
	}
	rs := e.spec(t, "c0again")
	copyFile(t, specs[0].Disk, rs.Disk)
	stopAtEnd(t, d, rs.ID)
	if _, err := d.Restore(ctx, rs, cimg); err != nil {
		t.Fatal(err)
	}
	rc := agentClient(ctx, t, d, rs.ID, 30*time.Second)
	if got := strings.TrimSpace(run(ctx, t, rc, "cat /run/m/v")); got != "c0" {
		t.Errorf("restore of c0's snapshot reads %q, want c0", got)
	}

	// Deleting the template while clones run: they keep their memory
	// (their mappings hold the sealed copy), the driver drops its copy,
	// and a new restore fails cleanly.
	if d.tmpl.len() != 1 {
		t.Errorf("driver caches %d template copies, want 1", d.tmpl.len())
	}
	if err := os.RemoveAll(img); err != nil {
		t.Fatal(err)
	}
	if got := d.tmpl.len(); got != 0 {
		t.Errorf("driver still caches %d template copies after the template went", got)
	}
	for i, s := range specs[1:] {
		// Pages not touched yet fault in from the sealed copy now.
		if got := run(ctx, t, clients[i+1], "cat /proc/[0-9]*/cmdline | tr '\\0' ' ' | grep -o 'sleep [0-9]*' | head -1; find / -xdev -type f 2>/dev/null | wc -l"); !strings.Contains(got, "sleep "+marker) {
			t.Errorf("%s after the template was deleted: %q", s.ID, got)
		}
	}
	ls := e.spec(t, "late")
	if _, err := d.Restore(ctx, ls, img); !errdefs.IsNotFound(err) {
		t.Errorf("restore of the deleted template: %v, want NotFound", err)
	}
	wantNoFiles(t, ls.BundleDir)
	for _, s := range append(slices.Clone(specs), rs) {
		if err := d.Stop(ctx, s.ID); err != nil {
			t.Fatal(err)
		}
	}
}

// TestSealedTemplateCopy: a clone's QEMU gets the template's RAM as a
// sealed memfd it may open read-write (QEMU 7.2 insists), so what stops
// it writing the template is the seal. Attack rows: write(2), a shared
// writable mapping, truncation, through a read-write reopen of
// /proc/self/fd (what QEMU does); each must fail with EPERM. Control: the
// same probes on the same memfd before sealing succeed. A private
// writable mapping (what QEMU does) works and leaves the memfd as it was.
func TestSealedTemplateCopy(t *testing.T) {
	src := filepath.Join(t.TempDir(), RAMFile)
	const size = 1 << 20
	b := make([]byte, size)
	copy(b[8192:], "template")
	if err := os.WriteFile(src, b, 0o600); err != nil {
		t.Fatal(err)
	}
	probe := func(f *os.File) map[string]error {
		rw, err := os.OpenFile(fmt.Sprintf("/proc/self/fd/%d", f.Fd()), os.O_RDWR, 0)
		if err != nil {
			return map[string]error{"reopen": err}
		}
		defer rw.Close()
		out := map[string]error{}
		_, out["write"] = rw.WriteAt([]byte("evil"), 8192)
		m, err := unix.Mmap(int(rw.Fd()), 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
		if err == nil {
			_ = unix.Munmap(m)
		}
		out["mmap shared"] = err
		out["truncate"] = rw.Truncate(0)
		return out
	}
	// Control: an unsealed memfd of the same contents takes every probe.
	ctl, err := newMemfd("control", size)
	if err != nil {
		t.Fatal(err)
	}
	defer ctl.Close()
	for what, err := range probe(ctl) {
		if err != nil {
			t.Errorf("control %s on an unsealed memfd: %v (the probe is broken)", what, err)
		} else {
			t.Logf("control: %s on an unsealed memfd succeeds", what)
		}
	}
	var c templateCache
	defer c.close()
	f, err := c.get(src, size)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	res := probe(f)
	for _, what := range []string{"write", "mmap shared", "truncate"} {
		if err := res[what]; !errors.Is(err, unix.EPERM) {
			t.Errorf("attack %s on the sealed template copy: %v, want EPERM", what, err)
		} else {
			t.Logf("attack: %s on the sealed copy: stopped by the seal (%v)", what, err)
		}
	}
	m, err := unix.Mmap(int(f.Fd()), 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE)
	if err != nil {
		t.Fatalf("private writable mapping (a clone's RAM): %v", err)
	}
	copy(m[8192:], "clone")
	_ = unix.Munmap(m)
	got := make([]byte, 8)
	if _, err := f.ReadAt(got, 8192); err != nil || string(got) != "template" {
		t.Errorf("template copy reads %q, %v after a private write: want template", got, err)
	}
	// Same file: the same copy. Replaced file: a new one.
	g, err := c.get(src, size)
	if err != nil {
		t.Fatal(err)
	}
	g.Close()
	if c.len() != 1 {
		t.Errorf("cache holds %d copies of one file", c.len())
	}
	if _, err := c.get(src, 2*size); !errdefs.IsInvalidArgument(err) {
		t.Errorf("get with the wrong size: %v, want InvalidArgument", err)
	}
	if err := os.Remove(src); err != nil {
		t.Fatal(err)
	}
	if c.len() != 0 {
		t.Errorf("cache keeps the copy of a removed file")
	}
}

func TestCopySparse(t *testing.T) {
	dir := t.TempDir()
	src := filepath.Join(dir, "src")
	f, err := os.Create(src)
	if err != nil {
		t.Fatal(err)
	}
	const size = 8 << 20
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	// Data at the start, a zero page written explicitly, data at the end.
	for off, s := range map[int64]string{0: "a", 3 << 20: strings.Repeat("\x00", ramPage), size - 10: "end"} {
		if _, err := f.WriteAt([]byte(s), off); err != nil {
			t.Fatal(err)
		}
	}
	f.Close()
	dst := filepath.Join(dir, "dst")
	if err := copyRAM(src, dst, size); err != nil {
		t.Fatal(err)
	}
	if a, b := fileSHA(t, src), fileSHA(t, dst); a != b {
		t.Errorf("copy differs from its source")
	}
}

func fileSHA(t testing.TB, path string) string {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(h.Sum(nil))
}

// TestJailProcTemplate: a template VM's (and a clone's) jail has a /proc,
// so QEMU can name the RAM file it inherited. Attack rows, as QEMU's uid
// in its mount namespace: list other processes, read PID 1's status, read
// a sysctl, write anything. Control: root in the same mount namespace,
// through the same procfs, sees other processes, so hidepid (not an empty
// procfs) is what hides them.
func TestJailProcTemplate(t *testing.T) {
	requireVM(t)
	testenv.RequireBinary(t, "nsenter", "util-linux")
	e := newEnv(t)
	e.d.jailExtra = []jailBind{{From: probeBin, To: jailProbe}}
	ctx := t.Context()
	s := e.spec(t, "jp")
	s.Labels = map[string]string{TemplateLabel: "t"}
	stopAtEnd(t, e.d, s.ID)
	if _, err := e.d.Start(ctx, s); err != nil {
		t.Fatal(err)
	}
	st := mustLoad(t, e.d, s.ID)
	uid := itoa(int(st.UID))
	asQEMU := func(args ...string) (string, error) {
		return probeRun(exec.Command("nsenter", append([]string{"-t", itoa(st.PID), "-m", "-S", uid, "-G", uid, "--", jailProbe}, args...)...))
	}
	asRootInJail := func(args ...string) (string, error) {
		return probeRun(exec.Command("nsenter", append([]string{"-t", itoa(st.PID), "-m", "--", jailProbe}, args...)...))
	}
	pids := func(ls string) []string {
		var out []string
		for _, f := range strings.Fields(ls) {
			if _, err := strconv.Atoi(f); err == nil {
				out = append(out, f)
			}
		}
		return out
	}
	out, err := asQEMU("ls", "/proc")
	if err != nil {
		t.Fatalf("ls /proc as QEMU: %v %s", err, out)
	}
	// nsenter's probe runs as QEMU's uid too, so it may see itself.
	if got := pids(out); len(got) > 2 || !slices.Contains(got, itoa(st.PID)) {
		t.Errorf("attack: QEMU's uid lists processes %v in its /proc, want its own only", got)
	} else {
		t.Logf("attack: ls /proc as QEMU's uid: pids %v (its own: stopped by hidepid=invisible)", got)
	}
	for _, f := range []string{"/proc/1/status", "/proc/sys/kernel/hostname", "/proc/meminfo"} {
		if out, err := asQEMU("cat", f); err == nil {
			t.Errorf("attack: QEMU read %s: %.80q", f, out)
		} else {
			t.Logf("attack: cat %s as QEMU: %s", f, firstLine(out))
		}
	}
	if out, err := asQEMU("sh", "-c", "echo x >/proc/self/comm"); err == nil {
		t.Errorf("attack: QEMU wrote its /proc (read-only mount expected): %q", out)
	} else {
		t.Logf("attack: write /proc/self/comm as QEMU: %s", firstLine(out))
	}
	// Control: root, same mount namespace and procfs, sees everyone. ls
	// exits 1 when a process it listed is gone before it looked at it
	// (the host runs other work): what it printed still counts.
	out, err = asRootInJail("ls", "/proc")
	if len(pids(out)) < 10 {
		t.Errorf("control: root in QEMU's mount namespace lists %d pids (%v): the probe cannot tell", len(pids(out)), err)
	} else {
		t.Logf("control: root in the same procfs lists %d pids", len(pids(out)))
	}
	// Control: a VM that is not a template has no /proc at all.
	s2 := e.spec(t, "jq")
	stopAtEnd(t, e.d, s2.ID)
	if _, err := e.d.Start(ctx, s2); err != nil {
		t.Fatal(err)
	}
	st2 := mustLoad(t, e.d, s2.ID)
	if out, err := probeRun(exec.Command("nsenter", "-t", itoa(st2.PID), "-m", "--", jailProbe, "ls", "/proc")); err == nil {
		t.Errorf("a plain VM's jail has a /proc: %q", out)
	}
}

// TestTemplateCacheConcurrent: restores of one template at once share one
// sealed copy (the first makes it, the others wait for it), and a second
// template gets its own.
func TestTemplateCacheConcurrent(t *testing.T) {
	dir := t.TempDir()
	const size = 4 << 20
	paths := []string{filepath.Join(dir, "a-"+RAMFile), filepath.Join(dir, "b-"+RAMFile)}
	for i, p := range paths {
		b := make([]byte, size)
		copy(b[4096:], fmt.Sprintf("template %d", i))
		if err := os.WriteFile(p, b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	var c templateCache
	var wg sync.WaitGroup
	errs := make([]error, 16)
	for i := range errs {
		wg.Go(func() {
			f, err := c.get(paths[i%2], size)
			if err == nil {
				buf := make([]byte, 10)
				if _, err = f.ReadAt(buf, 4096); err == nil && string(buf) != fmt.Sprintf("template %d", i%2) {
					err = fmt.Errorf("restore %d read %q from its template's copy", i, buf)
				}
				f.Close()
			}
			errs[i] = err
		})
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Errorf("restore %d: %v", i, err)
		}
	}
	if n := c.len(); n != 2 {
		t.Fatalf("%d cached copies after restores of 2 templates, want 2", n)
	}
}
