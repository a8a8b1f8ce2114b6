package master

import (
	"context"
	"errors"

	cubeletpb "github.com/cubesandbox/cube/api/cubelet/v1"
)

// WarmTemplate warms a template already on the nodes: each node holding
// it boots it once on runtime ("" the template's, else the node default),
// keeps a memory snapshot that creates restore, and reports back. Nodes
// are warmed one after the other (a warm boots a sandbox; a cluster-wide
// burst of boots would compete with creates); progress, when set, is
// called after each node with its error. The error joins every node's.
func (s *Service) WarmTemplate(ctx context.Context, name, runtime string, progress func(node string, err error)) (Template, error) {
	t, err := s.GetTemplate(ctx, name)
	if err != nil {
		return Template{}, err
	}
	var errs []error
	for _, node := range t.Nodes {
		c, err := s.client(node)
		if err == nil {
			_, err = c.WarmTemplate(ctx, &cubeletpb.WarmTemplateRequest{TemplateId: t.ID, Runtime: runtime})
			err = fromGRPC(node, err)
		}
		if err != nil {
			errs = append(errs, err)
		} else {
			s.refreshTemplatesWithin(ctx, node, importRefreshTimeout)
		}
		s.log.Info("template warm", "template_id", t.ID, "node_id", node, "runtime", runtime, "err", err)
		if progress != nil {
			progress(node, err)
		}
	}
	if t2, err := s.GetTemplate(ctx, t.ID); err == nil {
		t = t2
	}
	return t, errors.Join(errs...)
}
