package master

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/master/catalog"
	"github.com/cubesandbox/cube/internal/master/tmplstore"
	"github.com/cubesandbox/cube/internal/objstore"
	"github.com/cubesandbox/cube/internal/template"
)

// Templates shared by the replicas of a catalog. Which templates the
// store holds is the catalog's cluster_templates table: every replica
// lists the same ones. Each replica keeps images in its own store
// directory (package tmplstore); with [templates.object_store] set, an
// import also exports the image there (as an OCI image layout, in the
// object store's "templates" space), and a replica asked by a node for a
// blob it lacks fetches that template's image from the object store into
// its directory first, checking every blob against its digest. A replica
// drops its copy of a template the catalog no longer lists.

// templateFollow is how often a replica reads the catalog's template
// list (an import or delete through another replica shows up within it).
const templateFollow = 2 * time.Second

// objectGrace keeps chunks of an export still uploading when a delete
// collects the object store's unreferenced chunks.
const objectGrace = 10 * time.Minute

// sharedTemplates is what storedTemplates needs to share its templates.
type sharedTemplates struct {
	cat     *catalog.Catalog
	obj     *objstore.Store // templates space; nil without an object store
	replica string
	// fetching holds the object-store fetches in flight, by template.
	fetchMu  sync.Mutex
	fetching map[string]*pullCall
}

// objectID names a template's image in the object store: the ID and its
// digest, so two replicas importing one ID with different images at once
// never write over each other's export.
func objectID(r tmplstore.Record) string {
	h := strings.TrimPrefix(r.Digest, "sha256:")
	return r.ID + "." + h[:min(16, len(h))]
}

func fromCatalog(t *catalog.ClusterTemplate) tmplstore.Record {
	return tmplstore.Record{ID: t.ID, Digest: t.Digest, Blobs: t.BlobBytes, Source: t.Source, Runtime: t.Runtime, Warm: t.Warm, CreatedAt: t.CreatedAt}
}

// shareTemplates attaches the catalog (and the object store, when
// configured) to the store: records of the local store the catalog lacks
// (a store filled before the catalog listed templates) are published,
// the catalog's list is loaded, and a loop follows it.
func (s *Service) shareTemplates(ctx context.Context, replica string) error {
	st := s.stored
	st.shared = &sharedTemplates{cat: s.cat, replica: replica, fetching: map[string]*pullCall{}}
	if oc := s.cfg.Templates.ObjectStore; oc.Enabled() {
		obj, err := objstore.Open(oc)
		if err != nil {
			return fmt.Errorf("templates.object_store: %w", err)
		}
		st.shared.obj = obj.In(objstore.Templates)
	}
	// Local records the catalog lacks are published once, the first time
	// this store meets a catalog (a store filled by a master from before
	// the catalog listed templates). After that a local record the catalog
	// lacks was deleted through another replica while this one was down,
	// and syncTemplates drops it: publishing it would bring it back.
	marker := filepath.Join(st.store.Dir(), sharedMarker)
	local, err := st.store.List()
	if err != nil {
		return err
	}
	if _, err := os.Stat(marker); err == nil {
		local = nil
	}
	for _, r := range local {
		if _, err := s.cat.GetClusterTemplate(ctx, r.ID); errdefs.IsNotFound(err) {
			// The catalog wins over a local record with another image
			// (syncTemplates drops the local copy).
			if err := s.publishTemplate(ctx, r); err != nil && !errors.Is(err, errdefs.ErrAlreadyExists) {
				return fmt.Errorf("template %s of the local store: %w", r.ID, err)
			}
		} else if err != nil {
			return err
		}
	}
	if err := st.markShared(); err != nil {
		return err
	}
	if err := s.syncTemplates(ctx); err != nil {
		return err
	}
	s.goBackground(func(ctx context.Context) {
		t := time.NewTicker(templateFollow)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
			if err := s.syncTemplates(ctx); err != nil && ctx.Err() == nil {
				s.log.Warn("templates: reading the catalog's list", "err", err)
			}
		}
	})
	return nil
}

// sharedMarker, in the store's directory, says its records have been
// published to a catalog.
const sharedMarker = ".shared"

// markShared writes the marker into the store's directory when there is
// one (a master that never stored a template leaves no directory).
func (st *storedTemplates) markShared() error {
	if _, err := os.Stat(st.store.Dir()); errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err := os.WriteFile(filepath.Join(st.store.Dir(), sharedMarker), nil, 0o600); err != nil {
		return fmt.Errorf("templates.store_dir: %w", err)
	}
	return nil
}

// syncTemplates loads the catalog's template list and drops local copies
// of templates it no longer lists (or lists with another image).
func (s *Service) syncTemplates(ctx context.Context) error {
	st := s.stored
	st.mu.Lock()
	gen := st.gen
	st.mu.Unlock()
	rows, err := s.cat.ListClusterTemplates(ctx)
	if err != nil {
		return err
	}
	recs := make(map[string]tmplstore.Record, len(rows))
	objects := make(map[string]*catalog.ClusterTemplate, len(rows))
	for _, r := range rows {
		recs[r.ID] = fromCatalog(r)
		objects[r.ID] = r
	}
	st.mu.Lock()
	if st.gen != gen {
		// This replica published or deleted a template since the read:
		// the list read is older than its own view; the next sync reads
		// again.
		st.mu.Unlock()
		return nil
	}
	st.recs, st.rows = recs, objects
	st.mu.Unlock()
	local, err := st.store.List()
	if err != nil {
		return err
	}
	for _, l := range local {
		if r, ok := recs[l.ID]; ok && r.Digest == l.Digest {
			continue
		}
		// Not in the catalog: deleted through another replica, or an
		// import of this replica whose row is not written yet (it holds
		// the row's ID in importing until then).
		st.mu.Lock()
		busy := st.importing[l.ID]
		st.mu.Unlock()
		if busy {
			continue
		}
		if err := st.store.Delete(l.ID); err != nil {
			return err
		}
		s.log.Info("template copy dropped: the catalog no longer lists it", "template_id", l.ID, "digest", l.Digest)
	}
	return nil
}

// publishTemplate exports r's image to the object store (when there is
// one) and then records it in the catalog: a row means its image can be
// had. An ID the catalog holds with another image is AlreadyExists, and
// this replica's export of it is removed.
func (s *Service) publishTemplate(ctx context.Context, r tmplstore.Record) error {
	sh := s.stored.shared
	row := &catalog.ClusterTemplate{ID: r.ID, Digest: r.Digest, BlobBytes: r.Blobs, Source: r.Source, Runtime: r.Runtime,
		Warm: r.Warm, Replica: sh.replica, CreatedAt: r.CreatedAt}
	if sh.obj != nil {
		start := time.Now()
		dir, err := os.MkdirTemp(s.stored.store.Dir(), ".import-")
		if err != nil {
			return fmt.Errorf("templates.store_dir: %w", err)
		}
		defer os.RemoveAll(dir)
		if err := s.stored.store.Layout(r.ID, dir); err != nil {
			return err
		}
		_, stats, err := sh.obj.Export(ctx, objectID(r), dir, nil)
		if err != nil {
			return fmt.Errorf("template %s: export to the object store: %w", r.ID, err)
		}
		row.Object = objectID(r)
		s.log.Info("template exported", "template_id", r.ID, "object", row.Object, "sent", stats.Sent, "stored", stats.StoredBytes, "took", time.Since(start))
	}
	if err := s.cat.PutClusterTemplate(ctx, row); err != nil {
		// No row names this export (the ID is another image's, or the
		// catalog failed): it goes, unless a row of another replica's
		// import of the same image names the same object.
		if row.Object != "" {
			dctx := context.WithoutCancel(ctx)
			if cur, gerr := s.cat.GetClusterTemplate(dctx, r.ID); gerr != nil || cur.Object != row.Object {
				if derr := sh.obj.Delete(dctx, row.Object, objectGrace); derr != nil {
					s.log.Warn("template: removing an export no row names", "template_id", r.ID, "object", row.Object, "err", derr)
				}
			}
		}
		return err
	}
	s.stored.mu.Lock()
	s.stored.recs[r.ID], s.stored.rows[r.ID] = r, row
	s.stored.gen++
	s.stored.mu.Unlock()
	return nil
}

// unpublishTemplate removes id from the catalog, then its image from the
// object store.
func (s *Service) unpublishTemplate(ctx context.Context, id string) error {
	st := s.stored
	st.mu.Lock()
	row := st.rows[id]
	st.mu.Unlock()
	if err := s.cat.DeleteClusterTemplate(ctx, id); err != nil {
		return err
	}
	if row != nil && row.Object != "" && st.shared.obj != nil {
		if err := st.shared.obj.Delete(ctx, row.Object, objectGrace); err != nil && !errdefs.IsNotFound(err) {
			s.log.Warn("template: removing its image from the object store", "template_id", id, "object", row.Object, "err", err)
		}
	}
	return nil
}

// ReadBlob serves part of a store blob to a node (NodeService.ReadBlob).
// A blob this replica lacks is fetched first, with its template, from the
// object store.
func (s *Service) ReadBlob(ctx context.Context, digest string, off int64, p []byte) (int, int64, error) {
	n, size, err := s.stored.store.ReadBlob(digest, off, p)
	if !errdefs.IsNotFound(err) || s.stored.shared == nil {
		return n, size, err
	}
	if ferr := s.fetchFor(ctx, digest); ferr != nil {
		return 0, 0, ferr
	}
	return s.stored.store.ReadBlob(digest, off, p)
}

// fetchFor fetches the template whose manifest is digest, or, when no
// template's manifest is, every template this replica lacks (a node reads
// the manifest first, so the second case is a node that skipped it).
func (s *Service) fetchFor(ctx context.Context, digest string) error {
	if err := s.syncTemplates(ctx); err != nil {
		return err
	}
	var want []*catalog.ClusterTemplate
	s.stored.mu.Lock()
	for _, r := range s.stored.rows {
		if r.Digest == digest {
			want = []*catalog.ClusterTemplate{r}
			break
		}
		if _, err := s.stored.store.Get(r.ID); errdefs.IsNotFound(err) {
			want = append(want, r)
		}
	}
	s.stored.mu.Unlock()
	if len(want) == 0 {
		return fmt.Errorf("blob %s is in no template of the cluster's store: %w", digest, errdefs.ErrNotFound)
	}
	var errs []error
	for _, r := range want {
		errs = append(errs, s.fetchTemplate(ctx, r))
	}
	return errors.Join(errs...)
}

// fetchTemplate brings r's image from the object store into this
// replica's store. Fetches of one template share one download.
func (s *Service) fetchTemplate(ctx context.Context, r *catalog.ClusterTemplate) error {
	sh := s.stored.shared
	if old, err := s.stored.store.Get(r.ID); err == nil && old.Digest == r.Digest {
		return nil
	}
	if r.Object == "" || sh.obj == nil {
		return fmt.Errorf("template %s was imported through replica %q and is not in an object store (set [templates.object_store] on every replica): only that replica serves its image: %w",
			r.ID, r.Replica, errdefs.ErrFailedPrecondition)
	}
	sh.fetchMu.Lock()
	if c := sh.fetching[r.ID]; c != nil {
		sh.fetchMu.Unlock()
		select {
		case <-c.done:
			return c.err
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	c := &pullCall{done: make(chan struct{})}
	sh.fetching[r.ID] = c
	sh.fetchMu.Unlock()
	defer func() {
		sh.fetchMu.Lock()
		delete(sh.fetching, r.ID)
		sh.fetchMu.Unlock()
		close(c.done)
	}()
	// A fetch a node waits on, not tied to that one node's call: the
	// others waiting on it must not fail because the first gave up.
	c.err = s.fetchImage(context.WithoutCancel(ctx), r)
	return c.err
}

func (s *Service) fetchImage(ctx context.Context, r *catalog.ClusterTemplate) error {
	start := time.Now()
	if err := os.MkdirAll(s.stored.store.Dir(), 0o700); err != nil {
		return fmt.Errorf("templates.store_dir: %w", err)
	}
	if err := s.stored.markShared(); err != nil {
		return err
	}
	scratch, err := os.MkdirTemp(s.stored.store.Dir(), ".import-")
	if err != nil {
		return fmt.Errorf("templates.store_dir: %w", err)
	}
	defer os.RemoveAll(scratch)
	dir := filepath.Join(scratch, "image")
	_, stats, err := s.stored.shared.obj.Import(ctx, r.Object, dir)
	if err != nil {
		return fmt.Errorf("template %s: fetch from the object store: %w", r.ID, err)
	}
	img, err := template.Open(ctx, dir, nil, scratch)
	if err != nil {
		return fmt.Errorf("template %s: image from the object store: %w", r.ID, err)
	}
	if d, err := img.Digest(); err != nil || d.String() != r.Digest {
		return fmt.Errorf("template %s: the object store holds image %v, the catalog names %s: %w", r.ID, d, r.Digest, objstore.ErrCorrupt)
	}
	if _, err := s.stored.store.Put(img, fromCatalog(r)); err != nil {
		return fmt.Errorf("template %s: %w", r.ID, err)
	}
	s.log.Info("template fetched from the object store", "template_id", r.ID, "object", r.Object, "received", stats.Received, "took", time.Since(start))
	return nil
}
