package vm

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/hostload"
	"github.com/cubesandbox/cube/internal/runtime"
	"github.com/cubesandbox/cube/internal/vmguest"
)

// Files of a checkpoint dir.
const (
	MemoryFile = "memory.zst" // QEMU's migration stream, zstd-compressed (device state only with RAMFile)
	ShapeFile  = "vm.json"    // Shape
)

// migrateBandwidth lifts QEMU's default migration cap (32 MiB/s in 7.2),
// which would make a 256 MiB checkpoint take seconds.
const migrateBandwidth = 64 << 30

// migratePoll is how often query-migrate is asked while a stream runs.
const migratePoll = 10 * time.Millisecond

type migrateInfo struct {
	Status      string `json:"status"`
	ErrorDesc   string `json:"error-desc"`
	TotalTimeMS int64  `json:"total-time"`
}

// Checkpoint implements runtime.Driver: the VM is stopped (if it runs),
// its RAM and device state stream through "zstd -1" into dir/memory.zst,
// and dir/vm.json records the shape a restore must reuse. With
// leaveRunning the VM ends in the state it had before the call (a paused
// VM stays paused, so cubelet can copy the disk before thawing it);
// without, it is stopped and removed like Stop.
func (d *Driver) Checkpoint(ctx context.Context, id, dir string, leaveRunning bool) (err error) {
	begin := time.Now()
	st, err := d.load(id)
	if err != nil {
		return fmt.Errorf("vm checkpoint: %w", err)
	}
	if !filepath.IsAbs(dir) {
		return fmt.Errorf("vm checkpoint %s: dir %q is not absolute: %w", id, dir, errdefs.ErrInvalidArgument)
	}
	if !alive(st) {
		return fmt.Errorf("vm checkpoint %s: QEMU is gone: %w", id, errdefs.ErrFailedPrecondition)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("vm checkpoint %s: %w", id, err)
	}
	before, err := d.status(ctx, st)
	if err != nil {
		return fmt.Errorf("vm checkpoint %s: %w", id, err)
	}
	c, err := d.client(ctx, st)
	if err != nil {
		return fmt.Errorf("vm checkpoint %s: %w", id, err)
	}
	defer c.Close()
	mem, tmp := filepath.Join(dir, MemoryFile), filepath.Join(dir, MemoryFile+".tmp")
	ram, ramTmp := filepath.Join(dir, RAMFile), filepath.Join(dir, RAMFile+".tmp")
	written := false
	defer func() {
		if err != nil && !written {
			_ = os.Remove(tmp)
			_ = os.Remove(mem)
			_ = os.Remove(ramTmp)
			_ = os.Remove(ram)
			_ = os.Remove(filepath.Join(dir, ShapeFile))
			// Leave the VM as it was: a failed checkpoint must not
			// freeze a running sandbox.
			if before.Status == runtime.StatusRunning && alive(st) {
				_ = d.execute(context.WithoutCancel(ctx), st, "cont", nil, nil)
			}
		}
	}()
	// Stop first: the stream is then one pass over RAM, with no dirty
	// pages to resend, and the disk has been flushed.
	if err := c.Execute(ctx, "stop", nil, nil); err != nil {
		return fmt.Errorf("vm checkpoint %s: %w", id, err)
	}
	if err := c.Execute(ctx, "migrate-set-parameters", map[string]any{"max-bandwidth": int64(migrateBandwidth)}, nil); err != nil {
		return fmt.Errorf("vm checkpoint %s: %w", id, err)
	}
	if st.Shape.RAMObject {
		// A template VM: its RAM is copied as a file below, the stream
		// carries the device state only. A clone: its QEMU still has
		// the capability on from its own restore, and a stream that
		// says so would not load into a QEMU that has it off; its RAM
		// is private, so the stream carries all of it either way.
		if err := setIgnoreShared(ctx, c.Execute, st.Shape.SharedRAM); err != nil {
			return fmt.Errorf("vm checkpoint %s: %w", id, err)
		}
	}
	// The stream goes through a pipe the driver hands QEMU over QMP
	// (getfd) into "zstd -1", run by the driver: QEMU's sandbox lets it
	// spawn nothing, and its jail holds no path to write to.
	zw, err := startCompress(tmp, filepath.Join(st.Bundle, "qemu.log"))
	if err != nil {
		return fmt.Errorf("vm checkpoint %s: %w", id, err)
	}
	defer zw.kill()
	if err := addToCgroup(st.Cgroup, zw.cmd.Process.Pid); err != nil {
		d.log.DebugContext(ctx, "zstd stays in the driver's cgroup", "id", id, "error", err)
	}
	err = c.ExecuteFD(ctx, "getfd", map[string]any{"fdname": migrateFDName}, nil, zw.w)
	zw.w.Close()
	if err != nil {
		return fmt.Errorf("vm checkpoint %s: %w", id, err)
	}
	if err := c.Execute(ctx, "migrate", map[string]any{"uri": "fd:" + migrateFDName}, nil); err != nil {
		return fmt.Errorf("vm checkpoint %s: %w", id, err)
	}
	if err := d.waitMigrate(ctx, c.Execute, "migrate_cancel"); err != nil {
		return fmt.Errorf("vm checkpoint %s: %w%s", id, err, logTail(filepath.Join(st.Bundle, "qemu.log")))
	}
	// QEMU reports "completed" once the stream is in the pipe and closes
	// its end; the file is complete when zstd has exited cleanly.
	if err := zw.wait(ctx); err != nil {
		return fmt.Errorf("vm checkpoint %s: %w", id, err)
	}
	if st.Shape.SharedRAM {
		// Still stopped: the file is the RAM the device state goes with.
		if err := copyRAM(sharedRAMPath(st.Bundle), ramTmp, st.Shape.MemoryMiB<<20); err != nil {
			return fmt.Errorf("vm checkpoint %s: copy RAM: %w", id, err)
		}
		if err := os.Rename(ramTmp, ram); err != nil {
			return fmt.Errorf("vm checkpoint %s: %w", id, err)
		}
	} else {
		// A directory reused for a full image must not keep an older
		// template's RAM file beside it.
		_ = os.Remove(ram)
	}
	b, err := json.MarshalIndent(st.Shape, "", "  ")
	if err != nil {
		return fmt.Errorf("vm checkpoint %s: %w", id, err)
	}
	if err := os.WriteFile(filepath.Join(dir, ShapeFile), b, 0o600); err != nil {
		return fmt.Errorf("vm checkpoint %s: %w", id, err)
	}
	if err := os.Rename(tmp, mem); err != nil {
		return fmt.Errorf("vm checkpoint %s: %w", id, err)
	}
	// From here the image is complete: a failure to quit or resume the VM
	// does not make it less so.
	written = true
	d.log.DebugContext(ctx, "checkpoint", "id", id, "dir", dir, "leave_running", leaveRunning, "took", time.Since(begin))
	if !leaveRunning {
		c.Close()
		return d.destroy(ctx, st)
	}
	if before.Status == runtime.StatusRunning {
		if err := c.Execute(ctx, "cont", nil, nil); err != nil {
			return fmt.Errorf("vm checkpoint %s: cont: %w", id, err)
		}
	}
	return nil
}

type executeFunc func(ctx context.Context, cmd string, args, out any) error

// setIgnoreShared sets x-ignore-shared: on, RAM blocks mapped shared are
// left out of the stream. The stream records the capability and the
// incoming side must have the same (each block's header then carries its
// guest address, which it reads).
func setIgnoreShared(ctx context.Context, exec executeFunc, on bool) error {
	caps := map[string]any{"capabilities": []map[string]any{{"capability": "x-ignore-shared", "state": on}}}
	if err := exec(ctx, "migrate-set-capabilities", caps, nil); err != nil {
		return fmt.Errorf("migrate-set-capabilities x-ignore-shared: %w", err)
	}
	return nil
}

// waitMigrate polls query-migrate (or query-migrate on the incoming side)
// until the stream completed or failed. When ctx ends first it cancels
// the migration with cancelCmd ("" for none) and returns ctx's error.
func (d *Driver) waitMigrate(ctx context.Context, exec executeFunc, cancelCmd string) error {
	for {
		var mi migrateInfo
		if err := exec(ctx, "query-migrate", nil, &mi); err != nil {
			if ctx.Err() != nil && cancelCmd != "" {
				cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), hostload.Scale(qmpTimeout))
				_ = exec(cctx, cancelCmd, nil, nil)
				cancel()
			}
			return fmt.Errorf("query-migrate: %w", err)
		}
		switch mi.Status {
		case "completed":
			return nil
		case "failed", "cancelled":
			return fmt.Errorf("migration %s: %s: %w", mi.Status, mi.ErrorDesc, errdefs.ErrInternal)
		}
		select {
		case <-ctx.Done():
			if cancelCmd != "" {
				cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), hostload.Scale(qmpTimeout))
				_ = exec(cctx, cancelCmd, nil, nil)
				cancel()
			}
			return ctx.Err()
		case <-time.After(migratePoll):
		}
	}
}

// migrateFDName is the name the outgoing stream's pipe gets in QEMU.
const migrateFDName = "migrate"

// compressor is "zstd -1 -q" writing one checkpoint's image.
type compressor struct {
	w    *os.File // the pipe's write end, for QEMU
	cmd  *exec.Cmd
	done chan error
}

// startCompress starts zstd reading a pipe and writing path; its
// messages go to the VM's log. It runs as root in the host, a child of
// the driver: never under the VM's uid, which a compromised QEMU could
// ptrace from its jail into the host's namespaces.
func startCompress(path, log string) (*compressor, error) {
	out, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return nil, err
	}
	defer out.Close()
	logf, err := os.OpenFile(log, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		return nil, err
	}
	defer logf.Close()
	r, w, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	defer r.Close()
	cmd := exec.Command("zstd", "-1", "-q")
	cmd.Stdin, cmd.Stdout, cmd.Stderr = r, out, logf
	if err := cmd.Start(); err != nil {
		w.Close()
		return nil, fmt.Errorf("zstd: %w", err)
	}
	z := &compressor{w: w, cmd: cmd, done: make(chan error, 1)}
	go func() { z.done <- cmd.Wait() }()
	return z, nil
}

// wait returns once zstd exited: nil when it wrote the whole stream.
func (z *compressor) wait(ctx context.Context) error {
	select {
	case err := <-z.done:
		z.done <- err
		if err != nil {
			return fmt.Errorf("zstd failed writing the image: %w: %w", err, errdefs.ErrInternal)
		}
		return nil
	case <-time.After(zstdTimeout):
		return fmt.Errorf("zstd still writing after %s: %w", zstdTimeout, errdefs.ErrInternal)
	case <-ctx.Done():
		return ctx.Err()
	}
}

// kill ends zstd if it still runs (a failed checkpoint) and reaps it.
func (z *compressor) kill() {
	select {
	case err := <-z.done:
		z.done <- err
	default:
		_ = z.cmd.Process.Kill()
		z.done <- <-z.done
	}
}

// ReadShape reads a checkpoint dir's vm.json.
func ReadShape(dir string) (Shape, error) {
	b, err := os.ReadFile(filepath.Join(dir, ShapeFile))
	if errors.Is(err, fs.ErrNotExist) {
		return Shape{}, fmt.Errorf("no %s in %s: %w", ShapeFile, dir, errdefs.ErrNotFound)
	}
	if err != nil {
		return Shape{}, err
	}
	var s Shape
	if err := json.Unmarshal(b, &s); err != nil {
		return Shape{}, fmt.Errorf("%s: %v: %w", ShapeFile, err, errdefs.ErrInvalidArgument)
	}
	if s.MemoryMiB <= 0 || s.VCPUs <= 0 || s.Kernel == "" || s.Machine == "" || !slices.Contains(s.Devices, "virtio-blk") {
		return Shape{}, fmt.Errorf("%s in %s is incomplete: %w", ShapeFile, dir, errdefs.ErrInvalidArgument)
	}
	return s, nil
}

// Restore implements runtime.Driver: a new QEMU with the snapshot's shape
// (not s.Limits': a memory image fixes RAM size and vCPUs), on s.Disk,
// with its own sockets and s's network namespace, loads dir/memory.zst
// and runs. Where s asked for another shape, ShapeNote(s.ID) says so.
func (d *Driver) Restore(ctx context.Context, s runtime.Spec, dir string) (runtime.State, error) {
	fail := func(err error) (runtime.State, error) {
		return runtime.State{}, fmt.Errorf("vm restore %s: %w", s.ID, err)
	}
	if err := ctx.Err(); err != nil {
		return fail(err)
	}
	if !filepath.IsAbs(dir) {
		return fail(fmt.Errorf("image dir %q is not absolute: %w", dir, errdefs.ErrInvalidArgument))
	}
	image := filepath.Join(dir, MemoryFile)
	if _, err := os.Stat(image); err != nil {
		return fail(fmt.Errorf("no memory image in %s: %w", dir, errdefs.ErrNotFound))
	}
	shape, err := ReadShape(dir)
	if err != nil {
		return fail(err)
	}
	if shape.Accel != d.accel {
		return fail(fmt.Errorf("snapshot was taken under %s, this driver runs %s: QEMU cannot load it: %w", shape.Accel, d.accel, errdefs.ErrFailedPrecondition))
	}
	if sum, err := kernelSHA(shape.Kernel); err != nil || sum != shape.KernelSHA256 {
		// The guest dir may have been rebuilt; the same kernel there is fine.
		if g, gerr := vmguest.Load(d.guestDir); gerr == nil {
			if gs, _ := kernelSHA(g.Kernel); gs == shape.KernelSHA256 {
				shape.Kernel, shape.Initrd, err = g.Kernel, g.Initrd, nil
				sum = gs
			}
		}
		if err != nil || sum != shape.KernelSHA256 {
			return fail(fmt.Errorf("snapshot's kernel %s (sha256 %.12s) is not available: %w", shape.KernelVersion, shape.KernelSHA256, errdefs.ErrFailedPrecondition))
		}
	}
	if shape.has("virtio-net") && s.NetNSPath == "" {
		return fail(fmt.Errorf("snapshot has a network device: restore needs a NetNSPath with %s: %w", tapName, errdefs.ErrFailedPrecondition))
	}
	if shape.has("vhost-vsock") != d.vsock {
		return fail(fmt.Errorf("snapshot vsock=%v, this host vsock=%v: %w", shape.has("vhost-vsock"), d.vsock, errdefs.ErrFailedPrecondition))
	}
	note := shapeNote(shape, s.Limits, d.defMem)
	if note != "" {
		d.log.WarnContext(ctx, "restore keeps the snapshot's shape", "id", s.ID, "note", note)
	}
	if !shape.has("virtio-net") && s.NetNSPath != "" {
		d.log.WarnContext(ctx, "snapshot has no network device; the restored VM has no network", "id", s.ID)
	}
	var ram *os.File
	if shape.SharedRAM {
		// A template's snapshot: the clone maps its RAM privately and
		// owns no shared file of its own.
		ram, err = d.tmpl.get(filepath.Join(dir, RAMFile), shape.MemoryMiB<<20)
		if err != nil {
			return fail(err)
		}
		shape.SharedRAM = false
	}
	return d.launch(ctx, s, shape, image, note, ram)
}

// shapeNote describes how l differs from the snapshot's shape.
func shapeNote(s Shape, l runtime.Limits, defMem int64) string {
	var diffs []string
	if l.MilliCPU > 0 && vcpusFor(l.MilliCPU) != s.VCPUs {
		diffs = append(diffs, fmt.Sprintf("%d vCPUs asked, snapshot has %d", vcpusFor(l.MilliCPU), s.VCPUs))
	}
	if l.MemoryMiB > 0 && l.MemoryMiB != s.MemoryMiB {
		diffs = append(diffs, fmt.Sprintf("%d MiB asked, snapshot has %d MiB", l.MemoryMiB, s.MemoryMiB))
	}
	if len(diffs) == 0 {
		return ""
	}
	return fmt.Sprint(diffs)
}

// incoming loads the memory image QEMU inherited as q.inFD (a pipe
// from "zstd -dc") into the freshly started (-incoming defer) QEMU.
func (d *Driver) incoming(ctx context.Context, st *vmState, q *started, log string, ignoreShared bool) error {
	c, err := d.client(ctx, st)
	if err != nil {
		return fmt.Errorf("qmp: %w%s", err, logTail(log))
	}
	defer c.Close()
	if ignoreShared {
		if err := setIgnoreShared(ctx, c.Execute, true); err != nil {
			return fmt.Errorf("%w%s", err, logTail(log))
		}
	}
	uri := "fd:" + strconv.Itoa(q.inFD)
	if err := c.Execute(ctx, "migrate-incoming", map[string]any{"uri": uri}, nil); err != nil {
		return fmt.Errorf("migrate-incoming: %w%s", err, logTail(log))
	}
	// A stream that fails to load makes QEMU exit: the QMP connection
	// then breaks, and the log says why. A stream cut short inside the
	// device state does not always: QEMU 7.2 may wait on it for ever.
	// zstd failing (a truncated or corrupt image) fails the restore.
	wctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	go func() {
		select {
		case err := <-q.unzstdCh:
			q.unzstdCh <- err
			if err != nil {
				cancel(fmt.Errorf("zstd -d: %w: %w", err, errdefs.ErrInvalidArgument))
			}
		case <-wctx.Done():
		}
	}()
	if err := d.waitMigrate(wctx, c.Execute, ""); err != nil {
		if cause := context.Cause(wctx); ctx.Err() == nil && cause != nil {
			err = cause
		}
		return fmt.Errorf("load memory image: %w%s", err, logTail(log))
	}
	// QEMU read the whole stream; zstd ends with it.
	select {
	case err := <-q.unzstdCh:
		q.unzstdCh <- err // release() reads it again
		if err != nil {
			return fmt.Errorf("zstd -d: %w%s", err, logTail(log))
		}
	case <-time.After(zstdTimeout):
		return fmt.Errorf("zstd -d still running after the stream loaded: %w", errdefs.ErrInternal)
	case <-ctx.Done():
		return ctx.Err()
	}
	return nil
}

// zstdTimeout bounds how long zstd may take to finish once QEMU is done
// with the stream (flushing the last block to disk on a checkpoint).
const zstdTimeout = 30 * time.Second
