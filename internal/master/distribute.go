package master

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sync"
	"time"

	cubeletpb "github.com/cubesandbox/cube/api/cubelet/v1"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/master/catalog"
	"github.com/cubesandbox/cube/internal/master/tmplstore"
	"github.com/cubesandbox/cube/internal/sandboxid"
	"github.com/cubesandbox/cube/internal/template"
)

// Cluster-wide templates. A template imported through the master goes
// into its template store (package tmplstore) once; every node then pulls
// it from there over its own link to the master (NodeService.ReadBlob),
// checking each blob against its digest, and builds its template from the
// pulled image as from a local one. Nodes get the store's templates:
//
//   - at the import, every healthy target node at once (in parallel);
//   - at registration, each template the node does not report (a node
//     that joins later, or one that was down during the import);
//   - at a create, in the background, on each healthy node that lacks the
//     template asked for: the scheduler places the sandbox only on nodes
//     that hold it, so the sandbox never waits for a pull.

// storedTemplates caches the store's records: Templates runs on every
// create, and reads memory, not the disk.
type storedTemplates struct {
	store *tmplstore.Store
	mu    sync.Mutex
	// recs and rows are the catalog's template list (sharedtemplates.go).
	recs map[string]tmplstore.Record
	rows map[string]*catalog.ClusterTemplate
	// importing holds the IDs this replica is importing: their local
	// record exists before their catalog row.
	importing map[string]bool
	// gen counts this replica's own changes to recs: a catalog read that
	// began before one is not applied over it.
	gen    uint64
	shared *sharedTemplates
	// pulling holds the pulls in flight, by node/template.
	pulling map[string]*pullCall
	// failed is when a background pull last failed, by node/template:
	// creates do not retry it within pullRetry.
	failed map[string]time.Time
}

// pullRetry spaces background retries of a failed pull.
const pullRetry = 30 * time.Second

func newStoredTemplates(dir string) (*storedTemplates, error) {
	st := &storedTemplates{store: tmplstore.New(dir), recs: map[string]tmplstore.Record{}, rows: map[string]*catalog.ClusterTemplate{},
		importing: map[string]bool{}, pulling: map[string]*pullCall{}, failed: map[string]time.Time{}}
	if err := st.store.Clean(); err != nil {
		return nil, err
	}
	return st, nil
}

func (st *storedTemplates) list() []tmplstore.Record {
	st.mu.Lock()
	defer st.mu.Unlock()
	out := make([]tmplstore.Record, 0, len(st.recs))
	for _, r := range st.recs {
		out = append(out, r)
	}
	return out
}

func (st *storedTemplates) get(id string) (tmplstore.Record, bool) {
	st.mu.Lock()
	defer st.mu.Unlock()
	r, ok := st.recs[id]
	return r, ok
}

// delete removes template id from the catalog (and the object store),
// then this replica's copy; the other replicas drop theirs as they follow
// the catalog.
func (s *Service) deleteStored(ctx context.Context, id string) error {
	st := s.stored
	if err := s.unpublishTemplate(ctx, id); err != nil {
		return err
	}
	st.mu.Lock()
	delete(st.recs, id)
	delete(st.rows, id)
	st.gen++
	st.mu.Unlock()
	return st.store.Delete(id)
}

// pullCall is a pull in flight; others asking for the same one wait for
// it and share its result.
type pullCall struct {
	done chan struct{}
	err  error
}

// TemplateStore is the master's template store.
func (s *Service) TemplateStore() *tmplstore.Store { return s.stored.store }

// storeTemplate reads the image req names on the master and puts it in
// the store.
func (s *Service) storeTemplate(ctx context.Context, req TemplateImport) (tmplstore.Record, error) {
	if err := os.MkdirAll(s.stored.store.Dir(), 0o700); err != nil {
		return tmplstore.Record{}, fmt.Errorf("templates.store_dir: %w", err)
	}
	if err := s.stored.markShared(); err != nil {
		return tmplstore.Record{}, err
	}
	scratch, err := os.MkdirTemp(s.stored.store.Dir(), ".import-")
	if err != nil {
		return tmplstore.Record{}, fmt.Errorf("templates.store_dir: %w", err)
	}
	defer os.RemoveAll(scratch)
	var reg *template.Registry
	source := req.Source
	if req.ImageRef != "" {
		reg = &template.Registry{Ref: req.ImageRef, Username: req.Username, Password: req.Password, Token: req.Token, Insecure: req.Insecure}
		source = req.ImageRef
	}
	start := time.Now()
	img, err := template.Open(ctx, req.Source, reg, scratch)
	if err != nil {
		return tmplstore.Record{}, err
	}
	st := s.stored
	st.mu.Lock()
	if st.importing[req.ID] {
		st.mu.Unlock()
		return tmplstore.Record{}, fmt.Errorf("template %q is being imported already: %w", req.ID, errdefs.ErrAlreadyExists)
	}
	st.importing[req.ID] = true
	st.mu.Unlock()
	defer func() {
		st.mu.Lock()
		delete(st.importing, req.ID)
		st.mu.Unlock()
	}()
	_, before := st.store.Get(req.ID)
	rec, err := st.store.Put(img, tmplstore.Record{ID: req.ID, Source: source, Runtime: req.Runtime, Warm: req.Warm})
	if err != nil {
		return tmplstore.Record{}, err
	}
	if err := s.publishTemplate(ctx, rec); err != nil {
		// No half-imported template: the local copy goes unless it was
		// there before this import.
		if before != nil {
			if derr := st.store.Delete(req.ID); derr != nil {
				s.log.Warn("template: removing the unpublished copy", "template_id", req.ID, "err", derr)
			}
		}
		return tmplstore.Record{}, err
	}
	s.log.Info("template stored", "template_id", rec.ID, "digest", rec.Digest, "blob_bytes", rec.Blobs, "source", source, "took", time.Since(start))
	return rec, nil
}

// distribute has every target node pull rec, in parallel, and waits for
// them all. It logs how long the slowest took.
func (s *Service) distribute(ctx context.Context, rec tmplstore.Record, targets []string) error {
	start := time.Now()
	errs := make([]error, len(targets))
	var wg sync.WaitGroup
	for i, node := range targets {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = s.pullOn(ctx, node, rec)
		}()
	}
	wg.Wait()
	err := errors.Join(errs...)
	s.log.Info("template distributed", "template_id", rec.ID, "digest", rec.Digest, "nodes", len(targets),
		"blob_bytes", rec.Blobs, "took", time.Since(start), "ok", err == nil)
	return err
}

// pullOn asks node to import rec from the store and waits for it. A pull
// of the same template on the same node already in flight is waited for
// instead of starting another.
func (s *Service) pullOn(ctx context.Context, node string, rec tmplstore.Record) error {
	st, k := s.stored, node+"/"+rec.ID
	st.mu.Lock()
	if c := st.pulling[k]; c != nil {
		st.mu.Unlock()
		select {
		case <-c.done:
			return c.err
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	c := &pullCall{done: make(chan struct{})}
	st.pulling[k] = c
	st.mu.Unlock()
	defer func() {
		st.mu.Lock()
		delete(st.pulling, k)
		st.mu.Unlock()
		close(c.done)
	}()
	start := time.Now()
	c.err = s.importRequest(ctx, node, &cubeletpb.ImportTemplateRequest{
		TemplateId: rec.ID, Artifact: rec.Digest, Runtime: rec.Runtime, Warm: rec.Warm,
	})
	s.refreshTemplatesWithin(ctx, node, importRefreshTimeout)
	if c.err != nil {
		s.log.Warn("template pull failed", "node_id", node, "template_id", rec.ID, "digest", rec.Digest, "err", c.err)
		return c.err
	}
	s.log.Info("template pulled", "node_id", node, "template_id", rec.ID, "digest", rec.Digest, "took", time.Since(start))
	return nil
}

// syncNode pulls, in the background, every stored template node lacks
// (have: the templates its report lists).
func (s *Service) syncNode(node string, have map[string]bool) {
	for _, r := range s.stored.list() {
		if !have[r.ID] {
			s.pullBackground(node, r)
		}
	}
}

// pullBackground pulls r on node without waiting; a failure is logged, and
// the node's next registration, or the next create of r, tries again.
func (s *Service) pullBackground(node string, r tmplstore.Record) {
	st, k := s.stored, node+"/"+r.ID
	st.mu.Lock()
	busy := st.pulling[k] != nil || time.Since(st.failed[k]) < pullRetry
	st.mu.Unlock()
	if busy {
		return
	}
	s.goBackground(func(ctx context.Context) {
		err := s.pullOn(ctx, node, r)
		st.mu.Lock()
		if err != nil && ctx.Err() == nil {
			st.failed[k] = time.Now()
		} else {
			delete(st.failed, k)
		}
		st.mu.Unlock()
	})
}

// pullMissing starts a background pull of stored template id on every
// healthy node that lacks it (a create asked for it).
func (s *Service) pullMissing(id string) {
	r, ok := s.stored.get(id)
	if !ok {
		return
	}
	for _, n := range s.schedNodes() {
		if n.Healthy && !n.Templates[id] {
			s.pullBackground(n.ID, r)
		}
	}
}

// ImportUpload is ImportTemplate with the image read from body (an OCI or
// docker archive the caller sends) instead of a path on the master. The
// archive is spooled under the store's directory and removed afterwards.
func (s *Service) ImportUpload(ctx context.Context, req TemplateImport, body io.Reader) (Template, error) {
	if req.Source != "" || req.ImageRef != "" || req.SourceOnNodes {
		return Template{}, errdefs.FieldErrorf("source", "an upload carries its image: no source, image_ref or source_on_nodes")
	}
	if err := sandboxid.Validate("template", req.ID); err != nil {
		return Template{}, err
	}
	if err := os.MkdirAll(s.stored.store.Dir(), 0o700); err != nil {
		return Template{}, fmt.Errorf("templates.store_dir: %w", err)
	}
	scratch, err := os.MkdirTemp(s.stored.store.Dir(), ".import-")
	if err != nil {
		return Template{}, fmt.Errorf("templates.store_dir: %w", err)
	}
	defer os.RemoveAll(scratch)
	req.Source = filepath.Join(scratch, "upload.tar")
	f, err := os.OpenFile(req.Source, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return Template{}, err
	}
	n, cerr := io.Copy(f, body)
	if err := errors.Join(cerr, f.Close()); err != nil {
		return Template{}, fmt.Errorf("template upload: %w", err)
	}
	s.log.Info("template uploaded", "template_id", req.ID, "bytes", n)
	return s.ImportTemplate(ctx, req)
}
