package vm

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/cubesandbox/cube/internal/errdefs"
)

// Every running VM's QEMU has a uid (and a gid of the same number) of its
// own, taken from [DefaultUIDBase, DefaultUIDBase+DefaultUIDCount). One
// shared uid would not do: processes of one uid may signal and ptrace
// each other and open each other's /proc/<pid>/fd, so one compromised
// QEMU would reach every other VM's disk through its neighbour's open
// descriptors. The range lies above the container user-namespace blocks
// (host IDs 1<<30 up to 1342177279, internal/runtime/userns) and below
// 2^31, so it overlaps neither them nor ordinary accounts.
const (
	DefaultUIDBase  = 0x54000000 // 1409286144
	DefaultUIDCount = 65536
)

// uidPrefix names the allocation files in Root: Root/.uid.<uid> holds the
// ID of the VM that owns <uid>. They live with the state dirs, so they
// survive a cubelet restart (Root is on /run: a reboot clears both, with
// the VMs).
const uidPrefix = ".uid."

// uidAlloc hands out per-VM uids. Creating the allocation file with
// O_EXCL is the lock: two concurrent Starts never get the same uid, with
// no lock held between calls and nothing kept in memory.
type uidAlloc struct {
	root        string
	base, count uint32
}

func (a uidAlloc) file(uid uint32) string {
	return filepath.Join(a.root, uidPrefix+strconv.FormatUint(uint64(uid), 10))
}

// take allocates a uid for id. The search starts at a slot derived from
// id, so concurrent Starts rarely contend for the same file. A file whose
// owner has no state dir is a leftover of a crash between allocation and
// rollback (release runs before the state dir goes): it is reclaimed.
func (a uidAlloc) take(id string) (uint32, error) {
	start := uint32(0)
	for _, c := range []byte(id) {
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
		_, werr := f.WriteString(id)
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
	id := strings.TrimSpace(string(b))
	if validID(id) != nil {
		return true
	}
	_, err = os.Stat(filepath.Join(a.root, id))
	return errors.Is(err, fs.ErrNotExist)
}

// release frees uid if id owns it. Callers release only once no process
// of the uid is left (QEMU reaped), or the next VM would share it.
func (a uidAlloc) release(uid uint32, id string) error {
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
	if strings.TrimSpace(string(b)) != id {
		return nil // reclaimed and reused already
	}
	if err := os.Remove(a.file(uid)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	return nil
}
