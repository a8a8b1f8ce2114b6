package objstore

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/objstore/objstoretest"
)

func open(t *testing.T, srv *objstoretest.Server) *Store {
	t.Helper()
	s, err := Open(Config{Endpoint: srv.Endpoint, Bucket: srv.Bucket, AccessKeyFile: srv.AccessKeyFile, SecretKeyFile: srv.SecretKeyFile})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// snapDir writes a snapshot-shaped directory: a sparse disk image with
// data at a few offsets and a memory directory of random bytes.
func snapDir(t *testing.T, diskSize, memSize int64) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "snap")
	if err := os.MkdirAll(filepath.Join(dir, "memory", "pages"), 0o700); err != nil {
		t.Fatal(err)
	}
	f, err := os.Create(filepath.Join(dir, "disk.img"))
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Truncate(diskSize); err != nil {
		t.Fatal(err)
	}
	for _, off := range []int64{0, diskSize / 3, diskSize - 5000} {
		if _, err := f.WriteAt(randBytes(t, 5000), off); err != nil {
			t.Fatal(err)
		}
	}
	f.Close()
	if err := os.WriteFile(filepath.Join(dir, "memory", "checkpoint.img"), randBytes(t, memSize), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "memory", "pages", "meta"), []byte("x"), 0o640); err != nil {
		t.Fatal(err)
	}
	return dir
}

func randBytes(t *testing.T, n int64) []byte {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return b
}

// sameTree fails unless every file under want is in got with the same
// bytes and mode.
func sameTree(t *testing.T, want, got string) {
	t.Helper()
	n := 0
	err := filepath.WalkDir(want, func(p string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		rel, _ := filepath.Rel(want, p)
		a, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		b, err := os.ReadFile(filepath.Join(got, rel))
		if err != nil {
			return err
		}
		if !bytes.Equal(a, b) {
			t.Errorf("%s differs after import", rel)
		}
		ai, _ := os.Stat(p)
		bi, _ := os.Stat(filepath.Join(got, rel))
		if ai.Mode() != bi.Mode() {
			t.Errorf("%s: mode %v, want %v", rel, bi.Mode(), ai.Mode())
		}
		n++
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if n == 0 {
		t.Fatal("no files compared")
	}
}

func TestExportImportRoundTrip(t *testing.T) {
	srv := objstoretest.Start(t)
	s := open(t, srv)
	ctx := context.Background()
	src := snapDir(t, 256<<20, 32<<20)
	m, est, err := s.Export(ctx, "snap1", src, map[string]string{"runtime": "gvisor"})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("export: %d files, %d MiB logical, %.1f MiB stored, %.1f MiB sent in %v", est.Files, est.LogicalBytes>>20, float64(est.StoredBytes)/(1<<20), float64(est.Sent)/(1<<20), est.Duration)
	if est.StoredBytes > 48<<20 { // 32 MiB memory + three 4 MiB disk chunks with data
		t.Errorf("stored %d bytes: the disk image's holes were uploaded", est.StoredBytes)
	}
	if string(m.Meta) != `{"runtime":"gvisor"}` {
		t.Errorf("meta %s", m.Meta)
	}
	dst := filepath.Join(t.TempDir(), "pool", "snap1")
	m2, ist, err := s.Import(ctx, "snap1", dst)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("import: %.1f MiB received in %v", float64(ist.Received)/(1<<20), ist.Duration)
	sameTree(t, src, dst)
	if string(m2.Meta) != string(m.Meta) {
		t.Errorf("imported meta %s", m2.Meta)
	}
	var st syscall.Stat_t
	if err := syscall.Stat(filepath.Join(dst, "disk.img"), &st); err != nil {
		t.Fatal(err)
	}
	if st.Blocks*512 > 16<<20 {
		t.Errorf("imported disk image allocates %d bytes: not sparse", st.Blocks*512)
	}
	// A second export of the same content sends nothing: every chunk is
	// already stored under its digest.
	_, est2, err := s.Export(ctx, "snap2", src, nil)
	if err != nil {
		t.Fatal(err)
	}
	if est2.Sent != 0 {
		t.Errorf("re-export sent %d bytes, want 0", est2.Sent)
	}
	// Importing onto an existing directory is refused and leaves it alone.
	if _, _, err := s.Import(ctx, "snap1", dst); !errors.Is(err, errdefs.ErrAlreadyExists) {
		t.Errorf("import onto existing dir: %v", err)
	}
	ids, err := s.List(ctx)
	if err != nil || len(ids) != 2 {
		t.Errorf("List = %v, %v", ids, err)
	}
}

// chunkObjects counts the chunk objects in the store.
func chunkObjects(t *testing.T, s *Store) int {
	t.Helper()
	n := 0
	for oi := range s.c.ListObjects(context.Background(), s.bucket, minio.ListObjectsOptions{Prefix: s.prefix + "chunks/", Recursive: true}) {
		if oi.Err != nil {
			t.Fatal(oi.Err)
		}
		n++
	}
	return n
}

// The store dies mid-upload: the export fails with ErrUnavailable, no
// manifest exists, so an import finds nothing and writes nothing. Control:
// after a restart the same export completes and imports intact.
func TestKillMidUpload(t *testing.T) {
	srv := objstoretest.Start(t)
	s := open(t, srv)
	ctx := context.Background()
	src := snapDir(t, 8<<20, 192<<20)
	killed := make(chan struct{})
	go func() {
		defer close(killed)
		// Kill once a few chunks are in: the export is under way.
		for deadline := time.Now().Add(60 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
			if du(srv.DataDir()) > 24<<20 {
				break
			}
		}
		srv.Kill()
	}()
	_, st, err := s.Export(ctx, "snap", src, nil)
	<-killed
	t.Logf("export with the store killed mid-upload: %v (sent %.1f MiB)", err, float64(st.Sent)/(1<<20))
	if err == nil {
		t.Fatal("export succeeded although the store was killed")
	}
	if !errors.Is(err, errdefs.ErrUnavailable) {
		t.Errorf("error is not ErrUnavailable (retryable): %v", err)
	}
	srv.Restart()
	if n := chunkObjects(t, s); n == 0 {
		t.Log("no chunk survived the kill (the probe below still must not find a manifest)")
	}
	dst := filepath.Join(t.TempDir(), "snap")
	if _, _, err := s.Import(ctx, "snap", dst); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("import of a half-uploaded snapshot: %v, want ErrNotFound", err)
	}
	if _, err := os.Lstat(dst); !os.IsNotExist(err) {
		t.Fatalf("import of a half-uploaded snapshot left %s", dst)
	}
	// Control: the retried export completes and imports.
	if _, _, err := s.Export(ctx, "snap", src, nil); err != nil {
		t.Fatal(err)
	}
	if _, _, err := s.Import(ctx, "snap", dst); err != nil {
		t.Fatal(err)
	}
	sameTree(t, src, dst)
}

// The store dies mid-download: the import fails and leaves neither the
// directory nor its staging directory. Control: after a restart it works.
func TestKillMidDownload(t *testing.T) {
	srv := objstoretest.Start(t)
	s := open(t, srv)
	ctx := context.Background()
	src := snapDir(t, 8<<20, 192<<20)
	if _, _, err := s.Export(ctx, "snap", src, nil); err != nil {
		t.Fatal(err)
	}
	parent := t.TempDir()
	dst := filepath.Join(parent, "snap")
	killed := make(chan struct{})
	go func() {
		defer close(killed)
		for deadline := time.Now().Add(60 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
			if du(parent) > 16<<20 {
				break
			}
		}
		srv.Kill()
	}()
	_, _, err := s.Import(ctx, "snap", dst)
	<-killed
	t.Logf("import with the store killed mid-download: %v", err)
	if err == nil {
		t.Fatal("import succeeded although the store was killed")
	}
	if !errors.Is(err, errdefs.ErrUnavailable) {
		t.Errorf("error is not ErrUnavailable (retryable): %v", err)
	}
	if ents, _ := os.ReadDir(parent); len(ents) != 0 {
		t.Fatalf("failed import left %v", ents)
	}
	srv.Restart()
	if _, _, err := s.Import(ctx, "snap", dst); err != nil {
		t.Fatal(err)
	}
	sameTree(t, src, dst)
}

// A chunk whose stored bytes were replaced is refused by its digest, and
// nothing is left at the import directory. Control: before the tampering
// the same import succeeds.
func TestTamperedChunkRefused(t *testing.T) {
	srv := objstoretest.Start(t)
	s := open(t, srv)
	ctx := context.Background()
	src := snapDir(t, 4<<20, 6<<20)
	m, _, err := s.Export(ctx, "snap", src, nil)
	if err != nil {
		t.Fatal(err)
	}
	ok := filepath.Join(t.TempDir(), "ok")
	if _, _, err := s.Import(ctx, "snap", ok); err != nil {
		t.Fatalf("control import: %v", err)
	}
	var c Chunk
	for _, f := range m.Files {
		if f.Path == "memory/checkpoint.img" {
			c = f.Chunks[0]
		}
	}
	bad := randBytes(t, c.Size) // same size, other content
	if _, err := s.c.PutObject(ctx, s.bucket, s.chunkKey(c.SHA256), bytes.NewReader(bad), c.Size, minio.PutObjectOptions{}); err != nil {
		t.Fatal(err)
	}
	dst := filepath.Join(t.TempDir(), "snap")
	_, _, err = s.Import(ctx, "snap", dst)
	t.Logf("import with chunk %s replaced: %v", c.SHA256[:12], err)
	if !errors.Is(err, ErrCorrupt) {
		t.Fatalf("import of a tampered chunk: %v, want ErrCorrupt", err)
	}
	if _, err := os.Lstat(dst); !os.IsNotExist(err) {
		t.Fatal("refused import left its directory")
	}
	// A truncated chunk is refused too.
	if _, err := s.c.PutObject(ctx, s.bucket, s.chunkKey(c.SHA256), bytes.NewReader(bad[:10]), 10, minio.PutObjectOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := s.Import(ctx, "snap", dst); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("import of a truncated chunk: %v, want ErrCorrupt", err)
	}
}

// A manifest naming a path outside the import directory is refused before
// anything is written. Control: the same manifest with the path inside
// imports.
func TestHostileManifestRefused(t *testing.T) {
	srv := objstoretest.Start(t)
	s := open(t, srv)
	ctx := context.Background()
	src := snapDir(t, 1<<20, 1<<20)
	m, _, err := s.Export(ctx, "snap", src, nil)
	if err != nil {
		t.Fatal(err)
	}
	put := func(id, p string) {
		mm := *m
		mm.ID = id
		mm.Dirs = nil
		mm.Files = []File{m.Files[0]}
		mm.Files[0].Path = p
		b, _ := json.Marshal(mm)
		if _, err := s.c.PutObject(ctx, s.bucket, s.manifestKey(id), bytes.NewReader(b), int64(len(b)), minio.PutObjectOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	parent := t.TempDir()
	for _, p := range []string{"../escape", "/etc/escape", "a/../../escape", "./x"} {
		put("evil", p)
		_, _, err := s.Import(ctx, "evil", filepath.Join(parent, "in", "evil"))
		t.Logf("manifest path %q: %v", p, err)
		if !errors.Is(err, ErrCorrupt) {
			t.Errorf("manifest path %q: %v, want ErrCorrupt", p, err)
		}
	}
	if _, err := os.Lstat(filepath.Join(parent, "escape")); !os.IsNotExist(err) {
		t.Fatal("a hostile manifest wrote outside its directory")
	}
	put("good", "inside/file")
	if _, _, err := s.Import(ctx, "good", filepath.Join(parent, "in", "good")); err != nil {
		t.Fatalf("control: %v", err)
	}
}

// Delete removes the manifest and the chunks nothing else names; chunks a
// remaining snapshot shares stay, and it still imports.
func TestDeleteCollectsUnsharedChunks(t *testing.T) {
	srv := objstoretest.Start(t)
	s := open(t, srv)
	ctx := context.Background()
	a := snapDir(t, 1<<20, 8<<20)
	if _, _, err := s.Export(ctx, "a", a, nil); err != nil {
		t.Fatal(err)
	}
	before := chunkObjects(t, s)
	// b shares a's disk image, with a memory image of its own.
	if err := os.WriteFile(filepath.Join(a, "memory", "checkpoint.img"), randBytes(t, 8<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, _, err := s.Export(ctx, "b", a, nil); err != nil {
		t.Fatal(err)
	}
	both := chunkObjects(t, s)
	// A fresh chunk no manifest names (an export in flight) survives a
	// delete within the grace period.
	if _, err := s.putChunk(ctx, strings.Repeat("ab", 32), []byte("in flight")); err != nil {
		t.Fatal(err)
	}
	if err := s.Delete(ctx, "a", time.Minute); err != nil {
		t.Fatal(err)
	}
	if n := chunkObjects(t, s); n != both+1 {
		t.Errorf("within grace: %d chunks, want %d", n, both+1)
	}
	if err := s.Delete(ctx, "a", 0); err != nil {
		t.Fatal(err)
	}
	after := chunkObjects(t, s)
	t.Logf("chunks: a alone %d, a and b %d, after deleting a %d", before, both, after)
	if after != both-2 { // a's two memory chunks
		t.Errorf("after delete: %d chunks, want %d", after, both-2)
	}
	if _, err := s.Manifest(ctx, "a"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("deleted manifest: %v", err)
	}
	dst := filepath.Join(t.TempDir(), "b")
	if _, _, err := s.Import(ctx, "b", dst); err != nil {
		t.Fatal(err)
	}
	sameTree(t, a, dst)
}

// TestSpacesApart: one ID in two spaces names two manifests, a delete in
// one space leaves the other's, and the chunk collection keeps the chunks
// a manifest of any space names (the control: once no space names them,
// they go).
func TestSpacesApart(t *testing.T) {
	srv := objstoretest.Start(t)
	snaps := open(t, srv)
	tmpls := snaps.In(Templates)
	ctx := context.Background()
	dir := snapDir(t, 1<<20, 1<<20)
	if _, _, err := tmpls.Export(ctx, "x", dir, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := snaps.Manifest(ctx, "x"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("template x seen as snapshot x: %v", err)
	}
	if ids, err := snaps.List(ctx); err != nil || len(ids) != 0 {
		t.Fatalf("snapshots listed: %v %v", ids, err)
	}
	withTemplate := chunkObjects(t, snaps)
	// A snapshot x sharing every chunk, then deleted: the template's
	// chunks stay, and so does its manifest.
	if _, _, err := snaps.Export(ctx, "x", dir, nil); err != nil {
		t.Fatal(err)
	}
	if err := snaps.Delete(ctx, "x", 0); err != nil {
		t.Fatal(err)
	}
	if n := chunkObjects(t, snaps); n != withTemplate {
		t.Fatalf("after deleting snapshot x: %d chunks, want the template's %d", n, withTemplate)
	}
	if _, _, err := tmpls.Import(ctx, "x", filepath.Join(t.TempDir(), "x")); err != nil {
		t.Fatalf("template after the snapshot's delete: %v", err)
	}
	if err := tmpls.Delete(ctx, "x", 0); err != nil {
		t.Fatal(err)
	}
	if n := chunkObjects(t, snaps); n != 0 {
		t.Fatalf("after deleting both: %d chunks left", n)
	}
}

// du is the bytes allocated under dir.
func du(dir string) int64 {
	var n int64
	_ = filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err == nil && !d.IsDir() {
			var st syscall.Stat_t
			if syscall.Stat(p, &st) == nil {
				n += st.Blocks * 512
			}
		}
		return nil
	})
	return n
}

// TestMeasureTransfer logs export and import time against size (random
// bytes, so nothing is skipped as zeros or deduplicated). Long: set
// CUBE_OBJSTORE_MEASURE=1; CUBE_OBJSTORE_MEASURE_SIZES (MiB, comma
// separated) replaces the sizes 16,64,256,512, and
// CUBE_OBJSTORE_MEASURE_IMPORTS the number of imports of each export (1).
func TestMeasureTransfer(t *testing.T) {
	if os.Getenv("CUBE_OBJSTORE_MEASURE") == "" {
		t.Skip("set CUBE_OBJSTORE_MEASURE=1 to measure")
	}
	srv := objstoretest.Start(t)
	s := open(t, srv)
	ctx := context.Background()
	sizes := []int64{16, 64, 256, 512}
	if v := os.Getenv("CUBE_OBJSTORE_MEASURE_SIZES"); v != "" {
		sizes = nil
		for _, f := range strings.Split(v, ",") {
			n, err := strconv.ParseInt(strings.TrimSpace(f), 10, 64)
			if err != nil || n <= 0 {
				t.Fatalf("CUBE_OBJSTORE_MEASURE_SIZES: %q", f)
			}
			sizes = append(sizes, n)
		}
	}
	imports := 1
	if v := os.Getenv("CUBE_OBJSTORE_MEASURE_IMPORTS"); v != "" {
		if n, err := strconv.Atoi(v); err == nil && n > 0 {
			imports = n
		}
	}
	for _, mib := range sizes {
		dir := filepath.Join(t.TempDir(), "d")
		if err := os.MkdirAll(dir, 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, "memory.img"), randBytes(t, mib<<20), 0o600); err != nil {
			t.Fatal(err)
		}
		id := "m" + strings.Repeat("0", 3) + string(rune('a'+mib%26))
		_, est, err := s.Export(ctx, id, dir, nil)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("%4d MiB: export %6v (%5.0f MiB/s)", mib, est.Duration.Round(time.Millisecond), float64(mib)/est.Duration.Seconds())
		for range imports {
			cpu, weed := selfCPU(), srv.CPU()
			_, ist, err := s.Import(ctx, id, filepath.Join(t.TempDir(), "i"))
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("%4d MiB: import %6v (%5.0f MiB/s; final fsync %v; CPU: importer %v, store %v)", mib,
				ist.Duration.Round(time.Millisecond), float64(mib)/ist.Duration.Seconds(), ist.Sync.Round(time.Millisecond),
				(selfCPU() - cpu).Round(10*time.Millisecond), (srv.CPU() - weed).Round(10*time.Millisecond))
		}
		if err := s.Delete(ctx, id, 0); err != nil {
			t.Fatal(err)
		}
	}
}

// selfCPU is the processor time (user and system) this process has used.
func selfCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// TestImportSeeded: chunks a seed file holds at the same offsets are
// copied from it, the others downloaded, and the result is the exported
// file. A seed whose bytes differ (the control) is never used, so the
// import cannot pass by taking what the seed has.
func TestImportSeeded(t *testing.T) {
	srv := objstoretest.Start(t)
	s := open(t, srv)
	ctx := context.Background()
	dir := filepath.Join(t.TempDir(), "snap")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	// The template: 4 chunks of data. The disk: the template with its
	// second chunk changed.
	tmpl := randBytes(t, 4*ChunkSize)
	seed := filepath.Join(t.TempDir(), "template.img")
	if err := os.WriteFile(seed, tmpl, 0o600); err != nil {
		t.Fatal(err)
	}
	disk := bytes.Clone(tmpl)
	copy(disk[ChunkSize:], randBytes(t, 4096))
	if err := os.WriteFile(filepath.Join(dir, "disk.img"), disk, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, _, err := s.Export(ctx, "seeded", dir, nil); err != nil {
		t.Fatal(err)
	}
	m, err := s.Manifest(ctx, "seeded")
	if err != nil {
		t.Fatal(err)
	}
	other := filepath.Join(t.TempDir(), "other.img")
	if err := os.WriteFile(other, randBytes(t, 4*ChunkSize), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, seed   string
		reused, recv int64
	}{
		{"template seed", seed, 3 * ChunkSize, ChunkSize},
		{"unrelated seed (control)", other, 0, 4 * ChunkSize},
		{"missing seed", filepath.Join(t.TempDir(), "none"), 0, 4 * ChunkSize},
	} {
		dst := filepath.Join(t.TempDir(), "pool", "seeded")
		_, st, err := s.ImportWith(ctx, m, dst, ImportOptions{Seed: func(p string) string {
			if p == "disk.img" {
				return tc.seed
			}
			return ""
		}})
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		t.Logf("%s: %d MiB from the seed, %d MiB downloaded in %v", tc.name, st.Reused>>20, st.Received>>20, st.Duration)
		if st.Reused != tc.reused || st.Received != tc.recv {
			t.Errorf("%s: reused %d received %d, want %d and %d", tc.name, st.Reused, st.Received, tc.reused, tc.recv)
		}
		got, err := os.ReadFile(filepath.Join(dst, "disk.img"))
		if err != nil || !bytes.Equal(got, disk) {
			t.Errorf("%s: imported disk differs from the exported one (%v)", tc.name, err)
		}
	}
}
