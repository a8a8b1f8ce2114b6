// Package objstore ships snapshot directories through an S3-compatible
// object store. A directory is stored content-addressed: each file is cut
// into fixed-size chunks, each chunk is an object named by its SHA-256
// (so a chunk shared by two snapshots, or uploaded again after a failed
// export, is stored once), and all-zero chunks are not stored at all (a
// sparse disk image stays sparse both ways). The manifest listing every
// file and chunk is written last, in one PUT: until it exists the snapshot
// does not exist for any reader, so a partially uploaded snapshot is never
// used. Import checks every chunk against its digest, writes into a
// staging directory and renames it into place only when every file is
// complete.
package objstore

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"
	"golang.org/x/sync/errgroup"
	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/errdefs"
)

// ChunkSize is how files are cut. 4 MiB keeps a chunk's PUT well above the
// per-request overhead while a failed transfer retries little.
const ChunkSize = 4 << 20

// parallel is how many chunks move at once in either direction.
const parallel = 8

// chunkBufs holds chunk-sized buffers (one byte more, to tell an
// oversized object from a whole one): a transfer reuses them instead of
// allocating, faulting in and collecting 4 MiB per chunk.
var chunkBufs = sync.Pool{New: func() any {
	b := make([]byte, ChunkSize+1)
	return &b
}}

func getBuf() *[]byte  { return chunkBufs.Get().(*[]byte) }
func putBuf(b *[]byte) { chunkBufs.Put(b) }

// ManifestVersion is the manifest layout this package writes and reads.
const ManifestVersion = 1

// ErrCorrupt marks stored content that does not match its digest or size:
// tampered with, or damaged. It is also ErrFailedPrecondition.
var ErrCorrupt = fmt.Errorf("objstore: stored content is corrupt or was tampered with: %w", errdefs.ErrFailedPrecondition)

// Config locates the store. The keys are read from files, never taken on a
// command line or logged.
type Config struct {
	// Endpoint is host:port of the S3 API.
	Endpoint string `toml:"endpoint"`
	// Bucket holds every object; it must exist.
	Bucket string `toml:"bucket"`
	// Prefix is put before every key ("" for none); it ends with "/".
	Prefix string `toml:"prefix"`
	Region string `toml:"region"`
	// Secure speaks HTTPS to the endpoint.
	Secure        bool   `toml:"secure"`
	AccessKeyFile string `toml:"access_key_file"`
	SecretKeyFile string `toml:"secret_key_file"`
}

// Enabled reports whether a store is configured at all.
func (c Config) Enabled() bool { return c.Endpoint != "" }

// Store is a handle on one bucket and one of its manifest spaces.
type Store struct {
	c      *minio.Client
	bucket string
	prefix string
	space  string
}

// Manifest spaces: manifests of different kinds of things live apart (an
// ID means one thing in each), while their chunks share one pool, so a
// chunk two of them hold is stored once.
const (
	// Snapshots is the default space: sandbox snapshots.
	Snapshots = "snapshots"
	// Templates holds cluster templates' images.
	Templates = "templates"
)

var spaces = []string{Snapshots, Templates}

// In returns a handle on the same bucket whose manifests (Export,
// Manifest, Import, Delete, List) are those of space (Snapshots or
// Templates).
func (s *Store) In(space string) *Store {
	if !slices.Contains(spaces, space) {
		panic("objstore: unknown space " + space)
	}
	c := *s
	c.space = space
	return &c
}

// Open reads the keys from their files and connects (lazily: nothing is
// sent until the first call).
func Open(cfg Config) (*Store, error) {
	if cfg.Endpoint == "" || cfg.Bucket == "" {
		return nil, fmt.Errorf("objstore: endpoint and bucket are required: %w", errdefs.ErrInvalidArgument)
	}
	if cfg.Prefix != "" && !strings.HasSuffix(cfg.Prefix, "/") {
		return nil, fmt.Errorf("objstore: prefix %q must end with /: %w", cfg.Prefix, errdefs.ErrInvalidArgument)
	}
	ak, err := readKey(cfg.AccessKeyFile, "access_key_file")
	if err != nil {
		return nil, err
	}
	sk, err := readKey(cfg.SecretKeyFile, "secret_key_file")
	if err != nil {
		return nil, err
	}
	return New(cfg.Endpoint, cfg.Bucket, cfg.Prefix, cfg.Region, ak, sk, cfg.Secure)
}

func readKey(file, field string) (string, error) {
	if file == "" {
		return "", fmt.Errorf("objstore: %s is required: %w", field, errdefs.ErrInvalidArgument)
	}
	b, err := os.ReadFile(file)
	if err != nil {
		// The path, not the content, goes into the error.
		return "", fmt.Errorf("objstore: read %s %s: %w", field, file, err)
	}
	return strings.TrimSpace(string(b)), nil
}

// New connects with the keys given.
func New(endpoint, bucket, prefix, region, accessKey, secretKey string, secure bool) (*Store, error) {
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.MaxIdleConnsPerHost = parallel * 2
	c, err := minio.New(endpoint, &minio.Options{
		Creds:     credentials.NewStaticV4(accessKey, secretKey, ""),
		Secure:    secure,
		Region:    region,
		Transport: tr,
		// A store that went away fails the call fast instead of being
		// retried for minutes; the caller decides about retrying the
		// whole operation.
		MaxRetries: 2,
	})
	if err != nil {
		return nil, fmt.Errorf("objstore: %w", err)
	}
	return &Store{c: c, bucket: bucket, prefix: prefix, space: Snapshots}, nil
}

// File is one regular file of an exported directory.
type File struct {
	// Path is relative to the directory, slash-separated.
	Path string `json:"path"`
	Size int64  `json:"size"`
	Mode uint32 `json:"mode"`
	// Chunks are the stored (non-zero) chunks; every range not covered
	// is zeros.
	Chunks []Chunk `json:"chunks,omitempty"`
}

// Chunk is one stored piece of a file.
type Chunk struct {
	Offset int64  `json:"offset"`
	Size   int64  `json:"size"`
	SHA256 string `json:"sha256"`
}

// Manifest describes one exported directory. It is written after every
// chunk it names.
type Manifest struct {
	Version   int       `json:"version"`
	ID        string    `json:"id"`
	CreatedAt time.Time `json:"created_at"`
	// Meta is the caller's own description (the snapshot record).
	Meta  json.RawMessage `json:"meta,omitempty"`
	Dirs  []string        `json:"dirs,omitempty"`
	Files []File          `json:"files"`
}

// StoredBytes is the sum of the chunks' sizes (zeros not stored).
func (m *Manifest) StoredBytes() int64 {
	var n int64
	for _, f := range m.Files {
		for _, c := range f.Chunks {
			n += c.Size
		}
	}
	return n
}

// Stats tells what an export or import moved.
type Stats struct {
	Files int
	// LogicalBytes is the files' sizes, holes included.
	LogicalBytes int64
	// StoredBytes is the non-zero chunks' bytes.
	StoredBytes int64
	// Sent is the bytes of chunks actually uploaded (the others were
	// already in the store); Received the bytes downloaded.
	Sent, Received int64
	// Reused is the bytes of chunks an import took from a local seed
	// file (ImportOptions.Seed) instead of the store.
	Reused   int64
	Duration time.Duration
	// Sync is the part of an import's Duration spent in the final
	// fsyncs of its files.
	Sync time.Duration
}

var idRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$`)

func validID(id string) error {
	if !idRE.MatchString(id) {
		return fmt.Errorf("objstore: bad id %q: %w", id, errdefs.ErrInvalidArgument)
	}
	return nil
}

func (s *Store) manifestKey(id string) string {
	return s.prefix + s.space + "/" + id + "/manifest.json"
}
func (s *Store) chunkKey(sum string) string { return s.prefix + "chunks/sha256/" + sum }

// Export uploads every regular file under dir and then the manifest for
// id, with meta (JSON-encoded) in it. Only regular files and directories
// are allowed. An export of an id that already exists in the store
// replaces its manifest.
func (s *Store) Export(ctx context.Context, id, dir string, meta any) (*Manifest, Stats, error) {
	start := time.Now()
	var st Stats
	if err := validID(id); err != nil {
		return nil, st, err
	}
	m := &Manifest{Version: ManifestVersion, ID: id, CreatedAt: time.Now().UTC()}
	if meta != nil {
		b, err := json.Marshal(meta)
		if err != nil {
			return nil, st, fmt.Errorf("objstore: encode meta: %w", err)
		}
		m.Meta = b
	}
	// Every file's chunks go through one group: a snapshot's small files
	// (a memory image's metadata) do not wait for its disk's chunks, and
	// parallel chunks move at once in all.
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(parallel)
	var files []*exportingFile
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(dir, p)
		if err != nil {
			return err
		}
		if rel == "." {
			return nil
		}
		rel = filepath.ToSlash(rel)
		switch {
		case d.IsDir():
			m.Dirs = append(m.Dirs, rel)
		case d.Type().IsRegular():
			f, err := s.exportFile(gctx, g, p, rel)
			if err != nil {
				return err
			}
			files = append(files, f)
		default:
			return fmt.Errorf("objstore: %s is neither a regular file nor a directory: %w", p, errdefs.ErrInvalidArgument)
		}
		return nil
	})
	werr := g.Wait()
	for _, f := range files {
		f.fh.Close()
	}
	if err == nil {
		err = werr
	}
	if err != nil {
		return nil, st, fmt.Errorf("objstore: export %s: %w", id, err)
	}
	for _, f := range files {
		st.LogicalBytes += f.Size
		for i, c := range f.chunks {
			st.Sent += f.sent[i]
			if c != nil {
				f.Chunks = append(f.Chunks, *c)
			}
		}
		m.Files = append(m.Files, f.File)
	}
	b, err := json.Marshal(m)
	if err != nil {
		return nil, st, fmt.Errorf("objstore: encode manifest: %w", err)
	}
	// Last: the snapshot exists in the store from this PUT on.
	if _, err := s.c.PutObject(ctx, s.bucket, s.manifestKey(id), bytes.NewReader(b), int64(len(b)),
		minio.PutObjectOptions{ContentType: "application/json", SendContentMd5: true}); err != nil {
		return nil, st, fmt.Errorf("objstore: export %s: write manifest: %w", id, wrapNet(err))
	}
	st.Files = len(m.Files)
	st.StoredBytes = m.StoredBytes()
	st.Duration = time.Since(start)
	return m, st, nil
}

// exportingFile is a file whose chunks are being uploaded.
type exportingFile struct {
	File
	fh     *os.File
	chunks []*Chunk // nil: all zeros
	sent   []int64
}

// exportFile queues one file's chunks on g. A chunk that lies wholly in a
// hole of a sparse file (SEEK_DATA finds no data in it) is zeros without
// being read. The caller closes f.fh once g is done.
func (s *Store) exportFile(ctx context.Context, g *errgroup.Group, p, rel string) (*exportingFile, error) {
	fh, err := os.Open(p)
	if err != nil {
		return nil, err
	}
	fi, err := fh.Stat()
	if err != nil {
		fh.Close()
		return nil, err
	}
	f := &exportingFile{File: File{Path: rel, Size: fi.Size(), Mode: uint32(fi.Mode().Perm())}, fh: fh}
	n := (f.Size + ChunkSize - 1) / ChunkSize
	f.chunks, f.sent = make([]*Chunk, n), make([]int64, n)
	ext, e := dataExtents(fh, f.Size), 0
	for i := int64(0); i < n; i++ {
		off := i * ChunkSize
		size := min(int64(ChunkSize), f.Size-off)
		if ext != nil {
			for e < len(ext) && ext[e][1] <= off {
				e++
			}
			if e == len(ext) || ext[e][0] >= off+size {
				continue // a hole: zeros
			}
		}
		g.Go(func() error {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			bp := getBuf()
			defer putBuf(bp)
			buf := (*bp)[:size]
			if _, err := fh.ReadAt(buf, off); err != nil && !errors.Is(err, io.EOF) {
				return err
			}
			if allZero(buf) {
				return nil
			}
			sum := sha256.Sum256(buf)
			c := &Chunk{Offset: off, Size: size, SHA256: hex.EncodeToString(sum[:])}
			f.chunks[i] = c
			up, err := s.putChunk(ctx, c.SHA256, buf)
			if up {
				f.sent[i] = size
			}
			return err
		})
	}
	return f, nil
}

// dataExtents lists fh's data ranges with SEEK_DATA and SEEK_HOLE.
// They are in order; nil when the file system cannot tell (then every
// range may hold data).
func dataExtents(fh *os.File, size int64) [][2]int64 {
	fd := int(fh.Fd())
	ext := [][2]int64{}
	for off := int64(0); off < size; {
		start, err := unix.Seek(fd, off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			break // no data after off
		}
		if err != nil {
			return nil
		}
		end, err := unix.Seek(fd, start, unix.SEEK_HOLE)
		if err != nil {
			return nil
		}
		ext = append(ext, [2]int64{start, end})
		off = end
	}
	return ext
}

// putChunk stores one chunk unless an object of its digest and size is
// there already. It reports whether it uploaded.
func (s *Store) putChunk(ctx context.Context, sum string, buf []byte) (bool, error) {
	key := s.chunkKey(sum)
	if oi, err := s.c.StatObject(ctx, s.bucket, key, minio.StatObjectOptions{}); err == nil && oi.Size == int64(len(buf)) {
		return false, nil
	}
	// The body is not hashed again for the request's signature
	// (UNSIGNED-PAYLOAD): its Content-MD5, which is signed, lets the
	// store refuse a body damaged or altered on the way, and the content
	// is checked against its digest on every import anyway.
	if _, err := s.c.PutObject(ctx, s.bucket, key, bytes.NewReader(buf), int64(len(buf)),
		minio.PutObjectOptions{ContentType: "application/octet-stream", SendContentMd5: true, DisableMultipart: true, DisableContentSha256: true}); err != nil {
		return false, fmt.Errorf("put chunk %s: %w", sum, wrapNet(err))
	}
	return true, nil
}

func allZero(b []byte) bool {
	for len(b) >= 8 {
		if b[0]|b[1]|b[2]|b[3]|b[4]|b[5]|b[6]|b[7] != 0 {
			return false
		}
		b = b[8:]
	}
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}

// Manifest reads id's manifest; ErrNotFound when the store has none (also
// while an export of it is still uploading chunks).
func (s *Store) Manifest(ctx context.Context, id string) (*Manifest, error) {
	if err := validID(id); err != nil {
		return nil, err
	}
	obj, err := s.c.GetObject(ctx, s.bucket, s.manifestKey(id), minio.GetObjectOptions{})
	if err != nil {
		return nil, fmt.Errorf("objstore: manifest %s: %w", id, wrapNet(err))
	}
	defer obj.Close()
	// A manifest is small; one far larger than any real one is refused
	// rather than read into memory.
	b, err := io.ReadAll(io.LimitReader(obj, 64<<20))
	if err != nil {
		return nil, fmt.Errorf("objstore: manifest %s: %w", id, wrapNet(err))
	}
	var m Manifest
	if err := json.Unmarshal(b, &m); err != nil {
		return nil, fmt.Errorf("objstore: manifest %s: %v: %w", id, err, ErrCorrupt)
	}
	if err := m.check(id); err != nil {
		return nil, err
	}
	return &m, nil
}

var sumRE = regexp.MustCompile(`^[0-9a-f]{64}$`)

// check refuses a manifest that could write outside the import directory
// or describes impossible chunks: the store is not trusted to be honest.
func (m *Manifest) check(id string) error {
	bad := func(format string, a ...any) error {
		return fmt.Errorf("objstore: manifest %s: %s: %w", id, fmt.Sprintf(format, a...), ErrCorrupt)
	}
	if m.Version != ManifestVersion {
		return bad("version %d, want %d", m.Version, ManifestVersion)
	}
	if m.ID != id {
		return bad("names id %q", m.ID)
	}
	seen := map[string]bool{}
	for _, d := range m.Dirs {
		if !localPath(d) || seen[d] {
			return bad("directory %q", d)
		}
		seen[d] = true
	}
	for _, f := range m.Files {
		if !localPath(f.Path) || seen[f.Path] {
			return bad("file %q", f.Path)
		}
		seen[f.Path] = true
		if f.Size < 0 || f.Mode&^0o777 != 0 {
			return bad("file %q: size %d mode %o", f.Path, f.Size, f.Mode)
		}
		next := int64(0)
		for _, c := range f.Chunks {
			if c.Offset < next || c.Offset%ChunkSize != 0 || c.Size <= 0 || c.Size > ChunkSize || c.Offset+c.Size > f.Size || !sumRE.MatchString(c.SHA256) {
				return bad("file %q: chunk at %d", f.Path, c.Offset)
			}
			next = c.Offset + c.Size
		}
	}
	return nil
}

// localPath reports whether p is a clean relative slash path that stays
// inside its directory.
func localPath(p string) bool {
	return p != "" && p != "." && path.Clean(p) == p && filepath.IsLocal(filepath.FromSlash(p)) && !strings.Contains(p, "\\")
}

// Import downloads id into dir, which must not exist: every chunk is
// checked against its digest, the files are written into a staging
// directory beside dir, synced, and the staging directory is renamed to
// dir only when all of them are complete. On any failure nothing is left
// at dir.
func (s *Store) Import(ctx context.Context, id, dir string) (*Manifest, Stats, error) {
	m, err := s.Manifest(ctx, id)
	if err != nil {
		return nil, Stats{}, err
	}
	return s.ImportManifest(ctx, m, dir, nil)
}

// ImportManifest is Import of a manifest already read (Manifest), leaving
// out the files and directories skip returns true for (nil: none).
func (s *Store) ImportManifest(ctx context.Context, m *Manifest, dir string, skip func(path string) bool) (*Manifest, Stats, error) {
	return s.ImportWith(ctx, m, dir, ImportOptions{Skip: skip})
}

// ImportOptions shape ImportWith.
type ImportOptions struct {
	// Skip leaves out the files and directories it returns true for.
	Skip func(path string) bool
	// Seed names a local file that may hold some of the file at path's
	// chunks at the same offsets ("" for none): a snapshot's disk image
	// and the template image it was cloned from. A chunk whose bytes at
	// that offset in the seed have its digest is copied from the seed
	// instead of downloaded; any other is downloaded. The seed is only
	// read, and every chunk taken from it is checked like a downloaded
	// one, so a seed that changes meanwhile costs downloads, never
	// correctness.
	Seed func(path string) string
}

// ImportWith is ImportManifest with options.
func (s *Store) ImportWith(ctx context.Context, m *Manifest, dir string, o ImportOptions) (*Manifest, Stats, error) {
	skip := o.Skip
	start := time.Now()
	var st Stats
	id := m.ID
	if err := m.check(id); err != nil {
		return nil, st, err
	}
	if skip == nil {
		skip = func(string) bool { return false }
	}
	if _, err := os.Lstat(dir); err == nil {
		return nil, st, fmt.Errorf("objstore: import %s: %s exists: %w", id, dir, errdefs.ErrAlreadyExists)
	}
	if err := os.MkdirAll(filepath.Dir(dir), 0o700); err != nil {
		return nil, st, fmt.Errorf("objstore: import %s: %w", id, err)
	}
	stage, err := os.MkdirTemp(filepath.Dir(dir), "."+filepath.Base(dir)+".import-")
	if err != nil {
		return nil, st, fmt.Errorf("objstore: import %s: %w", id, err)
	}
	ok := false
	defer func() {
		if !ok {
			_ = os.RemoveAll(stage)
		}
	}()
	for _, d := range m.Dirs {
		if skip(d) {
			continue
		}
		if err := os.MkdirAll(filepath.Join(stage, filepath.FromSlash(d)), 0o700); err != nil {
			return nil, st, fmt.Errorf("objstore: import %s: %w", id, err)
		}
	}
	// Every file's chunks go through one group (parallel at once in all).
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(parallel)
	var files []*importingFile
	var err2 error
	for _, f := range m.Files {
		if skip(f.Path) {
			continue
		}
		st.Files++
		st.LogicalBytes += f.Size
		seed := ""
		if o.Seed != nil {
			seed = o.Seed(f.Path)
		}
		imf, err := s.importFile(gctx, g, stage, f, seed)
		if err != nil {
			err2 = fmt.Errorf("objstore: import %s: %s: %w", id, f.Path, err)
			break
		}
		files = append(files, imf)
	}
	werr := g.Wait()
	if werr == nil && err2 == nil {
		// Every file's fsync at once: the disk image's does not wait
		// for the memory image's.
		begin := time.Now()
		var sg errgroup.Group
		for _, f := range files {
			sg.Go(func() error {
				if err := f.fh.Sync(); err != nil {
					return fmt.Errorf("objstore: import %s: %s: %w", id, f.Path, err)
				}
				return nil
			})
		}
		err2 = sg.Wait()
		st.Sync = time.Since(begin)
	}
	for _, f := range files {
		for i, r := range f.recv {
			if f.reused[i] {
				st.Reused += r
			} else {
				st.Received += r
			}
		}
		if f.seed != nil {
			f.seed.Close()
		}
		if err := f.fh.Close(); err != nil && err2 == nil {
			err2 = fmt.Errorf("objstore: import %s: %s: %w", id, f.Path, err)
		}
	}
	if err2 == nil && werr != nil {
		err2 = fmt.Errorf("objstore: import %s: %w", id, werr)
	}
	if err2 != nil {
		return nil, st, err2
	}
	// The files' names must be on disk before the directory that holds
	// them is published, and the rename itself before the caller records
	// the import: a crash must not leave a record naming files that were
	// never there.
	if err := syncDirs(stage); err != nil {
		return nil, st, fmt.Errorf("objstore: import %s: %w", id, err)
	}
	if err := os.Rename(stage, dir); err != nil {
		return nil, st, fmt.Errorf("objstore: import %s: %w", id, err)
	}
	if err := syncDir(filepath.Dir(dir)); err != nil {
		_ = os.RemoveAll(dir)
		return nil, st, fmt.Errorf("objstore: import %s: %w", id, err)
	}
	ok = true
	st.StoredBytes = m.StoredBytes()
	st.Duration = time.Since(start)
	return m, st, nil
}

// importingFile is a file whose chunks are being downloaded.
type importingFile struct {
	File
	fh     *os.File
	seed   *os.File // nil: none
	recv   []int64
	reused []bool
}

// importFile creates f under stage and queues its chunks on g, each taken
// from seedPath ("" for none) where it holds it, else downloaded; the
// caller syncs and closes fh, and closes seed, once g is done.
func (s *Store) importFile(ctx context.Context, g *errgroup.Group, stage string, f File, seedPath string) (*importingFile, error) {
	p := filepath.Join(stage, filepath.FromSlash(f.Path))
	if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
		return nil, err
	}
	fh, err := os.OpenFile(p, os.O_CREATE|os.O_EXCL|os.O_WRONLY, os.FileMode(f.Mode))
	if err != nil {
		return nil, err
	}
	// Truncate first: ranges no chunk covers are holes, read as zeros.
	if err := fh.Truncate(f.Size); err != nil {
		fh.Close()
		return nil, err
	}
	imf := &importingFile{File: f, fh: fh, recv: make([]int64, len(f.Chunks)), reused: make([]bool, len(f.Chunks))}
	if seedPath != "" {
		// A seed that cannot be opened is no seed: every chunk is
		// downloaded.
		if sf, err := os.Open(seedPath); err == nil {
			imf.seed = sf
		}
	}
	for i, c := range f.Chunks {
		g.Go(func() error {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			bp := getBuf()
			defer putBuf(bp)
			buf, ok := seedChunk(imf.seed, c, *bp)
			if ok {
				imf.reused[i] = true
			} else {
				var err error
				if buf, err = s.getChunk(ctx, c, *bp); err != nil {
					return fmt.Errorf("%s: %w", f.Path, err)
				}
			}
			imf.recv[i] = c.Size
			if _, err := fh.WriteAt(buf, c.Offset); err != nil {
				return err
			}
			// Start writing the chunk to disk now, without waiting: the
			// file's fsync once every chunk is in then has little left
			// to write, instead of the whole file at the end.
			_ = unix.SyncFileRange(int(fh.Fd()), c.Offset, c.Size, unix.SYNC_FILE_RANGE_WRITE)
			return nil
		})
	}
	return imf, nil
}

// seedChunk reads chunk c's bytes from seed at its offset into buf (at
// least c.Size long) and reports whether they have its digest.
func seedChunk(seed *os.File, c Chunk, buf []byte) ([]byte, bool) {
	if seed == nil {
		return nil, false
	}
	buf = buf[:c.Size]
	if n, err := seed.ReadAt(buf, c.Offset); int64(n) != c.Size || (err != nil && !errors.Is(err, io.EOF)) {
		return nil, false
	}
	if sum := sha256.Sum256(buf); hex.EncodeToString(sum[:]) != c.SHA256 {
		return nil, false
	}
	return buf, true
}

// getChunk downloads one chunk into buf (at least c.Size+1 long) and
// checks its size and digest; it returns the chunk's bytes, in buf.
func (s *Store) getChunk(ctx context.Context, c Chunk, buf []byte) ([]byte, error) {
	obj, err := s.c.GetObject(ctx, s.bucket, s.chunkKey(c.SHA256), minio.GetObjectOptions{})
	if err != nil {
		return nil, fmt.Errorf("get chunk %s: %w", c.SHA256, wrapNet(err))
	}
	defer obj.Close()
	buf = buf[:c.Size+1]
	n, err := io.ReadFull(obj, buf)
	if err != nil && !errors.Is(err, io.ErrUnexpectedEOF) {
		return nil, fmt.Errorf("get chunk %s: %w", c.SHA256, wrapNet(err))
	}
	if int64(n) != c.Size {
		// A body cut short while the object is the right size is the
		// connection (the store went away): retryable, not corrupt.
		oi, serr := obj.Stat()
		if serr != nil {
			return nil, fmt.Errorf("get chunk %s: cut off after %d of %d bytes: %w", c.SHA256, n, c.Size, wrapNet(serr))
		}
		if oi.Size == c.Size && int64(n) < c.Size {
			return nil, fmt.Errorf("get chunk %s: cut off after %d of %d bytes: %w", c.SHA256, n, c.Size, errdefs.ErrUnavailable)
		}
		return nil, fmt.Errorf("chunk %s: %d bytes, want %d: %w", c.SHA256, n, c.Size, ErrCorrupt)
	}
	buf = buf[:n]
	if sum := sha256.Sum256(buf); hex.EncodeToString(sum[:]) != c.SHA256 {
		return nil, fmt.Errorf("chunk %s: content has digest %x: %w", c.SHA256, sum, ErrCorrupt)
	}
	return buf, nil
}

// Delete removes id's manifest (the snapshot is gone for readers at once),
// then every chunk no other manifest names and that is older than grace
// (a younger one may belong to an export still uploading).
func (s *Store) Delete(ctx context.Context, id string, grace time.Duration) error {
	if err := validID(id); err != nil {
		return err
	}
	if err := s.c.RemoveObject(ctx, s.bucket, s.manifestKey(id), minio.RemoveObjectOptions{}); err != nil {
		return fmt.Errorf("objstore: delete %s: %w", id, wrapNet(err))
	}
	_, err := s.GC(ctx, grace)
	return err
}

// List returns the ids that have a manifest in the handle's space.
func (s *Store) List(ctx context.Context) ([]string, error) {
	var ids []string
	pre := s.prefix + s.space + "/"
	for oi := range s.c.ListObjects(ctx, s.bucket, minio.ListObjectsOptions{Prefix: pre, Recursive: true}) {
		if oi.Err != nil {
			return nil, fmt.Errorf("objstore: list: %w", wrapNet(oi.Err))
		}
		if id, ok := strings.CutSuffix(strings.TrimPrefix(oi.Key, pre), "/manifest.json"); ok {
			ids = append(ids, id)
		}
	}
	return ids, nil
}

// GC removes the chunks that no manifest (of any space) names and that
// are older than grace; it returns how many it removed.
func (s *Store) GC(ctx context.Context, grace time.Duration) (int, error) {
	live := map[string]bool{}
	for _, space := range spaces {
		in := s.In(space)
		ids, err := in.List(ctx)
		if err != nil {
			return 0, err
		}
		for _, id := range ids {
			m, err := in.Manifest(ctx, id)
			if errors.Is(err, errdefs.ErrNotFound) {
				continue // deleted meanwhile
			}
			if err != nil {
				// An unreadable manifest keeps everything: a chunk it
				// names must not go because it could not be read.
				return 0, err
			}
			for _, f := range m.Files {
				for _, c := range f.Chunks {
					live[c.SHA256] = true
				}
			}
		}
	}
	pre := s.prefix + "chunks/sha256/"
	cutoff := time.Now().Add(-grace)
	removed := 0
	for oi := range s.c.ListObjects(ctx, s.bucket, minio.ListObjectsOptions{Prefix: pre, Recursive: true}) {
		if oi.Err != nil {
			return removed, fmt.Errorf("objstore: gc: %w", wrapNet(oi.Err))
		}
		if live[strings.TrimPrefix(oi.Key, pre)] || oi.LastModified.After(cutoff) {
			continue
		}
		if err := s.c.RemoveObject(ctx, s.bucket, oi.Key, minio.RemoveObjectOptions{}); err != nil {
			return removed, fmt.Errorf("objstore: gc: %w", wrapNet(err))
		}
		removed++
	}
	return removed, nil
}

// wrapNet gives a store error its errdefs kind: a missing object is
// ErrNotFound, refused keys ErrPermissionDenied, anything else (the store
// unreachable, a reset connection) ErrUnavailable, so callers can retry.
func wrapNet(err error) error {
	if err == nil || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return err
	}
	switch minio.ToErrorResponse(err).Code {
	case minio.NoSuchKey, "NoSuchBucket":
		return fmt.Errorf("%w: %w", err, errdefs.ErrNotFound)
	case "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch":
		return fmt.Errorf("%w: %w", err, errdefs.ErrPermissionDenied)
	}
	return fmt.Errorf("%w: %w", err, errdefs.ErrUnavailable)
}

// syncDirs fsyncs root and every directory under it.
func syncDirs(root string) error {
	return filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil || !d.IsDir() {
			return err
		}
		return syncDir(p)
	})
}

// syncDir fsyncs directory p, making its entries durable.
func syncDir(p string) error {
	d, err := os.Open(p)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}
