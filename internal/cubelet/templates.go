package cubelet

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/sandbox"
	"github.com/cubesandbox/cube/internal/template"
)

// ImportTemplate turns a local OCI image (layout directory or OCI/docker
// tar) into a template: an ext4 image with cube-agent injected. progress
// (may be nil) sees every phase. The record is written only once the image
// is complete, and a failed import removes what it wrote.
func (s *Service) ImportTemplate(ctx context.Context, id, source string, progress func(template.Progress)) (*sandbox.Template, error) {
	if err := sandbox.ValidateID("template", id); err != nil {
		return nil, &FieldError{Field: "template_id", Msg: err.Error()}
	}
	if source == "" {
		return nil, fieldErr("source", "required")
	}
	if _, err := os.Stat(source); err != nil {
		return nil, fieldErr("source", "%v", err)
	}
	if _, err := os.Stat(s.cfg.Storage.AgentBinary); err != nil {
		return nil, fmt.Errorf("cube-agent binary (storage.agent_binary): %v: %w", err, errdefs.ErrFailedPrecondition)
	}
	s.tmplMu.Lock()
	if s.importing[id] {
		s.tmplMu.Unlock()
		return nil, fmt.Errorf("template %q is being imported: %w", id, errdefs.ErrAlreadyExists)
	}
	if _, err := s.store.GetTemplate(id); err == nil {
		s.tmplMu.Unlock()
		return nil, fmt.Errorf("template %q: %w", id, errdefs.ErrAlreadyExists)
	}
	s.importing[id] = true
	s.tmplMu.Unlock()
	defer func() {
		s.tmplMu.Lock()
		delete(s.importing, id)
		s.tmplMu.Unlock()
	}()

	out := s.node.pool.TemplateImagePath(id)
	dir := filepath.Dir(out)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	work, err := os.MkdirTemp(mkdirAll(s.scratchDir()), "import-"+id+"-")
	if err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	defer os.RemoveAll(work)
	if progress == nil {
		progress = func(template.Progress) {}
	}
	meta, err := template.Import(ctx, template.ImportRequest{
		Source:      source,
		AgentBinary: s.cfg.Storage.AgentBinary,
		HeadroomMiB: s.cfg.Storage.TemplateHeadroomMiB,
		Output:      out,
		WorkDir:     work,
	}, progress)
	if err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	t := &sandbox.Template{
		ID: id, Digest: meta.Digest, Source: source, ImagePath: out, SizeBytes: meta.SizeBytes,
		Entrypoint: meta.Entrypoint, Cmd: meta.Cmd, Env: meta.Env, WorkingDir: meta.WorkingDir,
		User: meta.User, CreatedAt: time.Now().UTC(),
	}
	if err := s.store.CreateTemplate(t); err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	s.log.Info("template imported", "template_id", id, "digest", meta.Digest, "bytes", meta.SizeBytes)
	return t, nil
}

func mkdirAll(dir string) string {
	_ = os.MkdirAll(dir, 0o700)
	return dir
}

// GetTemplate returns one template.
func (s *Service) GetTemplate(_ context.Context, id string) (*sandbox.Template, error) {
	if err := sandbox.ValidateID("template", id); err != nil {
		return nil, &FieldError{Field: "template_id", Msg: err.Error()}
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
	// Record first: a crash after it leaves only files, which reconcile
	// sweeps; the other order could leave a record without its image.
	if err := s.store.DeleteTemplate(id); err != nil {
		return err
	}
	return os.RemoveAll(filepath.Dir(t.ImagePath))
}
