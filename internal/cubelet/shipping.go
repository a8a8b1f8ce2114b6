package cubelet

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	goruntime "runtime"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/objstore"
	"github.com/cubesandbox/cube/internal/sandbox"
	"github.com/cubesandbox/cube/internal/sandboxid"
)

// Snapshots that travel between nodes: ExportSnapshot uploads a ready
// snapshot's directory (disk image, and the memory image where the runtime
// has one) to the object store configured in [store] (package objstore:
// content-addressed chunks, the manifest written last); ImportSnapshot on
// another node downloads it into this node's pool, every chunk checked
// against its digest, and records it ready, so clone and the master's
// cross-node create and resume use it like a snapshot taken here.
//
// A memory image restores only where the runtime that wrote it runs the
// same way: the manifest carries the exporting node's memory fingerprint
// (runtime binary, platform, CPU architecture and features), and an import
// onto a node whose fingerprint differs is refused, naming what differs,
// or (allow_disk_only) imports the disk alone.

// shipped is the manifest's meta: the snapshot record without its local
// paths, and the memory fingerprint of the node that took it.
type shipped struct {
	Snapshot *sandbox.Snapshot `json:"snapshot"`
	// MemoryCompat is set when the snapshot has a memory image.
	MemoryCompat map[string]string `json:"memory_compat,omitempty"`
}

// memoryDirName is the memory image's directory inside a snapshot's
// (storage.Pool.SnapshotMemoryDir).
const memoryDirName = "memory"

// Transfer says what an export or import moved.
type Transfer = objstore.Stats

// ImportResult is an imported snapshot and what its import moved.
type ImportResult struct {
	Snapshot *sandbox.Snapshot
	Transfer Transfer
	// MemoryDropped says why the memory image was left behind (only with
	// AllowDiskOnly).
	MemoryDropped string
}

// objectStore returns the configured store, opened on first use.
func (s *Service) objectStore() (*objstore.Store, error) {
	s.objMu.Lock()
	defer s.objMu.Unlock()
	if s.obj != nil {
		return s.obj, nil
	}
	if !s.cfg.Store.Enabled() {
		return nil, fmt.Errorf("no object store configured on this node ([store] endpoint): %w", errdefs.ErrFailedPrecondition)
	}
	st, err := objstore.Open(s.cfg.Store)
	if err != nil {
		return nil, err
	}
	s.obj = st
	return st, nil
}

// ExportSnapshot uploads a ready snapshot. Its files stay referenced (a
// delete meanwhile waits for the upload) until the manifest is written.
func (s *Service) ExportSnapshot(ctx context.Context, id string) (*sandbox.Snapshot, Transfer, error) {
	st, err := s.objectStore()
	if err != nil {
		return nil, Transfer{}, err
	}
	sn, release, err := s.useSnapshot(id)
	if err != nil {
		return nil, Transfer{}, err
	}
	defer release()
	meta := shipped{Snapshot: sn.Clone()}
	meta.Snapshot.Dir, meta.Snapshot.DiskPath, meta.Snapshot.MemoryDir = "", "", ""
	if p := meta.Snapshot.NetworkPolicy; p != nil && len(p.Credentials) > 0 {
		// Credential values (team secrets the master opened) never go to
		// the object store: a sandbox run from the export gets its rules
		// from the master again, and one run without them has none.
		c := p.Clone()
		c.Credentials = nil
		meta.Snapshot.NetworkPolicy = &c
	}
	meta.Snapshot.WarmFor = ""
	if sn.HasMemory {
		if filepath.Clean(sn.MemoryDir) != filepath.Join(sn.Dir, memoryDirName) {
			return nil, Transfer{}, fmt.Errorf("snapshot %s: memory image at %s, outside its directory: %w", id, sn.MemoryDir, errdefs.ErrFailedPrecondition)
		}
		if meta.MemoryCompat, err = s.memoryCompat(sn.Runtime); err != nil {
			return nil, Transfer{}, err
		}
	}
	if filepath.Clean(sn.DiskPath) != filepath.Join(sn.Dir, "disk.img") {
		return nil, Transfer{}, fmt.Errorf("snapshot %s: disk image at %s, outside its directory: %w", id, sn.DiskPath, errdefs.ErrFailedPrecondition)
	}
	_, tr, err := st.Export(ctx, id, sn.Dir, meta)
	if err != nil {
		return nil, tr, err
	}
	s.log.Info("snapshot exported", "snapshot_id", id, "logical_bytes", tr.LogicalBytes, "stored_bytes", tr.StoredBytes,
		"sent_bytes", tr.Sent, "duration", tr.Duration, "has_memory", sn.HasMemory)
	return sn, tr, nil
}

// ImportSnapshot downloads snapshot id from the store into the pool and
// records it ready. The template it was made from must be on this node and
// its runtime available; its memory image must be restorable here (else
// refused, or dropped with allowDiskOnly).
func (s *Service) ImportSnapshot(ctx context.Context, id string, allowDiskOnly bool) (*ImportResult, error) {
	if err := sandboxid.Validate("snapshot", id); err != nil {
		return nil, &errdefs.FieldError{Field: "snapshot_id", Msg: err.Error()}
	}
	st, err := s.objectStore()
	if err != nil {
		return nil, err
	}
	if _, err := s.store.GetSnapshot(id); err == nil {
		return nil, fmt.Errorf("snapshot %s is already on this node: %w", id, errdefs.ErrAlreadyExists)
	}
	m, err := st.Manifest(ctx, id)
	if err != nil {
		return nil, err
	}
	var meta shipped
	if err := json.Unmarshal(m.Meta, &meta); err != nil || meta.Snapshot == nil || meta.Snapshot.ID != id {
		return nil, fmt.Errorf("snapshot %s: manifest carries no snapshot record: %w", id, objstore.ErrCorrupt)
	}
	sn := meta.Snapshot
	if _, err := s.node.Driver(sn.Runtime); err != nil {
		return nil, fmt.Errorf("snapshot %s needs runtime %q: %w", id, sn.Runtime, errdefs.ErrFailedPrecondition)
	}
	tmpl, err := s.store.GetTemplate(sn.TemplateID)
	if err != nil {
		return nil, fmt.Errorf("snapshot %s needs template %s on this node: %w", id, sn.TemplateID, errdefs.ErrFailedPrecondition)
	}
	res := &ImportResult{}
	keepMemory := sn.HasMemory
	if sn.HasMemory {
		local, err := s.memoryCompat(sn.Runtime)
		if err != nil {
			return nil, err
		}
		if diff := compatDiff(meta.MemoryCompat, local); diff != "" {
			if !allowDiskOnly {
				return nil, fmt.Errorf("snapshot %s: its memory image cannot be restored on this node (%s); import the disk alone to resume cold: %w", id, diff, errdefs.ErrFailedPrecondition)
			}
			keepMemory, res.MemoryDropped = false, diff
		}
	}
	pool := s.node.Pool
	sn.Dir, sn.DiskPath = pool.SnapshotDir(id), pool.SnapshotDiskPath(id)
	sn.MemoryDir, sn.HasMemory = "", keepMemory
	if keepMemory {
		sn.MemoryDir = pool.SnapshotMemoryDir(id)
	}
	sn.State, sn.WarmFor = sandbox.SnapshotCreating, ""
	if err := os.MkdirAll(pool.SnapshotsDir(), 0o700); err != nil {
		return nil, err
	}
	// The record first, as a snapshot being taken: a crash mid-download
	// leaves a record restart reconcile removes with its files.
	if err := s.store.CreateSnapshot(sn); err != nil {
		return nil, err
	}
	log := s.log.With("snapshot_id", id)
	var skip func(string) bool
	if !keepMemory {
		skip = func(p string) bool { return p == memoryDirName || strings.HasPrefix(p, memoryDirName+"/") }
	}
	// The disk image was cloned from the template's, which this node
	// holds: its unchanged chunks are copied from there rather than
	// downloaded (each checked against its digest all the same).
	seed := func(p string) string {
		if p == "disk.img" {
			return tmpl.ImagePath
		}
		return ""
	}
	_, tr, err := st.ImportWith(ctx, m, sn.Dir, objstore.ImportOptions{Skip: skip, Seed: seed})
	res.Transfer = tr
	if err == nil {
		err = s.sealSnapshot(sn)
	}
	if err != nil {
		s.discardSnapshot(sn, log)
		return res, err
	}
	log.Info("snapshot imported", "logical_bytes", tr.LogicalBytes, "received_bytes", tr.Received, "reused_bytes", tr.Reused, "duration", tr.Duration,
		"has_memory", sn.HasMemory, "memory_dropped", res.MemoryDropped)
	res.Snapshot = sn.Clone()
	return res, nil
}

// memoryCompat is what must match for a memory image written by runtime
// on one node to restore on another: the runtime's binary (by content),
// its platform settings, the CPU architecture and feature flags.
func (s *Service) memoryCompat(runtime string) (map[string]string, error) {
	s.objMu.Lock()
	defer s.objMu.Unlock()
	if c, ok := s.compat[runtime]; ok {
		return c, nil
	}
	c := map[string]string{"runtime": runtime, "arch": goruntime.GOARCH, "cpu_flags": cpuFlags()}
	var bin string
	switch runtime {
	case "gvisor":
		bin = s.cfg.Gvisor.Binary
		c["platform"] = s.cfg.Gvisor.Platform
	case "vm":
		bin = s.cfg.VM.QEMU
		c["accel"] = s.cfg.VM.Accel
		d, err := dirDigest(s.cfg.VM.GuestDir)
		if err != nil {
			return nil, fmt.Errorf("memory fingerprint: guest kernel: %w", err)
		}
		c["guest"] = d
	}
	if bin != "" {
		d, err := binaryDigest(bin)
		if err != nil {
			return nil, fmt.Errorf("memory fingerprint of %s: %w", runtime, err)
		}
		c["binary"] = d
	}
	if s.compat == nil {
		s.compat = map[string]map[string]string{}
	}
	s.compat[runtime] = c
	return c, nil
}

// compatDiff names the fingerprint fields that differ ("" when none do).
func compatDiff(theirs, ours map[string]string) string {
	var diff []string
	for k, v := range theirs {
		if ours[k] != v {
			diff = append(diff, k+" differs")
		}
	}
	for k := range ours {
		if _, ok := theirs[k]; !ok {
			diff = append(diff, k+" unknown to the exporting node")
		}
	}
	sort.Strings(diff)
	return strings.Join(diff, ", ")
}

var cpuFlagsOnce = sync.OnceValue(func() string {
	f, err := os.Open("/proc/cpuinfo")
	if err != nil {
		return ""
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		if k, v, ok := strings.Cut(sc.Text(), ":"); ok && strings.TrimSpace(k) == "flags" {
			sum := sha256.Sum256([]byte(strings.TrimSpace(v)))
			return hex.EncodeToString(sum[:8])
		}
	}
	return ""
})

func cpuFlags() string { return cpuFlagsOnce() }

func binaryDigest(name string) (string, error) {
	p, err := exec.LookPath(name)
	if err != nil {
		return "", err
	}
	return contentDigest(p)
}

func contentDigest(p string) (string, error) {
	f, err := os.Open(p)
	if err != nil {
		return "", err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return "", err
	}
	return hex.EncodeToString(h.Sum(nil)[:16]), nil
}

// dirDigest digests the regular files directly in dir (the VM's guest
// kernel and initrd).
func dirDigest(dir string) (string, error) {
	if dir == "" {
		return "", nil
	}
	ents, err := os.ReadDir(dir)
	if err != nil {
		return "", err
	}
	h := sha256.New()
	for _, e := range ents {
		if !e.Type().IsRegular() {
			continue
		}
		d, err := contentDigest(filepath.Join(dir, e.Name()))
		if err != nil {
			return "", err
		}
		fmt.Fprintf(h, "%s %s\n", e.Name(), d)
	}
	return hex.EncodeToString(h.Sum(nil)[:16]), nil
}

// exportedGrace spares, when a deletion collects the store's unreferenced
// chunks, those younger than this: they may belong to an export still
// uploading (its manifest not yet written).
const exportedGrace = time.Hour

// DeleteExported deletes snapshot id from the object store: its manifest
// at once, then the chunks no other manifest names.
func (s *Service) DeleteExported(ctx context.Context, id string) error {
	if err := sandboxid.Validate("snapshot", id); err != nil {
		return &errdefs.FieldError{Field: "snapshot_id", Msg: err.Error()}
	}
	st, err := s.objectStore()
	if err != nil {
		return err
	}
	if err := st.Delete(ctx, id, exportedGrace); err != nil {
		return err
	}
	s.log.Info("exported snapshot deleted from the store", "snapshot_id", id)
	return nil
}
