package vmguest

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/testenv"
)

// TestTCGBootWithoutTSCMeasurement: a TCG guest whose TSC measurement
// against the PIT fails still boots, because it is told its TSC frequency
// (TCGTSCParam). A loaded host makes the measurement fail by chance; here
// the machine has no PIT (pit=off), so it fails every time. The guest runs
// a shell from its initramfs (rdinit=/bin/sh): booted means its banner on
// the console. Control: the same command line without TCGTSCParam marks
// the TSC unstable and never gets past the delay-loop calibration, which
// waits for a timer tick nothing delivers, while QEMU runs on: the hang
// that kept a create waiting until the agent wait's ceiling.
func TestTCGBootWithoutTSCMeasurement(t *testing.T) {
	requireTools(t)
	testenv.RequireBinary(t, "qemu-system-x86_64", "qemu-system-x86")
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	a, err := Build(ctx, BuildConfig{OutDir: TestGuestDir, CacheDir: testCacheDir})
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	boot := func(name string, told bool) string {
		args := []string{"rdinit=/bin/sh", "ignore_loglevel"}
		cmdline := Cmdline(CmdlineOptions{TCG: true, Extra: args})
		if !told {
			cmdline = strings.Replace(cmdline, " "+TCGTSCParam, "", 1)
		}
		console := filepath.Join(dir, name+".log")
		q := exec.Command("qemu-system-x86_64", "-M", "microvm,pit=off,isa-serial=on,rtc=on",
			"-accel", "tcg", "-icount", "shift=auto", "-cpu", "max", "-m", "256", "-smp", "1",
			"-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
			"-serial", "file:"+console, "-kernel", a.Kernel, "-initrd", a.Initrd, "-append", cmdline)
		q.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
		if err := q.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			_ = q.Process.Kill() // fails only if it already exited
			_ = q.Wait()
		})
		return console
	}
	read := func(p string) string { b, _ := os.ReadFile(p); return string(b) }
	const (
		banner   = "built-in shell"
		measured = "Marking TSC unstable"
		delay    = "Calibrating delay loop"
	)
	start := time.Now()
	told, control := boot("told", true), boot("control", false)
	for !strings.Contains(read(told), banner) {
		if ctx.Err() != nil {
			t.Fatalf("guest told its TSC frequency did not boot; console:\n%s", read(told))
		}
		time.Sleep(100 * time.Millisecond)
	}
	took := time.Since(start)
	t.Logf("told %s, no PIT: shell after %v", TCGTSCParam, took.Round(time.Millisecond))
	// The control gets as long again, and 10 s more.
	time.Sleep(took + 10*time.Second)
	c := read(control)
	t.Logf("control (measures, no PIT) after %v: console ends with %q", time.Since(start).Round(time.Millisecond), tail(c, 120))
	if !strings.Contains(c, measured) {
		t.Fatalf("control: the TSC measurement did not fail; console:\n%s", c)
	}
	if strings.Contains(c, delay) || strings.Contains(c, banner) {
		t.Fatalf("control booted past the delay loop without a TSC frequency; console:\n%s", c)
	}
}

func tail(s string, n int) string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}
