package runc

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	gorunc "github.com/containerd/go-runc"
	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/cubesandbox/cube/internal/nsdial"
	"github.com/cubesandbox/cube/internal/runtime"
	"github.com/cubesandbox/cube/internal/runtime/ocispec"
)

// buildProbe compiles internal/runtime/testdata/probe statically (busybox
// has no keyctl, bpf or perf_event_open).
func buildProbe(t *testing.T) string {
	t.Helper()
	out := filepath.Join(t.TempDir(), "probe")
	cmd := exec.Command("go", "build", "-o", out, "./testdata/probe")
	cmd.Dir = ".."
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build probe: %v\n%s", err, b)
	}
	return out
}

// startWith starts s the way Driver.Start does, with mutate applied to the
// OCI spec first: the controls of the hardening rows are sandboxes with
// one protection taken away, which Start (rightly) cannot be asked for.
func startWith(ctx context.Context, t *testing.T, d *Driver, s runtime.Spec, mutate func(*specs.Spec)) {
	t.Helper()
	spec, err := ocispec.For(s)
	if err != nil {
		t.Fatal(err)
	}
	allowUnprivilegedPing(spec)
	fitRlimits(spec)
	if mutate != nil {
		mutate(spec)
	}
	if err := writeBundle(s.BundleDir, spec); err != nil {
		t.Fatal(err)
	}
	console, err := os.OpenFile(filepath.Join(s.BundleDir, "console.log"), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer console.Close()
	t.Cleanup(func() { _ = d.Stop(context.Background(), s.ID) })
	if _, err := d.rc.Run(ctx, s.ID, s.BundleDir, &gorunc.CreateOpts{IO: fileIO{console}, Detach: true}); err != nil {
		b, _ := os.ReadFile(filepath.Join(s.BundleDir, "console.log"))
		t.Fatalf("runc run %s: %v\n%s", s.ID, err, b)
	}
}

// execIn runs args in sandbox id with the process settings of its
// config.json (capabilities, no_new_privs, rlimits; seccomp applies to
// the whole container), as uid when uid > 0 and then with no
// capabilities, as the agent starts a user's commands.
func execIn(t *testing.T, d *Driver, bundle, id string, uid uint32, args ...string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(bundle, "config.json"))
	if err != nil {
		t.Fatal(err)
	}
	var sp specs.Spec
	if err := json.Unmarshal(b, &sp); err != nil {
		t.Fatal(err)
	}
	p := *sp.Process
	p.Args = args
	if uid > 0 {
		p.User = specs.User{UID: uid, GID: uid}
		p.Capabilities = &specs.LinuxCapabilities{}
	}
	pb, err := json.Marshal(p)
	if err != nil {
		t.Fatal(err)
	}
	pf := filepath.Join(t.TempDir(), "process.json")
	if err := os.WriteFile(pf, pb, 0o600); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(d.rc.Command, "--root", d.rc.Root, "exec", "-p", pf, id).CombinedOutput()
	if err != nil {
		// A probe that is refused exits 1; its output says why.
		if exit := (*exec.ExitError)(nil); !errors.As(err, &exit) {
			t.Fatalf("runc exec %s %v: %v: %s", id, args, err, out)
		}
	}
	return string(out)
}

// parseProbes reads `probe all`: one "name: ok: ..." or
// "name: refused: ..." line per probe.
func parseProbes(t *testing.T, out string) map[string]string {
	t.Helper()
	res := map[string]string{}
	for line := range strings.Lines(out) {
		name, rest, ok := strings.Cut(strings.TrimSpace(line), ": ")
		if ok {
			res[name] = rest
		}
	}
	if len(res) == 0 {
		t.Fatalf("no probe output: %q", out)
	}
	return res
}

// hardeningRow is one attack and what must stop it.
type hardeningRow struct {
	probe string
	// seccomp: the filter alone stops it (refused in the seccomp-only
	// sandbox too); otherwise another control does and the seccomp-only
	// sandbox, which lacks that control, lets it through.
	seccomp bool
	refusal string // what the refusal in the sandbox says
	stopper string // the control, for the log
	host    string // a host file the row needs; the row is skipped without it
}

var hardeningRows = []hardeningRow{
	{probe: "keyctl", seccomp: true, refusal: "operation not permitted", stopper: "seccomp (keyctl)"},
	{probe: "add_key", seccomp: true, refusal: "operation not permitted", stopper: "seccomp (add_key)"},
	{probe: "bpf", seccomp: true, refusal: "operation not permitted", stopper: "seccomp (bpf), and no CAP_BPF/CAP_SYS_ADMIN"},
	{probe: "perf_event_open", seccomp: true, refusal: "operation not permitted", stopper: "seccomp (perf_event_open)"},
	{probe: "userfaultfd", seccomp: true, refusal: "operation not permitted", stopper: "seccomp (userfaultfd)"},
	{probe: "mount", seccomp: true, refusal: "operation not permitted", stopper: "seccomp (mount), and no CAP_SYS_ADMIN"},
	{probe: "unshare-user-net", seccomp: true, refusal: "operation not permitted", stopper: "seccomp (unshare with namespace flags)"},
	{probe: "clone-newuser", seccomp: true, refusal: "operation not permitted", stopper: "seccomp (clone with namespace flags)"},
	{probe: "clone3", seccomp: true, refusal: "function not implemented", stopper: "seccomp (clone3 answers ENOSYS)"},
	{probe: "setns", seccomp: true, refusal: "operation not permitted", stopper: "seccomp (setns), and no CAP_SYS_ADMIN"},
	{probe: "open_by_handle_at", seccomp: true, refusal: "operation not permitted", stopper: "seccomp (open_by_handle_at), and no CAP_DAC_READ_SEARCH"},
	{probe: "personality", seccomp: true, refusal: "operation not permitted", stopper: "seccomp (personality values)"},
	{probe: "vsock", seccomp: true, refusal: "operation not permitted", stopper: "seccomp (socket(AF_VSOCK))", host: "/dev/vsock"},
	{probe: "vsock-high", seccomp: true, refusal: "operation not permitted", stopper: "seccomp (socket families compared on the low 32 bits)", host: "/dev/vsock"},
	// The user namespace refuses first (host root owns /proc/sys/kernel's
	// files; permission is checked before the read-only mount).
	{probe: "proc-sys", refusal: "permission denied", stopper: "the user namespace (host root's files), and /proc/sys read-only"},
	{probe: "sysrq", refusal: "read-only file system", stopper: "/proc/sysrq-trigger read-only", host: "/proc/sysrq-trigger"},
	{probe: "sys", refusal: "read-only file system", stopper: "/sys mounted read-only"},
	{probe: "interrupts", refusal: "empty (masked)", stopper: "/proc/interrupts masked"},
	{probe: "firmware", refusal: "empty (masked)", stopper: "/sys/firmware masked"},
	{probe: "proc1-fd1", refusal: "permission denied", stopper: "cube-agent non-dumpable (no CAP_SYS_PTRACE)"},
	{probe: "proc1-environ", refusal: "permission denied", stopper: "cube-agent non-dumpable (no CAP_SYS_PTRACE)"},
	{probe: "proc1-mem", refusal: "permission denied", stopper: "cube-agent non-dumpable (no CAP_SYS_PTRACE)"},
	{probe: "ptrace1", refusal: "operation not permitted", stopper: "cube-agent non-dumpable (no CAP_SYS_PTRACE)"},
}

// unprotect takes away what the rows test, except the seccomp filter:
// capabilities the seccomp rows would otherwise also miss, no_new_privs,
// read-only and masked paths, the read-only /sys. CAP_SYS_PTRACE stays
// out, so PID 1's dumpability alone decides the /proc/1 rows.
func unprotect(sp *specs.Spec) {
	extra := []string{"CAP_SYS_ADMIN", "CAP_BPF", "CAP_PERFMON", "CAP_DAC_READ_SEARCH"}
	c := sp.Process.Capabilities
	c.Bounding = append(c.Bounding, extra...)
	c.Effective = append(c.Effective, extra...)
	c.Permitted = append(c.Permitted, extra...)
	sp.Process.NoNewPrivileges = false
	sp.Linux.ReadonlyPaths, sp.Linux.MaskedPaths = nil, nil
	for i, m := range sp.Mounts {
		if m.Destination == "/sys" {
			sp.Mounts[i].Options = slices.DeleteFunc(slices.Clone(m.Options), func(o string) bool { return o == "ro" })
		}
	}
}

// TestHardening runs every attack of hardeningRows from inside three
// sandboxes: the real one (ocispec.For, cube-agent as PID 1), one with
// only the seccomp filter left (capabilities added, no no_new_privs, no
// read-only or masked paths, a dumpable PID 1) and one with nothing
// (that, less the filter). A row passes when the real sandbox refuses
// it, the unprotected one lets it through (so the probe works), and the
// seccomp-only one agrees with what the row says stops it. The
// setuid row: a setuid-root binary run by uid 1000 stays uid 1000 under
// no_new_privs and becomes root without it.
func TestHardening(t *testing.T) {
	requireRoot(t)
	probe, agentBin := buildProbe(t), buildAgent(t)
	parent := cgroupParent(t)
	d := newTestDriver(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	type sandbox struct {
		name   string
		spec   runtime.Spec
		mutate func(*specs.Spec)
		agent  bool
	}
	mk := func(name string, agent bool, mutate func(*specs.Spec)) *sandbox {
		dir := t.TempDir()
		extra := map[string]string{probe: "usr/local/bin/probe"}
		args := []string{"/bin/sleep", "1000000"}
		if agent {
			extra[agentBin] = "usr/local/bin/cube-agent"
			args = []string{"/usr/local/bin/cube-agent"}
		}
		root := busyboxRootFS(t, dir, extra)
		suid := filepath.Join(root, "usr/local/bin/suid-probe")
		copyFile(t, probe, suid)
		if err := os.Chown(suid, 0, 0); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(suid, os.ModeSetuid|0o755); err != nil {
			t.Fatal(err)
		}
		return &sandbox{name: name, agent: agent, mutate: mutate, spec: runtime.Spec{
			ID: "hard-" + name, BundleDir: filepath.Join(dir, "bundle"), RootFS: root, Args: args,
			Env: []string{"PATH=/usr/local/bin:/bin"}, CgroupPath: parent + "/hard-" + name,
			Limits: runtime.Limits{MilliCPU: 500, MemoryMiB: 128, Pids: 64},
		}}
	}
	prod := mk("real", true, nil)
	seccompOnly := mk("seccomp", false, unprotect)
	none := mk("none", false, func(sp *specs.Spec) { unprotect(sp); sp.Linux.Seccomp = nil })

	t.Cleanup(func() { _ = d.Stop(context.Background(), prod.spec.ID) })
	st, err := d.Start(ctx, prod.spec)
	if err != nil {
		t.Fatal(err)
	}
	// The agent answers: it works under the filter, and it has made
	// itself non-dumpable (first thing at start) before the probes run.
	client := nsdial.HTTPClient(fmt.Sprintf("/proc/%d/ns/net", st.PID))
	t.Cleanup(client.CloseIdleConnections)
	t.Logf("agent healthy %v after start", waitHealthy(t, client))
	for _, sb := range []*sandbox{seccompOnly, none} {
		startWith(ctx, t, d, sb.spec, sb.mutate)
	}

	results := map[string]map[string]string{}
	euid := map[string]string{}
	var mu sync.Mutex
	var wg sync.WaitGroup
	for _, sb := range []*sandbox{prod, seccompOnly, none} {
		wg.Go(func() {
			all := parseProbes(t, execIn(t, d, sb.spec.BundleDir, sb.spec.ID, 0, "/usr/local/bin/probe", "all"))
			e := strings.TrimSpace(execIn(t, d, sb.spec.BundleDir, sb.spec.ID, 1000, "/usr/local/bin/suid-probe", "euid"))
			mu.Lock()
			results[sb.name], euid[sb.name] = all, e
			mu.Unlock()
		})
	}
	wg.Wait()

	refused := func(got, want string) bool {
		return strings.HasPrefix(got, "refused:") && strings.Contains(got, want)
	}
	for _, row := range hardeningRows {
		t.Run(row.probe, func(t *testing.T) {
			if row.host != "" {
				if _, err := os.Stat(row.host); err != nil {
					t.Skipf("this host has no %s (the row cannot succeed anywhere here)", row.host)
				}
			}
			r, s, n := results["real"][row.probe], results["seccomp"][row.probe], results["none"][row.probe]
			if !refused(r, row.refusal) {
				t.Errorf("sandbox: %q, want refused (%s)", r, row.refusal)
			}
			if !strings.HasPrefix(n, "ok:") {
				t.Errorf("control without protections: %q, want ok (the probe cannot succeed, so its refusal proves nothing)", n)
			}
			if row.seccomp && !refused(s, row.refusal) {
				t.Errorf("seccomp-only sandbox: %q, want refused by the filter alone", s)
			}
			if !row.seccomp && !strings.HasPrefix(s, "ok:") {
				t.Errorf("seccomp-only sandbox: %q, want ok (%s is what stops it)", s, row.stopper)
			}
			t.Logf("tried %s: sandbox %q; seccomp only %q; unprotected %q; stopped by %s", row.probe, r, s, n, row.stopper)
		})
	}
	t.Run("setuid", func(t *testing.T) {
		if euid["real"] != "uid=1000 euid=1000 nnp=1" {
			t.Errorf("setuid-root binary run by uid 1000 in the sandbox: %q, want euid 1000", euid["real"])
		}
		if euid["seccomp"] != "uid=1000 euid=0 nnp=0" || euid["none"] != "uid=1000 euid=0 nnp=0" {
			t.Errorf("control without no_new_privs: %q / %q, want euid 0", euid["seccomp"], euid["none"])
		}
		t.Logf("tried a setuid-root binary as uid 1000: sandbox %q; without no_new_privs %q; stopped by no_new_privs", euid["real"], euid["seccomp"])
	})

	// Every probe the binary knows is a row: a probe added without a row
	// would prove nothing.
	var names []string
	for n := range results["none"] {
		if !slices.ContainsFunc(hardeningRows, func(r hardeningRow) bool { return r.probe == n }) {
			names = append(names, n)
		}
	}
	sort.Strings(names)
	if len(names) > 0 {
		t.Errorf("probes without a row: %v", names)
	}
}

// TestMeasureSeccomp prints what the seccomp filter and no_new_privs add
// to a create: `runc run -d` of the same sandbox with and without them,
// interleaved. It only runs with CUBE_RUNC_MEASURE=<iterations>.
func TestMeasureSeccomp(t *testing.T) {
	requireRoot(t)
	n := 0
	if _, err := fmt.Sscan(os.Getenv("CUBE_RUNC_MEASURE"), &n); err != nil || n <= 0 {
		t.Skip("set CUBE_RUNC_MEASURE=<iterations> to measure")
	}
	parent := cgroupParent(t)
	d := newTestDriver(t)
	ctx := t.Context()
	variants := []struct {
		name   string
		mutate func(*specs.Spec)
	}{
		{"with seccomp+nnp", nil},
		{"without", func(sp *specs.Spec) { sp.Linux.Seccomp = nil; sp.Process.NoNewPrivileges = false }},
	}
	times := map[string][]time.Duration{}
	for i := range n {
		for _, v := range variants {
			spec := sleepSpec(t, parent, fmt.Sprintf("m-%d-%s", i, strings.Fields(v.name)[0]))
			begin := time.Now()
			startWith(ctx, t, d, spec, v.mutate)
			times[v.name] = append(times[v.name], time.Since(begin))
			if err := d.Stop(ctx, spec.ID); err != nil {
				t.Fatal(err)
			}
		}
	}
	for _, v := range variants {
		ts := times[v.name]
		slices.Sort(ts)
		t.Logf("runc run -d %-17s n=%d median %v p90 %v", v.name, len(ts), ts[len(ts)/2].Round(time.Microsecond*100), ts[len(ts)*9/10].Round(time.Microsecond*100))
	}
}
