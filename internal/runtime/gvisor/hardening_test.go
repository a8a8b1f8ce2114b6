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

	mk := func(id string, args []string) runtime.Spec {
		s := shellSpec(t, parent, id, "")
		s.Args = args
		s.Env = []string{"PATH=/usr/local/bin:/bin"}
		installFile(t, probe, filepath.Join(s.RootFS, "usr/local/bin/probe"), 0o755)
		installFile(t, probe, filepath.Join(s.RootFS, "usr/local/bin/suid-probe"), os.ModeSetuid|0o755)
		installFile(t, agentBin, filepath.Join(s.RootFS, "usr/local/bin/cube-agent"), 0o755)
		return s
	}
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
	// Probe once the agent is up (it protects itself first thing).
	deadline := time.Now().Add(30 * time.Second)
	for {
		b, _ := os.ReadFile(filepath.Join(sb.BundleDir, "console.log"))
		if strings.Contains(string(b), "agent listening") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the agent never started: %s", b)
		}
		time.Sleep(50 * time.Millisecond)
	}

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
// --oci-seccomp); config.json says what applies.
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
}
