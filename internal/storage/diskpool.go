package storage

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
)

// DiskPool keeps, per template, a few ready disks: FICLONEs of the template
// image made in the background, so a create renames one into place instead
// of cloning on its own critical path. A create that finds none clones
// inline (a miss); either way it wakes the refiller.
//
// Layout (inside the pool, so ready disks reflink and rename like sandbox
// disks):
//
//	Dir/ready/<templateID>/<gen>-<seq>.img    a ready disk
//	Dir/ready/<templateID>/.<gen>-<seq>.tmp   one being cloned
//
// gen is the template's generation (DiskSource.Gen): a template deleted and
// imported again under the same ID gets a new one, so a disk cloned from
// the old image is never handed out.
//
// Life: NewDiskPool, then Start with the node's templates (adopting the
// ready disks a crashed cubelet left, removing the rest), Take per create,
// Drain when a template is deleted, Close on shutdown (which removes every
// ready disk: they are cheap to remake and must not outlive their
// template). All methods are safe for concurrent use.
type DiskPool struct {
	pool *Pool
	cfg  DiskPoolConfig
	dir  string
	log  *slog.Logger

	mu      sync.Mutex
	sets    map[string]*readySet // by template ID
	drained map[string]int64     // template ID -> generation Drain removed
	closed  bool

	seq    atomic.Uint64
	wake   chan struct{}
	cancel context.CancelFunc
	done   chan struct{}
}

// DiskPoolConfig sizes a DiskPool.
type DiskPoolConfig struct {
	// Size is how many ready disks to keep per template; 0 disables the
	// pool (every Take clones inline).
	Size int
	// RefillPerSecond caps the refiller's clones per second, all
	// templates together; 0 = no cap.
	RefillPerSecond float64
	Log             *slog.Logger
}

// DiskSource is a template image that disks are cloned from.
type DiskSource struct {
	TemplateID string
	Image      string
	// Gen identifies this version of the image (cubelet uses the
	// template's creation time).
	Gen int64
}

// DiskPoolStats is one template's pool, for metrics.
type DiskPoolStats struct {
	TemplateID   string
	Ready        int
	Hits, Misses uint64
}

type readySet struct {
	src          DiskSource
	disks        []string // ready files, oldest first
	filling      bool     // the refiller is cloning one now
	broken       bool     // the last refill failed: wait for the next Take
	hits, misses uint64
}

// NewDiskPool returns a pool of ready disks inside p. It does nothing until
// Start.
func NewDiskPool(p *Pool, cfg DiskPoolConfig) *DiskPool {
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	return &DiskPool{
		pool:    p,
		cfg:     cfg,
		dir:     filepath.Join(p.dir, "ready"),
		log:     cfg.Log.With("component", "disk-pool"),
		sets:    map[string]*readySet{},
		drained: map[string]int64{},
		wake:    make(chan struct{}, 1),
		done:    make(chan struct{}),
	}
}

// Dir is where ready disks live.
func (d *DiskPool) Dir() string { return d.dir }

// Start adopts the ready disks of srcs left by a previous process (same
// template and generation, up to Size each), removes every other file under
// Dir, and starts the background refiller. It reports what it adopted and
// removed.
func (d *DiskPool) Start(srcs []DiskSource) (adopted, removed int, err error) {
	want := map[string]DiskSource{}
	for _, s := range srcs {
		want[s.TemplateID] = s
	}
	ents, err := os.ReadDir(d.dir)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return 0, 0, fmt.Errorf("storage: disk pool: %w", err)
	}
	var errs []error
	d.mu.Lock()
	for _, ent := range ents {
		sub := filepath.Join(d.dir, ent.Name())
		src, ok := want[ent.Name()]
		if !ok || !ent.IsDir() {
			errs = append(errs, os.RemoveAll(sub))
			removed++
			continue
		}
		files, _ := os.ReadDir(sub)
		names := make([]string, 0, len(files))
		for _, f := range files {
			names = append(names, f.Name())
		}
		sort.Strings(names)
		rs := d.set(src)
		for _, n := range names {
			if gen, ok := readyGen(n); ok && gen == src.Gen && len(rs.disks) < d.cfg.Size {
				rs.disks = append(rs.disks, filepath.Join(sub, n))
				adopted++
				continue
			}
			errs = append(errs, os.RemoveAll(filepath.Join(sub, n)))
			removed++
		}
	}
	for _, s := range srcs {
		d.set(s)
	}
	ctx, cancel := context.WithCancel(context.Background())
	d.cancel = cancel
	d.mu.Unlock()
	go d.refill(ctx)
	d.kick()
	return adopted, removed, errors.Join(errs...)
}

// readyGen parses "<gen>-<seq>.img".
func readyGen(name string) (int64, bool) {
	base, ok := strings.CutSuffix(name, ".img")
	if !ok {
		return 0, false
	}
	g, _, ok := strings.Cut(base, "-")
	if !ok {
		return 0, false
	}
	gen, err := strconv.ParseInt(g, 10, 64)
	return gen, err == nil
}

// set returns the ready set of src, (re)registering it; a set of another
// generation is replaced and its disks removed. Called with d.mu held.
func (d *DiskPool) set(src DiskSource) *readySet {
	rs := d.sets[src.TemplateID]
	if rs != nil && rs.src.Gen == src.Gen {
		rs.src.Image = src.Image
		return rs
	}
	if rs != nil {
		for _, p := range rs.disks {
			_ = os.Remove(p)
		}
	}
	rs = &readySet{src: src}
	d.sets[src.TemplateID] = rs
	return rs
}

// Take puts a disk of src at dst: a ready one renamed into place (hit) or,
// when there is none, a clone made now (miss). dst must not exist; on error
// nothing is left at dst.
func (d *DiskPool) Take(ctx context.Context, src DiskSource, dst string) (hit bool, err error) {
	if err := ctx.Err(); err != nil {
		return false, err
	}
	if _, err := os.Lstat(dst); err == nil {
		return false, fmt.Errorf("storage: disk %s: %w", dst, errdefs.ErrAlreadyExists)
	}
	var ready string
	d.mu.Lock()
	var rs *readySet
	if gen, gone := d.drained[src.TemplateID]; !d.closed && d.cfg.Size > 0 && (!gone || gen != src.Gen) {
		rs = d.set(src)
		rs.broken = false
		if n := len(rs.disks); n > 0 {
			ready = rs.disks[0]
			rs.disks = rs.disks[1:]
		}
	}
	d.mu.Unlock()
	if rs != nil {
		d.kick()
	}

	if ready != "" {
		err := d.place(ready, dst)
		if err == nil {
			d.count(src.TemplateID, true)
			return true, nil
		}
		d.log.Warn("ready disk unusable; cloning inline", "disk", ready, "err", err)
		_ = os.Remove(ready)
	}
	if err := d.pool.Clone(ctx, src.Image, dst); err != nil {
		return false, err
	}
	d.count(src.TemplateID, false)
	return false, nil
}

// place renames a ready disk to dst without replacing anything there.
func (d *DiskPool) place(ready, dst string) error {
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		return err
	}
	return os.Rename(ready, dst)
}

func (d *DiskPool) count(templateID string, hit bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	rs := d.sets[templateID]
	if rs == nil {
		return
	}
	if hit {
		rs.hits++
	} else {
		rs.misses++
	}
}

// Drain stops keeping disks for templateID and removes its ready disks.
// Takes for the same generation afterwards clone inline and do not
// re-register it (a template being deleted must not get new disks); a new
// generation (the template imported again) registers normally.
func (d *DiskPool) Drain(templateID string) error {
	d.mu.Lock()
	rs := d.sets[templateID]
	delete(d.sets, templateID)
	if rs != nil {
		d.drained[templateID] = rs.src.Gen
	}
	d.mu.Unlock()
	// The refiller may be cloning one right now: it finds the set gone
	// when it finishes and removes its own file.
	if err := os.RemoveAll(filepath.Join(d.dir, templateID)); err != nil {
		return fmt.Errorf("storage: drain disk pool of %s: %w", templateID, err)
	}
	return nil
}

// Close stops the refiller, waits for it, and removes every ready disk.
// Takes afterwards clone inline.
func (d *DiskPool) Close() error {
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return nil
	}
	d.closed = true
	cancel := d.cancel
	d.sets = map[string]*readySet{}
	d.mu.Unlock()
	if cancel != nil {
		cancel()
		<-d.done
	}
	if err := os.RemoveAll(d.dir); err != nil {
		return fmt.Errorf("storage: close disk pool: %w", err)
	}
	return nil
}

// Stats returns every template's pool, sorted by template ID.
func (d *DiskPool) Stats() []DiskPoolStats {
	d.mu.Lock()
	defer d.mu.Unlock()
	out := make([]DiskPoolStats, 0, len(d.sets))
	for id, rs := range d.sets {
		out = append(out, DiskPoolStats{TemplateID: id, Ready: len(rs.disks), Hits: rs.hits, Misses: rs.misses})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].TemplateID < out[j].TemplateID })
	return out
}

func (d *DiskPool) kick() {
	select {
	case d.wake <- struct{}{}:
	default:
	}
}

// refill is the background loop: whenever woken, it tops every template up
// to Size, one clone at a time, at most RefillPerSecond per second.
func (d *DiskPool) refill(ctx context.Context) {
	defer close(d.done)
	var gap time.Duration
	if d.cfg.RefillPerSecond > 0 {
		gap = time.Duration(float64(time.Second) / d.cfg.RefillPerSecond)
	}
	for {
		select {
		case <-ctx.Done():
			return
		case <-d.wake:
		}
		for {
			rs, src := d.next()
			if rs == nil {
				break
			}
			path, err := d.fill(ctx, src)
			d.finish(rs, src, path, err)
			if gap > 0 {
				select {
				case <-ctx.Done():
					return
				case <-time.After(gap):
				}
			} else if ctx.Err() != nil {
				return
			}
		}
	}
}

// next picks a template below Size and marks it filling.
func (d *DiskPool) next() (*readySet, DiskSource) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil, DiskSource{}
	}
	var best *readySet
	for _, rs := range d.sets {
		if rs.filling || rs.broken || len(rs.disks) >= d.cfg.Size {
			continue
		}
		// Emptiest first, so a burst on one template does not starve
		// the others.
		if best == nil || len(rs.disks) < len(best.disks) {
			best = rs
		}
	}
	if best == nil {
		return nil, DiskSource{}
	}
	best.filling = true
	return best, best.src
}

// fill clones src into a temporary name and renames it ready, so a crash
// never leaves a half-made disk under a ready name.
func (d *DiskPool) fill(ctx context.Context, src DiskSource) (string, error) {
	name := fmt.Sprintf("%d-%06d", src.Gen, d.seq.Add(1))
	sub := filepath.Join(d.dir, src.TemplateID)
	tmp := filepath.Join(sub, "."+name+".tmp")
	if err := d.pool.Clone(ctx, src.Image, tmp); err != nil {
		return "", err
	}
	final := filepath.Join(sub, name+".img")
	if err := os.Rename(tmp, final); err != nil {
		_ = os.Remove(tmp)
		return "", err
	}
	return final, nil
}

// finish files a refilled disk, or removes it when its template was
// drained or replaced meanwhile.
func (d *DiskPool) finish(rs *readySet, src DiskSource, path string, err error) {
	d.mu.Lock()
	rs.filling = false
	current := !d.closed && d.sets[src.TemplateID] == rs
	if err != nil {
		rs.broken = true
	} else if current {
		rs.disks = append(rs.disks, path)
		path = ""
	}
	d.mu.Unlock()
	if err != nil && current {
		d.log.Warn("refill failed; retrying on the next create", "template_id", src.TemplateID, "err", err)
	}
	if path != "" {
		_ = os.Remove(path)
	}
}
