package cubelet

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/failpoint"
	"github.com/cubesandbox/cube/internal/sandbox"
	"github.com/cubesandbox/cube/internal/sandboxid"
	"github.com/cubesandbox/cube/internal/template"
)

// TemplateImport asks for a template from exactly one of a local image
// (Source) or a registry image (ImageRef).
type TemplateImport struct {
	TemplateID string
	Source     string // OCI image layout dir, or OCI/docker-archive tar, on this node
	ImageRef   string // host/repo:tag or host/repo@sha256:<hex>
	// Artifact is the manifest digest of an image in the master's
	// template store, pulled over the node's link to the master.
	Artifact string
	// Registry credentials (ImageRef only); none = [registry] auth_file,
	// else anonymous. See template.Registry for how they combine.
	Username, Password, Token string
	Insecure                  bool // plain HTTP to the registry
	// Runtime creates from the template run on when they name none
	// ("" = the node default).
	Runtime string
	// Warm: warm the template once imported (WarmTemplate).
	Warm bool
}

// Failpoints of template import (tests drive its cleanup with them).
const (
	FailpointTemplateBuilt  = "template/import.image/after"  // image written, no record yet
	FailpointTemplateReused = "template/import.reuse/after"  // image cloned, no record yet
	FailpointTemplateRecord = "template/import.record/after" // record written (the import then fails)
	FailpointTemplatePull   = "template/pull/before"         // an image from the master's store about to be pulled
)

// ImportTemplate imports a local image as template id (see
// ImportTemplateFrom).
func (s *Service) ImportTemplate(ctx context.Context, id, source string, progress func(template.Progress)) (*sandbox.Template, error) {
	return s.ImportTemplateFrom(ctx, TemplateImport{TemplateID: id, Source: source}, progress)
}

// ImportTemplateFrom turns an OCI image into a template: an ext4 image
// with cube-agent injected. progress (may be nil) sees every phase.
//
// Imports are idempotent by digest: importing an existing ID again with
// the image it was built from returns the existing template; with another
// image it is ErrAlreadyExists. A new ID whose image digest (and node
// agent) matches an existing template is not extracted again: its image is
// a FICLONE of that template's (phase "reuse"), sharing every block until
// a sandbox writes.
//
// The record is written only once the image is complete, and a failed
// import removes what it wrote.
func (s *Service) ImportTemplateFrom(ctx context.Context, req TemplateImport, progress func(template.Progress)) (_ *sandbox.Template, err error) {
	defer func() { err = s.noSpace(err) }()
	id := req.TemplateID
	src, err := s.importSource(req)
	if err != nil {
		return nil, err
	}
	if req.Runtime != "" {
		if _, err := s.node.Driver(req.Runtime); err != nil {
			return nil, &errdefs.FieldError{Field: "runtime", Msg: err.Error()}
		}
	}
	agentDigest, err := fileDigest(s.cfg.Storage.AgentBinary)
	if err != nil {
		return nil, fmt.Errorf("cube-agent binary (storage.agent_binary): %v: %w", err, errdefs.ErrFailedPrecondition)
	}
	if progress == nil {
		progress = func(template.Progress) {}
	}
	s.tmplMu.Lock()
	if s.importing[id] {
		s.tmplMu.Unlock()
		return nil, fmt.Errorf("template %q is being imported: %w", id, errdefs.ErrAlreadyExists)
	}
	s.importing[id] = true
	s.tmplMu.Unlock()
	var work string
	defer func() {
		s.tmplMu.Lock()
		delete(s.importing, id)
		s.tmplMu.Unlock()
		// The scratch directory is this import's alone: it goes after
		// the ID is free again, so that a delete of the template just
		// recorded is not refused while ~100 MB of pulled layers are
		// removed.
		if work != "" {
			_ = os.RemoveAll(work)
		}
	}()

	out := s.node.Pool.TemplateImagePath(id)
	if err := os.MkdirAll(s.scratchDir(), 0o700); err != nil {
		return nil, err
	}
	work, err = os.MkdirTemp(s.scratchDir(), "import-"+id+"-")
	if err != nil {
		return nil, err
	}
	src.AgentBinary, src.HeadroomMiB, src.Output, src.WorkDir = s.cfg.Storage.AgentBinary, s.cfg.Storage.TemplateHeadroomMiB, out, work
	if req.Artifact != "" {
		if t, err := s.store.GetTemplate(id); err == nil && t.Digest == req.Artifact && t.AgentDigest == agentDigest {
			progress(template.Progress{Phase: "done"})
			return t, nil // already pulled: nothing to fetch
		}
		if src.Source, err = s.pullArtifact(ctx, req.Artifact, work, progress); err != nil {
			return nil, err
		}
	}

	progress(template.Progress{Phase: "resolve"})
	img, err := template.Resolve(ctx, src)
	if err != nil {
		return nil, err
	}
	defer img.Close()
	if t, err := s.store.GetTemplate(id); err == nil {
		if t.Digest != img.Meta.Digest {
			return nil, fmt.Errorf("template %q exists with image %s; %s is %s: %w", id, t.Digest, img.Source, img.Meta.Digest, errdefs.ErrAlreadyExists)
		}
		if t.AgentDigest != agentDigest {
			return s.refreshAgent(ctx, t, img, agentDigest, progress)
		}
		progress(template.Progress{Phase: "done"})
		return t, nil
	} else if !errdefs.IsNotFound(err) {
		return nil, err
	}

	// No record, and we hold the ID: whatever is in the directory is
	// left over from an import that died.
	dir := filepath.Dir(out)
	if err := os.RemoveAll(dir); err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			_ = os.RemoveAll(dir)
		}
	}()
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	meta, reused, err := s.buildOrReuse(ctx, img, out, agentDigest, progress)
	if err != nil {
		return nil, err
	}
	t := &sandbox.Template{
		ID: id, Digest: meta.Digest, Source: img.Source, ImagePath: out, SizeBytes: meta.SizeBytes,
		Entrypoint: meta.Entrypoint, Cmd: meta.Cmd, Env: meta.Env, WorkingDir: meta.WorkingDir, DefaultWorkdir: meta.DefaultWorkdir,
		User: meta.User, CreatedAt: time.Now().UTC(), AgentDigest: agentDigest, Runtime: req.Runtime,
		StartCmd: meta.StartCmd, ReadyCmd: meta.ReadyCmd,
	}
	if req.Artifact != "" {
		t.Source = "cubemaster:" + req.Artifact // the pull's scratch layout is gone
	}
	if err := s.store.CreateTemplate(t); err != nil {
		return nil, err
	}
	if err := failpoint.Eval(ctx, FailpointTemplateRecord); err != nil {
		// As if the caller gave up right after the record: undo it.
		return nil, errors.Join(err, s.store.DeleteTemplate(id))
	}
	s.log.Info("template imported", "template_id", id, "source", img.Source, "digest", meta.Digest, "bytes", meta.SizeBytes, "reused_from", reused)
	return t, nil
}

// refreshAgent rebuilds template t's image with the node's current agent
// when the same image is imported again after cube-agent changed (an
// upgrade): containers bind the node's agent over the template's copy, but
// a VM boots the copy in its image, so an old one would start VMs with an
// agent that does not know what cubelet asks of it. The image is replaced
// atomically (sandboxes already made keep their own disks), the pool's
// ready disks of the old image are dropped, and the record says the new
// agent. A warm snapshot stays: its memory and disk agree with each other.
func (s *Service) refreshAgent(ctx context.Context, t *sandbox.Template, img *template.Resolved, agentDigest string, progress func(template.Progress)) (*sandbox.Template, error) {
	progress(template.Progress{Phase: "refresh-agent"})
	meta, err := img.Build(ctx, progress)
	if err != nil {
		return nil, fmt.Errorf("rebuild template %s with the node's agent: %w", t.ID, err)
	}
	t.AgentDigest, t.SizeBytes, t.RebuiltAt = agentDigest, meta.SizeBytes, time.Now().UTC()
	if err := s.store.PutTemplate(t); err != nil {
		return nil, err
	}
	s.drainTemplateDisks(t.ID)
	s.log.Info("template image rebuilt with the node's agent", "template_id", t.ID, "agent_digest", agentDigest)
	return t, nil
}

// importSource validates the request into a template.ImportRequest
// (paths and limits are filled in by the caller).
func (s *Service) importSource(req TemplateImport) (template.ImportRequest, error) {
	var r template.ImportRequest
	if err := sandboxid.Validate("template", req.TemplateID); err != nil {
		return r, &errdefs.FieldError{Field: "template_id", Msg: err.Error()}
	}
	switch {
	case req.Artifact != "":
		if req.Source != "" || req.ImageRef != "" || req.Username != "" || req.Password != "" || req.Token != "" || req.Insecure {
			return r, errdefs.FieldErrorf("artifact", "an image from the master's store takes no source, image_ref or registry options")
		}
	case req.Source == "" && req.ImageRef == "":
		return r, errdefs.FieldErrorf("source", "a local source or an image_ref is required")
	case req.Source != "" && req.ImageRef != "":
		return r, errdefs.FieldErrorf("image_ref", "give a local source or an image_ref, not both")
	case req.Source != "":
		if req.Username != "" || req.Password != "" || req.Token != "" || req.Insecure {
			return r, errdefs.FieldErrorf("auth", "registry credentials and insecure apply to image_ref only")
		}
		if _, err := os.Stat(req.Source); err != nil {
			return r, errdefs.FieldErrorf("source", "%v", err)
		}
		r.Source = req.Source
	default:
		r.Registry = &template.Registry{
			Ref: req.ImageRef, Username: req.Username, Password: req.Password, Token: req.Token,
			Insecure: req.Insecure, AuthFile: s.cfg.Registry.AuthFile,
		}
	}
	return r, nil
}

// pullArtifact pulls an image of the master's template store into an OCI
// layout under work and returns the layout's path.
func (s *Service) pullArtifact(ctx context.Context, digest, work string, progress func(template.Progress)) (string, error) {
	if err := failpoint.Eval(ctx, FailpointTemplatePull); err != nil {
		return "", err
	}
	progress(template.Progress{Phase: "pull"})
	dir := filepath.Join(work, "artifact")
	start := time.Now()
	n, err := s.hb.PullImage(ctx, s.cfg.Node.ID, digest, dir)
	if err != nil {
		s.log.Warn("template pull from the master refused", "artifact", digest, "err", err)
		return "", fmt.Errorf("pull %s from the master's template store: %w", digest, err)
	}
	s.log.Info("template pulled from the master", "artifact", digest, "bytes", n, "took", time.Since(start))
	return dir, nil
}

// buildOrReuse clones an existing template built from the same image and
// agent when there is one, and builds from the layers otherwise. It
// returns the ID of the template reused, if any.
func (s *Service) buildOrReuse(ctx context.Context, img *template.Resolved, out, agentDigest string, progress func(template.Progress)) (template.Meta, string, error) {
	if from := s.reusable(img.Meta.Digest, agentDigest); from != nil {
		progress(template.Progress{Phase: "reuse"})
		err := s.node.Pool.Clone(ctx, from.ImagePath, out)
		if err == nil {
			if err := failpoint.Eval(ctx, FailpointTemplateReused); err != nil {
				return template.Meta{}, "", err
			}
			meta := img.Meta
			meta.SizeBytes = from.SizeBytes
			progress(template.Progress{Phase: "done", Layer: img.Layers, Layers: img.Layers})
			return meta, from.ID, nil
		}
		if errdefs.IsCanceled(err) {
			return template.Meta{}, "", err
		}
		// Deleted under us, most likely: build it after all.
		s.log.Warn("template reuse failed; extracting the image", "from", from.ID, "err", err)
	}
	meta, err := img.Build(ctx, progress)
	if err != nil {
		return template.Meta{}, "", err
	}
	if err := failpoint.Eval(ctx, FailpointTemplateBuilt); err != nil {
		return template.Meta{}, "", err
	}
	return meta, "", nil
}

// reusable returns a template built from digest with the same agent whose
// image is present, or nil.
func (s *Service) reusable(digest, agentDigest string) *sandbox.Template {
	tmpls, err := s.store.ListTemplates()
	if err != nil {
		return nil
	}
	for _, t := range tmpls {
		if t.Digest != digest || t.AgentDigest != agentDigest {
			continue
		}
		if st, err := os.Stat(t.ImagePath); err == nil && st.Mode().IsRegular() {
			return t
		}
	}
	return nil
}

func fileDigest(path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return "", err
	}
	return "sha256:" + hex.EncodeToString(h.Sum(nil)), nil
}

// GetTemplate returns one template.
func (s *Service) GetTemplate(_ context.Context, id string) (*sandbox.Template, error) {
	if err := sandboxid.Validate("template", id); err != nil {
		return nil, &errdefs.FieldError{Field: "template_id", Msg: err.Error()}
	}
	return s.store.GetTemplate(id)
}

// ListTemplates returns every template.
func (s *Service) ListTemplates(context.Context) ([]*sandbox.Template, error) {
	return s.store.ListTemplates()
}

// DeleteTemplate removes a template that no sandbox uses.
func (s *Service) DeleteTemplate(ctx context.Context, id string) error {
	t, err := s.GetTemplate(ctx, id)
	if err != nil {
		return err
	}
	s.tmplMu.Lock()
	defer s.tmplMu.Unlock()
	if s.importing[id] {
		return fmt.Errorf("template %q is being imported or warmed: %w", id, errdefs.ErrFailedPrecondition)
	}
	recs, _ := s.List(ctx, ListFilter{})
	users := 0
	for _, r := range recs {
		if r.TemplateID == id {
			users++
		}
	}
	if users > 0 {
		return fmt.Errorf("template %q is used by %d sandbox(es): %w", id, users, errdefs.ErrFailedPrecondition)
	}
	// Its warm pool goes first, and stays empty while the delete runs
	// (and for good once the template is gone).
	defer s.undrainPool(id)
	if err := s.drainPool(ctx, id); err != nil {
		return fmt.Errorf("template %q: drain its warm pool: %w", id, err)
	}
	// Snapshots keep their template: clones boot with its metadata.
	if n, err := s.templateSnapshots(id); err != nil || n > 0 {
		if err != nil {
			return err
		}
		return fmt.Errorf("template %q is referenced by %d snapshot(s); delete them first: %w", id, n, errdefs.ErrFailedPrecondition)
	}
	if t.WarmSnapshotID != "" {
		s.dropWarmSnapshot(t.WarmSnapshotID, "deleted with its template")
	}
	// Record first: a crash after it leaves only files, which reconcile
	// sweeps; the other order could leave a record without its image.
	if err := s.store.DeleteTemplate(id); err != nil {
		return err
	}
	s.drainTemplateDisks(id)
	return os.RemoveAll(filepath.Dir(t.ImagePath))
}
