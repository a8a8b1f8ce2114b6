package vm

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/qmp"
)

// A raw restore is QEMU started by hand on a memory snapshot, with no
// driver around it: the floor a restore through cubelet is compared with
// (cube-bench's qemu-incoming baseline). It needs exactly the command
// line the driver would build, so it is exported from here rather than
// copied.

// RawFiles are the per-instance files of a raw restore, all in one dir.
type RawFiles struct {
	QMP, Agent, Console, Log, PIDFile string
	// VsockCID is the guest CID when the snapshot has a vsock device
	// (0 otherwise): the agent is then reached over vsock, not Agent.
	VsockCID uint32
	// Deferred is the incoming URI of a template snapshot with shared
	// memory: QEMU starts with "-incoming defer" and WaitIncoming sets
	// x-ignore-shared, then starts the migration from it.
	Deferred string
}

// RawIncoming returns QEMU's argv (without the binary) to restore the
// memory image in snapshot dir onto disk, with the snapshot's shape and
// `-incoming "exec:zstd -dc <image>"`, and the files it uses under
// workDir. QEMU daemonizes once the process is set up, keeps the VM
// stopped (-S) after the stream is loaded, and writes its PID to
// PIDFile. A snapshot with a NIC expects the TAP device the driver
// names (TapName) in QEMU's network namespace: run it in a fresh one
// (QEMU then creates the TAP itself, and it goes with the namespace).
// cid picks the vsock CID when the shape has vsock.
func RawIncoming(dir, disk, workDir string, cid uint32) ([]string, RawFiles, error) {
	shape, err := ReadShape(dir)
	if err != nil {
		return nil, RawFiles{}, err
	}
	img := filepath.Join(dir, MemoryFile)
	if _, err := os.Stat(img); err != nil {
		return nil, RawFiles{}, fmt.Errorf("raw restore of %s: %w: %w", dir, err, errdefs.ErrNotFound)
	}
	f := RawFiles{
		QMP: filepath.Join(workDir, "qmp.sock"), Agent: filepath.Join(workDir, "agent.sock"),
		Console: filepath.Join(workDir, "console.log"), Log: filepath.Join(workDir, "qemu.log"),
		PIDFile: filepath.Join(workDir, "qemu.pid"),
	}
	if shape.has("vhost-vsock") {
		if cid < 3 {
			return nil, RawFiles{}, fmt.Errorf("raw restore of %s: vsock CID %d: want at least 3: %w", dir, cid, errdefs.ErrInvalidArgument)
		}
		f.VsockCID = cid
	}
	p := paths{Disk: disk, QMP: f.QMP, Agent: f.Agent, Console: f.Console, Log: f.Log, PIDFile: f.PIDFile, VsockCID: f.VsockCID}
	uri := "exec:zstd -dc " + shellQuote(img)
	if shape.SharedRAM {
		// The template's RAM file itself, mapped privately (QEMU runs as
		// root here), and only the device state from the stream.
		p.RAM = filepath.Join(dir, RAMFile)
		if _, err := os.Stat(p.RAM); err != nil {
			return nil, RawFiles{}, fmt.Errorf("raw restore of %s: %w: %w", dir, err, errdefs.ErrNotFound)
		}
		args := qemuArgs(shape, p, true)
		f.Deferred = uri
		return args, f, nil
	}
	args := qemuArgs(shape, p, false)
	args = append(args, "-incoming", uri)
	return args, f, nil
}

// TapName is the TAP device a VM's NIC uses inside its namespace.
const TapName = tapName

// WaitIncoming waits, over the QMP socket of a raw restore, until the
// incoming migration completed (the VM is loaded, still stopped), then
// resumes it when cont is set. It fails when the migration does. A
// template snapshot's migration (f.Deferred) is started here first.
func WaitIncoming(ctx context.Context, f RawFiles, cont bool) error {
	c, err := qmp.Dial(ctx, f.QMP)
	if err != nil {
		return err
	}
	defer c.Close()
	if f.Deferred != "" {
		if err := setIgnoreShared(ctx, c.Execute, true); err != nil {
			return err
		}
		if err := c.Execute(ctx, "migrate-incoming", map[string]any{"uri": f.Deferred}, nil); err != nil {
			return fmt.Errorf("qmp migrate-incoming: %w", err)
		}
	}
	d := &Driver{}
	if err := d.waitMigrate(ctx, c.Execute, ""); err != nil {
		return err
	}
	if cont {
		if err := c.Execute(ctx, "cont", nil, nil); err != nil {
			return fmt.Errorf("qmp cont: %w", err)
		}
	}
	return nil
}

// ReadPIDFile reads the PID QEMU wrote with -pidfile.
func ReadPIDFile(path string) (int, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || pid <= 0 {
		return 0, fmt.Errorf("pid file %s: %q: %w", path, b, errdefs.ErrInvalidArgument)
	}
	return pid, nil
}

// RawSaveFull writes, from the raw restore f of the template snapshot in
// dir (loaded, still stopped: WaitIncoming without cont), a full memory
// image of the same VM into out: every RAM page in the stream, the RAM an
// anonymous object, as a VM's snapshot was before templates had shared
// memory. cube-bench restores it as the full-copy baseline of the same
// snapshot.
func RawSaveFull(ctx context.Context, f RawFiles, dir, out string) error {
	shape, err := ReadShape(dir)
	if err != nil {
		return err
	}
	if !shape.SharedRAM {
		return fmt.Errorf("%s is not a shared-memory template: %w", dir, errdefs.ErrInvalidArgument)
	}
	if err := os.MkdirAll(out, 0o700); err != nil {
		return err
	}
	c, err := qmp.Dial(ctx, f.QMP)
	if err != nil {
		return err
	}
	defer c.Close()
	// The restored RAM is a private mapping, which x-ignore-shared never
	// skips; off, so the stream does not ask its restore for it either.
	if err := setIgnoreShared(ctx, c.Execute, false); err != nil {
		return err
	}
	if err := c.Execute(ctx, "migrate-set-parameters", map[string]any{"max-bandwidth": int64(migrateBandwidth)}, nil); err != nil {
		return err
	}
	// As Checkpoint: zstd is our child, so its exit says the file is whole.
	mem := filepath.Join(out, MemoryFile)
	zw, err := startCompress(mem+".tmp", f.Log)
	if err != nil {
		return err
	}
	defer zw.kill()
	err = c.ExecuteFD(ctx, "getfd", map[string]any{"fdname": migrateFDName}, nil, zw.w)
	zw.w.Close()
	if err != nil {
		return err
	}
	if err := c.Execute(ctx, "migrate", map[string]any{"uri": "fd:" + migrateFDName}, nil); err != nil {
		return fmt.Errorf("qmp migrate: %w", err)
	}
	d := &Driver{}
	if err := d.waitMigrate(ctx, c.Execute, "migrate_cancel"); err != nil {
		return err
	}
	if err := zw.wait(ctx); err != nil {
		return err
	}
	if err := os.Rename(mem+".tmp", mem); err != nil {
		return err
	}
	shape.SharedRAM = false
	b, err := json.MarshalIndent(shape, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(out, ShapeFile), b, 0o600)
}
