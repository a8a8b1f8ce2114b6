package vm

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/errdefs"
)

// VM templating with shared memory (docs/vm.md, "Templates").
//
// A VM booted for a warm template (Spec.Labels[TemplateLabel] set) keeps
// its RAM in a file, <bundle>/memory.ram, mapped shared
// (memory-backend-file,share=on). Its checkpoint sets the migration
// capability x-ignore-shared, so the stream carries device state only,
// and copies the RAM file into the snapshot as memory.ram. A restore of
// such a snapshot maps the RAM privately (share=off: MAP_PRIVATE, copy on
// write) and loads only the device state: nothing is copied at restore,
// and an idle clone's pages are the template's.
//
// Clones do not map memory.ram itself: QEMU 7.2 opens a RAM file
// read-write even for a private mapping, so a clone's QEMU could write
// the template every other clone reads. The driver copies memory.ram once
// into a memfd sealed against writes, growth and shrinking (templateCache)
// and every clone maps that: a write(2) or a shared writable mapping of it
// fails with EPERM, a private mapping is allowed. QEMU reaches the memfd
// as /proc/self/fd/N (its jail then mounts a procfs showing only QEMU's
// own uid's processes: QEMU opens a RAM file by path, never /dev/fdset).

// TemplateLabel marks the Spec of a sandbox booted to become a warm
// template (cubelet's LabelWarmTemplate): its RAM is a shared file.
const TemplateLabel = "cube.warm-template"

// RAMFile is a shared-memory snapshot's guest RAM, byte for byte (sparse:
// pages the guest never wrote are holes).
const RAMFile = "memory.ram"

// ramObject is the id of the memory backend a VM with Shape.RAMObject
// uses; it is also the RAM block's name in the migration stream, so every
// VM restored from such a snapshot must name its backend the same.
const ramObject = "ram0"

// ramPage is the unit sparse copies skip zeroes by.
const ramPage = 4096

// templateCache holds one sealed memfd per template RAM file the driver
// restored from: clones of one template share its pages. An entry whose
// file is gone or replaced is dropped at the next lookup (running clones
// keep their mappings: the kernel frees the pages with the last one).
type templateCache struct {
	mu      sync.Mutex
	entries map[string]*templateEntry // by RAM file path
	// loading holds a channel per path whose copy is in progress, closed
	// when it ends: a template's first copy (seconds for a large guest)
	// holds up the restores of that template only, not of every other.
	loading map[string]chan struct{}
}

type templateEntry struct {
	dev, ino uint64
	size     int64
	mtime    int64
	mem      *os.File // the sealed memfd
}

// get returns a duplicate of the sealed memfd holding path's contents
// (the caller closes it), copying the file in on first use. size is the
// guest RAM the snapshot's shape says; a file of another size is refused.
func (c *templateCache) get(path string, size int64) (*os.File, error) {
	fi, err := os.Stat(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("no %s in %s: %w", RAMFile, filepath.Dir(path), errdefs.ErrNotFound)
	}
	if err != nil {
		return nil, err
	}
	if fi.Size() != size {
		return nil, fmt.Errorf("%s is %d bytes, the snapshot's RAM is %d: %w", path, fi.Size(), size, errdefs.ErrInvalidArgument)
	}
	st, _ := fi.Sys().(*syscall.Stat_t)
	if st == nil {
		return nil, fmt.Errorf("%s: no stat: %w", path, errdefs.ErrInternal)
	}
	c.mu.Lock()
	for {
		c.sweepLocked()
		if e, ok := c.entries[path]; ok {
			if e.dev == st.Dev && e.ino == st.Ino && e.size == fi.Size() && e.mtime == fi.ModTime().UnixNano() {
				f, err := dupFile(e.mem)
				c.mu.Unlock()
				return f, err
			}
			e.mem.Close()
			delete(c.entries, path)
		}
		ch, busy := c.loading[path]
		if !busy {
			break
		}
		c.mu.Unlock()
		<-ch // another restore is copying it: use its copy
		c.mu.Lock()
	}
	ch := make(chan struct{})
	if c.loading == nil {
		c.loading = map[string]chan struct{}{}
	}
	c.loading[path] = ch
	c.mu.Unlock()
	mem, err := sealedCopy(path, size)
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.loading, path)
	close(ch)
	if err != nil {
		return nil, err
	}
	if c.entries == nil {
		c.entries = map[string]*templateEntry{}
	}
	c.entries[path] = &templateEntry{dev: st.Dev, ino: st.Ino, size: fi.Size(), mtime: fi.ModTime().UnixNano(), mem: mem}
	return dupFile(mem)
}

// sweepLocked drops entries whose file was removed or replaced: a deleted
// template's memory goes once its last clone stops.
func (c *templateCache) sweepLocked() {
	for p, e := range c.entries {
		fi, err := os.Stat(p)
		if err == nil {
			if st, ok := fi.Sys().(*syscall.Stat_t); ok && st.Dev == e.dev && st.Ino == e.ino && fi.ModTime().UnixNano() == e.mtime {
				continue
			}
		}
		e.mem.Close()
		delete(c.entries, p)
	}
}

// len is the number of cached templates (tests).
func (c *templateCache) len() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.sweepLocked()
	return len(c.entries)
}

// close releases every cached memfd.
func (c *templateCache) close() {
	c.mu.Lock()
	defer c.mu.Unlock()
	for p, e := range c.entries {
		e.mem.Close()
		delete(c.entries, p)
	}
}

func dupFile(f *os.File) (*os.File, error) {
	fd, err := unix.FcntlInt(f.Fd(), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("dup memfd: %w", err)
	}
	return os.NewFile(uintptr(fd), f.Name()), nil
}

// sealedCopy copies path (size bytes) into a new memfd and seals it: no
// write, no resize, no further seals. Private mappings still work.
func sealedCopy(path string, size int64) (*os.File, error) {
	src, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer src.Close()
	mem, err := newMemfd(templateMemfdName, size)
	if err != nil {
		return nil, err
	}
	if err := copySparse(mem, src, size); err != nil {
		mem.Close()
		return nil, fmt.Errorf("copy %s into a memfd: %w", path, err)
	}
	if err := seal(mem); err != nil {
		mem.Close()
		return nil, err
	}
	// The file's page cache is not what clones map: let it go.
	_ = unix.Fadvise(int(src.Fd()), 0, 0, unix.FADV_DONTNEED)
	return mem, nil
}

// newMemfd is an empty memfd of size bytes that can be sealed.
func newMemfd(name string, size int64) (*os.File, error) {
	fd, err := unix.MemfdCreate(name, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return nil, fmt.Errorf("memfd_create: %w", err)
	}
	f := os.NewFile(uintptr(fd), "memfd:"+name)
	if err := f.Truncate(size); err != nil {
		f.Close()
		return nil, fmt.Errorf("size memfd: %w", err)
	}
	return f, nil
}

// seal forbids every change to f's contents and size.
func seal(f *os.File) error {
	seals := unix.F_SEAL_WRITE | unix.F_SEAL_SHRINK | unix.F_SEAL_GROW | unix.F_SEAL_SEAL
	if _, err := unix.FcntlInt(f.Fd(), unix.F_ADD_SEALS, seals); err != nil {
		return fmt.Errorf("seal memfd: %w", err)
	}
	return nil
}

// copySparse copies size bytes of src to dst at the same offsets,
// writing only the pages of src's data extents that are not all zero:
// dst must read as zeroes where nothing is written (a new or truncated
// file, a memfd). A guest's RAM is mostly never-written pages.
func copySparse(dst io.WriterAt, src *os.File, size int64) error {
	buf := make([]byte, 1<<20)
	fd := int(src.Fd())
	for off := int64(0); off < size; {
		data, err := unix.Seek(fd, off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			return nil // only a hole from off to the end
		}
		if err != nil {
			return fmt.Errorf("seek data: %w", err)
		}
		hole, err := unix.Seek(fd, data, unix.SEEK_HOLE)
		if err != nil {
			return fmt.Errorf("seek hole: %w", err)
		}
		hole = min(hole, size)
		for pos := data; pos < hole; {
			n := int(min(int64(len(buf)), hole-pos))
			if _, err := src.ReadAt(buf[:n], pos); err != nil {
				return err
			}
			if err := writeNonZero(dst, buf[:n], pos); err != nil {
				return err
			}
			pos += int64(n)
		}
		off = hole
	}
	return nil
}

// writeNonZero writes the runs of pages of b (at offset off) that are
// not all zero.
func writeNonZero(dst io.WriterAt, b []byte, off int64) error {
	start := -1
	flush := func(end int) error {
		if start < 0 {
			return nil
		}
		_, err := dst.WriteAt(b[start:end], off+int64(start))
		start = -1
		return err
	}
	for i := 0; i < len(b); i += ramPage {
		end := min(i+ramPage, len(b))
		if isZero(b[i:end]) {
			if err := flush(i); err != nil {
				return err
			}
			continue
		}
		if start < 0 {
			start = i
		}
	}
	return flush(len(b))
}

func isZero(b []byte) bool {
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}

// copyRAM writes a template VM's RAM file into a snapshot as dst: a
// reflink where the filesystem has them (the bundle and the snapshot are
// on one pool), else a sparse copy. The VM is stopped meanwhile.
func copyRAM(src, dst string, size int64) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return err
	}
	if err := unix.IoctlFileClone(int(out.Fd()), int(in.Fd())); err != nil {
		if err := out.Truncate(size); err != nil {
			out.Close()
			return err
		}
		if err := copySparse(out, in, size); err != nil {
			out.Close()
			return err
		}
	}
	// The guest wrote the source through a shared mapping: its page cache
	// is the data, nothing to flush before reading it. The copy must be on
	// disk before the snapshot counts as written.
	if err := out.Sync(); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

// createRAMFile makes a template VM's RAM file in its bundle, owned by its
// QEMU's uid (QEMU reopens it through /proc/self/fd, which checks the
// file's permissions), and returns it open read-write.
func createRAMFile(path string, size int64, uid uint32) (*os.File, error) {
	_ = os.Remove(path)
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return nil, fmt.Errorf("ram file: %w", err)
	}
	if err := f.Truncate(size); err != nil {
		f.Close()
		return nil, fmt.Errorf("ram file: %w", err)
	}
	if err := f.Chown(int(uid), int(uid)); err != nil {
		f.Close()
		return nil, fmt.Errorf("ram file: %w", err)
	}
	return f, nil
}

// sharedRAMPath is a template VM's RAM file while it runs, in its bundle
// (the pool's filesystem: /run, where Root usually is, is a small tmpfs,
// and a reflink to the snapshot then copies nothing).
func sharedRAMPath(bundle string) string { return filepath.Join(bundle, "qemu-ram") }

// templateMemfdName names the sealed copies (memfd:cube-vm-template in a
// clone's /proc/<pid>/maps).
const templateMemfdName = "cube-vm-template"
