package master

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sort"
	"time"

	"google.golang.org/protobuf/proto"

	cubeletpb "github.com/cubesandbox/cube/api/cubelet/v1"
	masterpb "github.com/cubesandbox/cube/api/master/v1"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/sandboxid"
)

// Template is a template across the cluster: the nodes holding it.
type Template struct {
	ID        string
	Digest    string
	SizeBytes int64
	CreatedAt time.Time
	Nodes     []string
	Aliases   []string
	// Runtimes is the runtime each node's copy is for, by node ID (""
	// there: that node's default). Copies are imported per node, so they
	// may differ.
	Runtimes map[string]string
	// WarmNodes hold a warm memory snapshot of it: creates placed there
	// restore instead of booting.
	WarmNodes []string
	// Stored: the image is in the master's template store, and every
	// node gets it (distribute.go).
	Stored bool
}

// Templates lists every template some node holds, from the nodes' reports.
func (s *Service) Templates() []Template {
	byID := map[string]*Template{}
	s.reg.mu.Lock()
	for id, ns := range s.reg.nodes {
		for _, t := range ns.report.Templates {
			tt := byID[t.Id]
			if tt == nil {
				tt = &Template{ID: t.Id, Digest: t.Digest, SizeBytes: t.SizeBytes, CreatedAt: t.CreatedAt.AsTime(), Runtimes: map[string]string{}}
				byID[t.Id] = tt
			}
			tt.Nodes = append(tt.Nodes, id)
			tt.Runtimes[id] = t.Runtime
			if t.Warm {
				tt.WarmNodes = append(tt.WarmNodes, id)
			}
		}
	}
	s.reg.mu.Unlock()
	for _, r := range s.stored.list() {
		tt := byID[r.ID]
		if tt == nil {
			tt = &Template{ID: r.ID, Digest: r.Digest, CreatedAt: r.CreatedAt, Runtimes: map[string]string{}}
			byID[r.ID] = tt
		}
		tt.Stored = true
	}
	for alias, id := range s.cfg.Templates.Aliases {
		if t := byID[id]; t != nil && alias != id {
			t.Aliases = append(t.Aliases, alias)
		}
	}
	out := make([]Template, 0, len(byID))
	for _, t := range byID {
		sort.Strings(t.Nodes)
		sort.Strings(t.Aliases)
		sort.Strings(t.WarmNodes)
		out = append(out, *t)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out
}

// GetTemplate returns one template by ID or alias.
func (s *Service) GetTemplate(_ context.Context, name string) (Template, error) {
	id := name
	if a, ok := s.cfg.Templates.Aliases[name]; ok {
		id = a
	}
	for _, t := range s.Templates() {
		if t.ID == id {
			return t, nil
		}
	}
	return Template{}, fmt.Errorf("template %q: %w", name, errdefs.ErrNotFound)
}

// templateSizeMiB is a template's image size, rounded up.
func (s *Service) templateSizeMiB(id string) int64 {
	for _, t := range s.Templates() {
		if t.ID == id {
			return (t.SizeBytes + 1<<20 - 1) >> 20
		}
	}
	return 0
}

// DeleteFromAPI is DeleteTemplate for the E2B API, where the same call
// deletes snapshots (any key of the snapshot's team: ctx's team scopes the
// lookup) and templates (an admin key only: every team's sandboxes use
// them).
func (s *Service) DeleteFromAPI(ctx context.Context, name string, admin bool) ([]string, error) {
	if _, err := s.cat.GetTeamSnapshot(ctx, TeamOf(ctx), name); err == nil {
		return nil, s.DeleteSnapshot(ctx, name)
	}
	if !admin {
		if _, err := s.GetTemplate(ctx, name); err != nil {
			return nil, err
		}
		return nil, fmt.Errorf("deleting template %q needs an admin API key (cubecli apikey create --admin): %w", name, errdefs.ErrPermissionDenied)
	}
	return s.DeleteTemplate(ctx, name)
}

// DeleteTemplate deletes a snapshot with this ID, else the template from
// every node that holds it (E2B deletes snapshots through the template
// endpoint). A template in use on a node is FailedPrecondition.
func (s *Service) DeleteTemplate(ctx context.Context, name string) ([]string, error) {
	if _, err := s.cat.GetTeamSnapshot(ctx, TeamOf(ctx), name); err == nil {
		return nil, s.DeleteSnapshot(ctx, name)
	}
	t, err := s.GetTemplate(ctx, name)
	if err != nil {
		return nil, err
	}
	// The store first: a node that registers during the delete must not
	// be handed the template again.
	if t.Stored {
		if err := s.deleteStored(ctx, t.ID); err != nil {
			return nil, err
		}
	}
	var done []string
	var errs []error
	for _, node := range t.Nodes {
		c, err := s.client(node)
		if err == nil {
			_, err = c.DeleteTemplate(ctx, &cubeletpb.DeleteTemplateRequest{TemplateId: t.ID})
			err = fromGRPC(node, err)
		}
		if err != nil && !errdefs.IsNotFound(err) {
			errs = append(errs, err)
			continue
		}
		done = append(done, node)
		s.refreshTemplatesWithin(ctx, node, importRefreshTimeout)
	}
	if len(errs) > 0 {
		return done, errors.Join(errs...)
	}
	return done, nil
}

// TemplateImport asks for a template to be imported.
type TemplateImport struct {
	ID string
	// Source is an OCI layout or image tar on the master (SourceOnNodes:
	// on each target node).
	Source string
	// ImageRef is a registry image the master pulls instead of Source.
	ImageRef                  string
	Username, Password, Token string
	Insecure                  bool
	// SourceOnNodes imports Source on each target node from its own copy,
	// leaving the master's template store out.
	SourceOnNodes bool
	// NodeID is the one node to import on; "": every healthy node.
	NodeID string
	// Runtime creates from it run on when they name none; "": each
	// node's default. Every target node must offer it.
	Runtime string
	// Warm boots it once on each node after the import and keeps a memory
	// snapshot that creates restore (the runtime must checkpoint memory).
	Warm bool
}

// ImportTemplate imports a template on one node, or on every healthy node
// when req.NodeID is empty. Unless req.SourceOnNodes, the master first
// puts the image in its template store, and each node pulls it from there
// (distribute.go); nodes that register later get it too.
func (s *Service) ImportTemplate(ctx context.Context, req TemplateImport) (Template, error) {
	id, source, nodeID := req.ID, req.Source, req.NodeID
	if err := sandboxid.Validate("template", id); err != nil {
		return Template{}, err
	}
	switch {
	case req.SourceOnNodes && source == "":
		return Template{}, errdefs.FieldErrorf("source", "required")
	case req.SourceOnNodes && req.ImageRef != "":
		return Template{}, errdefs.FieldErrorf("image_ref", "a registry image is pulled by the master; source_on_nodes is for local paths")
	case source == "" && req.ImageRef == "":
		return Template{}, errdefs.FieldErrorf("source", "a source or an image_ref is required")
	case source != "" && req.ImageRef != "":
		return Template{}, errdefs.FieldErrorf("image_ref", "give a source or an image_ref, not both")
	}
	if err := s.validateRuntime(req.Runtime); err != nil {
		return Template{}, err
	}
	var targets []string
	if nodeID != "" {
		if _, err := s.client(nodeID); err != nil {
			return Template{}, fmt.Errorf("node %q: %w", nodeID, errdefs.ErrNotFound)
		}
		targets = []string{nodeID}
	} else {
		for _, n := range s.schedNodes() {
			if n.Healthy {
				targets = append(targets, n.ID)
			}
		}
		if len(targets) == 0 && req.SourceOnNodes {
			return Template{}, fmt.Errorf("no healthy node to import on: %w", errdefs.ErrUnavailable)
		}
	}
	if !req.SourceOnNodes {
		rec, err := s.storeTemplate(ctx, req)
		if err != nil {
			return Template{}, err
		}
		if err := s.distribute(ctx, rec, targets); err != nil {
			return Template{}, err
		}
		return s.GetTemplate(ctx, id)
	}
	var errs []error
	for _, node := range targets {
		if err := s.importOn(ctx, node, req); err != nil {
			errs = append(errs, err)
		}
		s.refreshTemplatesWithin(ctx, node, importRefreshTimeout)
	}
	if len(errs) > 0 {
		return Template{}, errors.Join(errs...)
	}
	return s.GetTemplate(ctx, id)
}

func (s *Service) importOn(ctx context.Context, node string, req TemplateImport) error {
	return s.importRequest(ctx, node, &cubeletpb.ImportTemplateRequest{
		TemplateId: req.ID, Source: req.Source, Runtime: req.Runtime, Warm: req.Warm,
	})
}

// importRequest runs one node's ImportTemplate to its end.
func (s *Service) importRequest(ctx context.Context, node string, req *cubeletpb.ImportTemplateRequest) error {
	c, err := s.client(node)
	if err != nil {
		return err
	}
	stream, err := c.ImportTemplate(ctx, req)
	if err != nil {
		return fromGRPC(node, err)
	}
	for {
		_, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return fromGRPC(node, err)
		}
	}
}

// refreshTimeout bounds one node's answer to a template refresh on the
// create path; an import, whose answer lists the nodes that hold the
// template, waits up to importRefreshTimeout (a loaded node answered
// ListTemplates in more than 2 s, and the import's answer left it out).
const (
	refreshTimeout       = 2 * time.Second
	importRefreshTimeout = 15 * time.Second
)

// refreshTemplates updates the master's view of a node's templates right
// away, instead of at its next heartbeat.
func (s *Service) refreshTemplates(ctx context.Context, node string) {
	s.refreshTemplatesWithin(ctx, node, refreshTimeout)
}

// refreshTemplatesWithin is refreshTemplates waiting up to d for the node.
func (s *Service) refreshTemplatesWithin(ctx context.Context, node string, d time.Duration) {
	c, err := s.client(node)
	if err != nil {
		return
	}
	// Bounded: a create that missed a template waits for this, and a
	// node that heartbeats but does not answer must not hold it.
	ctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	resp, err := c.ListTemplates(ctx, &cubeletpb.ListTemplatesRequest{})
	if err != nil {
		return
	}
	s.reg.mu.Lock()
	ns := s.reg.nodes[node]
	if ns == nil {
		s.reg.mu.Unlock()
		return
	}
	// Reports are shared read-only: replace, never modify.
	rep := proto.Clone(ns.report).(*masterpb.NodeReport)
	rep.Templates = nil
	for _, t := range resp.Templates {
		rep.Templates = append(rep.Templates, &masterpb.TemplateRef{Id: t.Id, Digest: t.Digest, SizeBytes: t.SizeBytes, CreatedAt: t.CreatedAt,
			Runtime: t.Runtime, Warm: t.Warm})
	}
	ns.report = rep
	if t := resp.GetListedAt(); t != nil {
		ns.templatesAt = t.AsTime()
	}
	row := nodeRow(rep, ns)
	s.reg.mu.Unlock()
	_ = s.cat.PutNode(ctx, row, reportTemplates(rep), false)
}
