package vm

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/runtime/userns"
)

// Every running VM's QEMU has a uid (and a gid of the same number) of its
// own, taken from [DefaultUIDBase, DefaultUIDBase+DefaultUIDCount). One
// shared uid would not do: processes of one uid may signal and ptrace
// each other and open each other's /proc/<pid>/fd, so one compromised
// QEMU would reach every other VM's disk through its neighbour's open
// descriptors. The range lies within the span of the container
// user-namespace blocks (host IDs 1<<30 up to 1879048191), which hands out
// no block that overlaps it (internal/runtime/userns), and below 2^31, so
// it overlaps neither them nor ordinary accounts.
const (
	DefaultUIDBase  = userns.VMUIDBase // 1409286144
	DefaultUIDCount = userns.VMUIDCount
)

// DefaultUIDDir holds the allocation files: DefaultUIDDir/<uid> names
// the state dir of the VM that owns <uid>. uids are a resource of the
// host, not of one driver: every driver on the host (whatever its Root)
// allocates from the same directory. It is on /run, so allocations
// survive a cubelet restart and go, with the VMs, at reboot.
const DefaultUIDDir = "/run/cube/vm-uids"

// uidAlloc hands out per-VM uids. Creating the allocation file with
// O_EXCL is the lock: two concurrent Starts never get the same uid, with
// no lock held between calls and nothing kept in memory.
type uidAlloc struct {
	dir         string
	base, count uint32
}

func (a uidAlloc) file(uid uint32) string {
	return filepath.Join(a.dir, strconv.FormatUint(uint64(uid), 10))
}

// take allocates a uid for the VM whose state dir is owner. The search
// starts at a slot derived from owner, so concurrent Starts rarely
// contend for the same file. A file whose owner's state dir is gone is a
// leftover of a crash between allocation and rollback (release runs
// before the state dir goes): it is reclaimed.
func (a uidAlloc) take(owner string) (uint32, error) {
	if err := os.MkdirAll(a.dir, 0o700); err != nil {
		return 0, fmt.Errorf("allocate vm uid: %w", err)
	}
	start := uint32(0)
	for _, c := range []byte(owner) {
		start = start*31 + uint32(c)
	}
	start %= a.count
	for i := uint32(0); i < a.count; i++ {
		uid := a.base + (start+i)%a.count
		f, err := os.OpenFile(a.file(uid), os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
		if errors.Is(err, fs.ErrExist) {
			if a.stale(uid) && os.Remove(a.file(uid)) == nil {
				i-- // try this uid again
			}
			continue
		}
		if err != nil {
			return 0, fmt.Errorf("allocate vm uid: %w", err)
		}
		_, werr := f.WriteString(owner)
		if cerr := f.Close(); werr == nil {
			werr = cerr
		}
		if werr != nil {
			_ = os.Remove(a.file(uid))
			return 0, fmt.Errorf("allocate vm uid: %w", werr)
		}
		return uid, nil
	}
	return 0, fmt.Errorf("all %d vm uids from %d are in use: %w", a.count, a.base, errdefs.ErrResourceExhausted)
}

// stale reports whether uid's owner is gone: its state dir does not exist.
func (a uidAlloc) stale(uid uint32) bool {
	b, err := os.ReadFile(a.file(uid))
	if err != nil {
		return false
	}
	owner := strings.TrimSpace(string(b))
	if !filepath.IsAbs(owner) {
		return true
	}
	_, err = os.Stat(owner)
	// A process still running as uid keeps it, whatever its state dir
	// says.
	return errors.Is(err, fs.ErrNotExist) && len(uidProcs(uid)) == 0
}

// release frees uid if owner (a state dir) holds it. Callers release only
// once no process of the uid is left (QEMU reaped), or the next VM would
// share it.
func (a uidAlloc) release(uid uint32, owner string) error {
	if uid == 0 {
		return nil
	}
	b, err := os.ReadFile(a.file(uid))
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	if strings.TrimSpace(string(b)) != owner {
		return nil // reclaimed and reused already
	}
	if err := os.Remove(a.file(uid)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	return nil
}

// uidProcs lists the processes whose real or effective uid is uid. The
// kernel sets these; a compromised QEMU (no capabilities, no_new_privs)
// can change neither, whereas its command line is its own memory and
// proves nothing.
func uidProcs(uid uint32) []int {
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	want := strconv.FormatUint(uint64(uid), 10)
	var pids []int
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "status"))
		if err != nil {
			continue
		}
		for line := range strings.Lines(string(b)) {
			if f := strings.Fields(line); len(f) >= 3 && f[0] == "Uid:" {
				if f[1] == want || f[2] == want {
					pids = append(pids, pid)
				}
				break
			}
		}
	}
	return pids
}

// killUID SIGKILLs every process of uid and waits until none is left,
// so that the uid can go to the next VM. A process that outlives the
// timeout keeps the uid taken.
func killUID(uid uint32, timeout time.Duration) error {
	if uid == 0 {
		return nil
	}
	deadline := time.Now().Add(timeout)
	for {
		pids := uidProcs(uid)
		if len(pids) == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("uid %d: processes %v survive SIGKILL: %w", uid, pids, errdefs.ErrInternal)
		}
		for _, pid := range pids {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
		time.Sleep(5 * time.Millisecond)
	}
}
