package gvisor

import (
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/cubesandbox/cube/internal/agentproto"
	"github.com/cubesandbox/cube/internal/runtime"
)

// buildStatic compiles pkg (relative to internal/runtime) statically.
func buildStatic(t *testing.T, pkg, dir string) string {
	t.Helper()
	out := filepath.Join(t.TempDir(), filepath.Base(pkg))
	cmd := exec.Command("go", "build", "-o", out, pkg)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build %s: %v\n%s", pkg, err, b)
	}
	return out
}

func installFile(t *testing.T, src, dst string, mode os.FileMode) {
	t.Helper()
	b, err := os.ReadFile(src)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(dst, b, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(dst, mode); err != nil {
		t.Fatal(err)
	}
}

// probeSpec is a busybox sandbox running args, with the probe (and a
// setuid-root copy) and cube-agent in /usr/local/bin.
func probeSpec(t *testing.T, parent, id string, args []string, probe, agentBin string) runtime.Spec {
	t.Helper()
	s := shellSpec(t, parent, id, "")
	s.Args = args
	s.Env = []string{"PATH=/usr/local/bin:/bin"}
	installFile(t, probe, filepath.Join(s.RootFS, "usr/local/bin/probe"), 0o755)
	installFile(t, probe, filepath.Join(s.RootFS, "usr/local/bin/suid-probe"), os.ModeSetuid|0o755)
	installFile(t, agentBin, filepath.Join(s.RootFS, "usr/local/bin/cube-agent"), 0o755)
	return s
}

// waitListening waits for cube-agent's "agent listening" on the console:
// by then it has protected itself and, where asked, detached.
func waitListening(t *testing.T, bundle string) string {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		b, _ := os.ReadFile(filepath.Join(bundle, "console.log"))
		if strings.Contains(string(b), "agent listening") {
			return string(b)
		}
		if time.Now().After(deadline) {
			t.Fatalf("the agent never started: %s", b)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// runscExec runs args in sandbox id with the process settings of its
// config.json less CAP_SYS_ADMIN (which only the agent, PID 1, holds:
// what it starts never has it), as uid when uid > 0 and then with no
// capabilities, as the agent starts a user's commands.
func runscExec(t *testing.T, d *Driver, bundle, id string, uid uint32, args ...string) string {
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
	p.Env = slices.DeleteFunc(slices.Clone(p.Env), func(e string) bool { return strings.HasPrefix(e, agentproto.DropSysAdminEnv+"=") })
	drop := func(cs []string) []string {
		return slices.DeleteFunc(slices.Clone(cs), func(c string) bool { return c == capSysAdmin })
	}
	p.Capabilities = &specs.LinuxCapabilities{Bounding: drop(p.Capabilities.Bounding), Effective: drop(p.Capabilities.Effective), Permitted: drop(p.Capabilities.Permitted)}
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
	out, err := exec.Command(d.bin, "--root", d.root, "--platform="+d.platform, "exec", "--process", pf, id).CombinedOutput()
	if exit := (*exec.ExitError)(nil); err != nil && !errors.As(err, &exit) {
		t.Fatalf("runsc exec %s %v: %v: %s", id, args, err, out)
	}
	return string(out)
}

// TestProbeReport runs the runc driver's hardening probes
// (internal/runtime/testdata/probe) in a gVisor sandbox as SpecFor builds
// it, cube-agent as PID 1, and in a control with PID 1 a dumpable sleep,
// no read-only or masked paths, a read-write /sys and no no_new_privs,
// and logs what each probe got in both (docs/security.md reports it). It
// asserts nothing, so it only runs with CUBE_GVISOR_PROBES=1: the checks
// with controls are the runc driver's TestHardening, and the
// cross-runtime escape suite.
func TestProbeReport(t *testing.T) {
	requireRunsc(t)
	if os.Getenv("CUBE_GVISOR_PROBES") == "" {
		t.Skip("set CUBE_GVISOR_PROBES=1 to print what the probes get in gVisor")
	}
	probe := buildStatic(t, "./testdata/probe", "..")
	agentBin := buildStatic(t, "./cmd/cube-agent", "../../..")
	d, parent := newTestDriver(t), cgroupParent(t)
	ctx := t.Context()

	mk := func(id string, args []string) runtime.Spec { return probeSpec(t, parent, id, args, probe, agentBin) }
	sb := mk("hard-real", []string{"/usr/local/bin/cube-agent"})
	ctrl := mk("hard-ctrl", []string{"/bin/sleep", "1000000"})
	stopAtEnd(t, d, sb.ID)
	stopAtEnd(t, d, ctrl.ID)
	if _, err := d.Start(ctx, sb); err != nil {
		t.Fatal(err)
	}
	cs, err := SpecFor(ctrl)
	if err != nil {
		t.Fatal(err)
	}
	cs.Process.NoNewPrivileges = false
	cs.Linux.ReadonlyPaths, cs.Linux.MaskedPaths = nil, nil
	for i, m := range cs.Mounts {
		if m.Destination == "/sys" {
			cs.Mounts[i].Options = slices.DeleteFunc(slices.Clone(m.Options), func(o string) bool { return o == "ro" })
		}
	}
	if _, err := d.launch(ctx, ctrl.ID, ctrl.BundleDir, cs, ""); err != nil {
		t.Fatal(err)
	}
	waitListening(t, sb.BundleDir)

	res := map[string]map[string]string{}
	for _, s := range []runtime.Spec{sb, ctrl} {
		res[s.ID] = map[string]string{}
		for line := range strings.Lines(runscExec(t, d, s.BundleDir, s.ID, 0, "/usr/local/bin/probe", "all")) {
			if name, rest, ok := strings.Cut(strings.TrimSpace(line), ": "); ok {
				res[s.ID][name] = rest
			}
		}
		res[s.ID]["setuid"] = strings.TrimSpace(runscExec(t, d, s.BundleDir, s.ID, 1000, "/usr/local/bin/suid-probe", "euid"))
	}
	t.Logf("console truncation in gVisor (what the agent's cap relies on): %s",
		strings.TrimSpace(runscExec(t, d, ctrl.BundleDir, ctrl.ID, 0, "/usr/local/bin/probe", "ftruncate", "/proc/1/fd/1")))
	names := make([]string, 0, len(res[ctrl.ID]))
	for n := range res[ctrl.ID] {
		names = append(names, n)
	}
	slices.Sort(names)
	for _, n := range names {
		r, c := res[sb.ID][n], res[ctrl.ID][n]
		t.Logf("%-18s sandbox %q; control %q", n, r, c)
	}
}

// TestSpecForHasNoSeccomp: runsc would ignore the filter anyway (no
// --oci-seccomp); config.json says what applies. And the agent is asked to
// let go of its console (TestConsoleOutOfReach).
func TestSpecForHasNoSeccomp(t *testing.T) {
	sp, err := SpecFor(runtime.Spec{ID: "x", RootFS: "/r", Args: []string{"/bin/true"}})
	if err != nil {
		t.Fatal(err)
	}
	if sp.Linux.Seccomp != nil {
		t.Errorf("gVisor spec carries a seccomp filter")
	}
	if !sp.Process.NoNewPrivileges {
		t.Errorf("gVisor spec lost no_new_privs")
	}
	if !slices.Contains(sp.Process.Env, agentproto.DetachConsoleEnv+"=1") {
		t.Errorf("gVisor spec does not ask the agent to detach from the console: %v", sp.Process.Env)
	}
}

// TestConsoleOutOfReach: gVisor's sentry lets root in the sandbox open the
// agent's /proc/1/fd/1 although the agent is non-dumpable, so the agent
// detaches from the console (agentproto.DetachConsoleEnv, set by SpecFor)
// once it listens: the probe then finds /dev/null there, not the console
// file on the host. Control: the same sandbox without that variable, where
// the probe opens the console file for writing (the flood would work).
func TestConsoleOutOfReach(t *testing.T) {
	requireRunsc(t)
	probe := buildStatic(t, "./testdata/probe", "..")
	agentBin := buildStatic(t, "./cmd/cube-agent", "../../..")
	d, parent := newTestDriver(t), cgroupParent(t)
	ctx := t.Context()
	agent := []string{"/usr/local/bin/cube-agent"}

	sb := probeSpec(t, parent, "console-real", agent, probe, agentBin)
	stopAtEnd(t, d, sb.ID)
	if _, err := d.Start(ctx, sb); err != nil {
		t.Fatal(err)
	}
	ctrl := probeSpec(t, parent, "console-ctrl", agent, probe, agentBin)
	stopAtEnd(t, d, ctrl.ID)
	cs, err := SpecFor(ctrl)
	if err != nil {
		t.Fatal(err)
	}
	cs.Process.Env = slices.DeleteFunc(cs.Process.Env, func(e string) bool { return strings.HasPrefix(e, agentproto.DetachConsoleEnv+"=") })
	if _, err := d.launch(ctx, ctrl.ID, ctrl.BundleDir, cs, ""); err != nil {
		t.Fatal(err)
	}
	for _, b := range []string{sb.BundleDir, ctrl.BundleDir} {
		waitListening(t, b)
	}
	// The detach follows the "listening" line; give it a moment.
	deadline := time.Now().Add(10 * time.Second)
	for {
		b, _ := os.ReadFile(filepath.Join(sb.BundleDir, "console.log"))
		if strings.Contains(string(b), "console detached") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the agent never detached: %s", b)
		}
		time.Sleep(50 * time.Millisecond)
	}
	got := strings.TrimSpace(runscExec(t, d, sb.BundleDir, sb.ID, 0, "/usr/local/bin/probe", "proc1-fd1"))
	ctl := strings.TrimSpace(runscExec(t, d, ctrl.BundleDir, ctrl.ID, 0, "/usr/local/bin/probe", "proc1-fd1"))
	if !strings.HasPrefix(got, "refused:") {
		t.Errorf("sandbox: /proc/1/fd/1 gave %q, want refused (not the console)", got)
	}
	if !strings.HasPrefix(ctl, "ok:") {
		t.Errorf("control (agent keeps its console): %q, want the console file opened", ctl)
	}
	t.Logf("tried to open the agent's stdout through /proc/1/fd/1 as root: sandbox %q; control %q; stopped by the agent detaching from the console", got, ctl)
}
