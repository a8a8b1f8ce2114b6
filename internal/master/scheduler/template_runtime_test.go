package scheduler_test

import (
	"context"
	"strings"
	"testing"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/master/scheduler"
)

// A create that names no runtime runs on the template's: nodes whose copy
// of the template is for a runtime they lack are filtered out, and a
// runtime named in the request overrides the template's.
func TestTemplateRuntime(t *testing.T) {
	vmTmpl := func(n *scheduler.Node) { n.TemplateRuntimes = map[string]string{"busybox": "vm"} }
	nodes := []*scheduler.Node{
		node("runc-only", vmTmpl),
		node("has-vm", vmTmpl, func(n *scheduler.Node) { n.Runtimes = []string{"runc", "vm"} }),
		node("default", func(n *scheduler.Node) { n.TemplateRuntimes = map[string]string{"busybox": ""} }),
	}
	cands, rejs := newSched().Rank(nodes, req)
	var ids []string
	for _, c := range cands {
		ids = append(ids, c.Node.ID)
	}
	if len(cands) != 2 || strings.Contains(strings.Join(ids, ","), "runc-only") {
		t.Fatalf("candidates %v, want has-vm and default", ids)
	}
	if len(rejs) != 1 || rejs[0].NodeID != "runc-only" || !errdefs.IsFailedPrecondition(rejs[0].Kind()) ||
		rejs[0].Reason != `template "busybox" is for runtime "vm", which the node lacks (has runc)` {
		t.Fatalf("rejections: %+v", rejs)
	}
	// Naming runc overrides the template's runtime: every node qualifies.
	r := req
	r.Runtime = "runc"
	if cands, _ := newSched().Rank(nodes, r); len(cands) != 3 {
		t.Fatalf("runtime named: %d candidates, want 3", len(cands))
	}
	// Only nodes lacking the template's runtime: no compatible node.
	_, err := newSched().Place(context.Background(), nodes[:1], req, func(context.Context, *scheduler.Node) error {
		t.Fatal("try called")
		return nil
	})
	if !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("want FailedPrecondition, got %v", err)
	}
}
