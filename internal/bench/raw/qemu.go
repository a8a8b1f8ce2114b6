package raw

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/agentchan"
	"github.com/cubesandbox/cube/internal/runtime/vm"
)

// qemu-incoming: the floor under a VM create from a warm template. Bare
// QEMU, started by hand with the warm snapshot's shape and
// `-incoming "exec:zstd -dc memory.zst"` on a fresh FICLONE of the
// snapshot's disk, in a fresh network namespace (QEMU makes the TAP the
// NIC expects, and it goes with the namespace); the clock stops when the
// agent inside answers /health over the virtio-serial channel after QMP
// reported the migration completed and the VM was continued. What it
// leaves out of a create: cgroup, network slot, state store, reinit.

// incomingTimeout bounds a raw restore's migration.
const incomingTimeout = 2 * time.Minute

// QemuBinary is the QEMU the raw restore runs.
const QemuBinary = "qemu-system-x86_64"

// Incoming is one timed raw restore of the VM snapshot in mem with a
// FICLONE of disk, in work (removed at the end); cid is the vsock CID
// the guest gets where the snapshot has vsock.
func Incoming(ctx context.Context, mem, disk, work string, cid uint32) (took time.Duration, err error) {
	if err := os.MkdirAll(work, 0o755); err != nil {
		return 0, err
	}
	// Runs last, after QEMU is gone.
	defer func() { err = errors.Join(err, os.RemoveAll(work)) }()
	clone := filepath.Join(work, "disk.img")
	if err := ficlone(disk, clone); err != nil {
		return 0, err
	}
	args, f, err := vm.RawIncoming(mem, clone, work, cid)
	if err != nil {
		return 0, err
	}
	defer func() {
		err = errors.Join(err, killQemu(f.PIDFile))
	}()
	start := time.Now()
	// unshare --net: a namespace of its own for the TAP; it lives as long
	// as the daemonized QEMU does.
	cmd := exec.CommandContext(ctx, "unshare", append([]string{"--net", "--", QemuBinary}, args...)...)
	if out, err := cmd.CombinedOutput(); err != nil {
		return 0, fmt.Errorf("qemu -incoming: %w: %s %s", err, out, Tail(f.Log))
	}
	// A stream cut short inside the device state can leave QEMU 7.2
	// waiting for the rest for ever (docs/vm.md).
	wctx, cancel := context.WithTimeout(ctx, incomingTimeout)
	defer cancel()
	if err := vm.WaitIncoming(wctx, f, true); err != nil {
		return 0, fmt.Errorf("%w: %s", err, Tail(f.Log))
	}
	c := agentchan.SerialClient(f.Agent)
	if f.VsockCID != 0 {
		c = agentchan.VsockClient(f.VsockCID, agentchan.VsockPort)
	}
	defer c.CloseIdleConnections()
	if err := pollHealth(ctx, c, "http://agent/health", 60*time.Second); err != nil {
		return 0, err
	}
	return time.Since(start), nil
}

// pollHealth GETs url until it answers 2xx (the agent says 204), as
// cubelet waits for an agent.
func pollHealth(ctx context.Context, c *http.Client, url string, limit time.Duration) error {
	deadline := time.Now().Add(limit)
	var last error
	for time.Now().Before(deadline) {
		rctx, cancel := context.WithTimeout(ctx, time.Second)
		req, _ := http.NewRequestWithContext(rctx, http.MethodGet, url, nil)
		resp, err := c.Do(req)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode/100 == 2 {
				cancel()
				return nil
			}
			err = fmt.Errorf("status %s", resp.Status)
		}
		cancel()
		last = err
		if ctx.Err() != nil {
			return ctx.Err()
		}
		time.Sleep(2 * time.Millisecond)
	}
	return fmt.Errorf("agent did not answer /health within %s: %v", limit, last)
}

// killQemu kills the daemonized QEMU named by pidFile (none yet: nothing
// to do) and waits until it is gone, so its namespace and files go too.
func killQemu(pidFile string) error {
	pid, err := vm.ReadPIDFile(pidFile)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil && !errors.Is(err, syscall.ESRCH) {
		return err
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		// Not our child (it daemonized): poll until the PID is gone or
		// reused by something that is not this QEMU.
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
		if err != nil || !IsQemu(b) {
			return nil //nolint:nilerr // no /proc entry: the PID is gone
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("qemu %d still alive 10s after SIGKILL", pid)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// IsQemu reports whether cmdline (/proc/<pid>/cmdline) runs QemuBinary.
func IsQemu(cmdline []byte) bool {
	return len(cmdline) > 0 && filepath.Base(string(cmdline[:clen(cmdline)])) == QemuBinary
}

func clen(b []byte) int {
	for i, c := range b {
		if c == 0 {
			return i
		}
	}
	return len(b)
}

// ficlone makes dst a reflink copy of src.
func ficlone(src, dst string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	err = unix.IoctlFileClone(int(out.Fd()), int(in.Fd()))
	if cerr := out.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(dst)
		return fmt.Errorf("FICLONE %s: %w", src, err)
	}
	return nil
}

// CloneMem is the host memory of one VM clone's QEMU, from its smaps: Pss
// and how it splits. Template is its share of the warm template's pages
// (Pss_Shmem: the sealed RAM copy every clone maps); Own is the rest (Pss
// minus Template), of which CoW is guest RAM the clone wrote since its
// restore and the remainder QEMU itself (heap, TCG's translation cache).
type CloneMem struct {
	Pss, Template, Own, CoW int64 // bytes
}

// VMCloneMem measures the QEMU with this pid.
func VMCloneMem(pid int) (CloneMem, error) {
	m, err := vm.SmapsRollup(pid)
	if err != nil {
		return CloneMem{}, err
	}
	g, err := vm.TemplateMapping(pid)
	if err != nil {
		return CloneMem{}, err
	}
	c := CloneMem{Pss: m["Pss"] << 10, Template: m["Pss_Shmem"] << 10, CoW: g["Anonymous"] << 10}
	c.Own = c.Pss - c.Template
	return c, nil
}

// FullImage writes into out a full memory image of the shared-memory VM
// template snapshot in mem (vm.RawSaveFull: every RAM page in the
// stream, as snapshots were before templates shared memory), restoring it
// once by hand in work (removed at the end) and migrating it out: the
// qemu-incoming-full baseline restores that, the same guest state, the
// way a create did before.
func FullImage(ctx context.Context, mem, disk, work, out string) (err error) {
	if err := os.MkdirAll(work, 0o755); err != nil {
		return err
	}
	defer func() { err = errors.Join(err, os.RemoveAll(work)) }()
	clone := filepath.Join(work, "disk.img")
	if err := ficlone(disk, clone); err != nil {
		return err
	}
	args, f, err := vm.RawIncoming(mem, clone, work, 999)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, killQemu(f.PIDFile)) }()
	cmd := exec.CommandContext(ctx, "unshare", append([]string{"--net", "--", QemuBinary}, args...)...)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("qemu -incoming: %w: %s %s", err, out, Tail(f.Log))
	}
	wctx, cancel := context.WithTimeout(ctx, incomingTimeout)
	defer cancel()
	if err := vm.WaitIncoming(wctx, f, false); err != nil {
		return fmt.Errorf("%w: %s", err, Tail(f.Log))
	}
	if err := vm.RawSaveFull(ctx, f, mem, out); err != nil {
		return fmt.Errorf("%w: %s", err, Tail(f.Log))
	}
	return nil
}

// SharedMemory reports whether the VM snapshot in mem is a template with
// shared memory (its RAM a file beside a device-state stream).
func SharedMemory(mem string) bool {
	_, err := os.Stat(filepath.Join(mem, vm.RAMFile))
	return err == nil
}
