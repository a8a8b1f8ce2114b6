package master

import (
	"io"
	"log/slog"
	"testing"
	"time"

	masterpb "github.com/cubesandbox/cube/api/master/v1"
	"github.com/cubesandbox/cube/internal/master/catalog"
	"github.com/cubesandbox/cube/internal/master/tmplstore"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/types/known/timestamppb"
)

// TestFollowKeepsNewerTemplateListing: replica a imports a template on a
// node registered with replica b and lists the node's templates itself;
// b then records a heartbeat the node generated before the import. When a
// follows that catalog row, the node must keep the template (a's import
// answer and its creates rely on it) until a report generated after a's
// listing arrives. Control: a report generated after the listing replaces
// it, so a delete seen by the node is not hidden for ever.
func TestFollowKeepsNewerTemplateListing(t *testing.T) {
	listed := time.Now()
	withShared := &masterpb.NodeReport{NodeId: "n1", Address: "/run/n1.sock", Ok: true,
		Templates: []*masterpb.TemplateRef{{Id: "shared", Digest: "sha256:aa"}}, GeneratedAt: timestamppb.New(listed)}
	cfg := &Config{}
	cfg.Nodes.UnhealthyAfter.Duration = time.Minute
	s := &Service{cfg: cfg, log: slog.New(slog.NewTextHandler(io.Discard, nil)), reg: &registry{nodes: map[string]*nodeState{}}, stored: &storedTemplates{recs: map[string]tmplstore.Record{}}}
	ns := &nodeState{report: withShared, lastSeen: listed, registered: listed, templatesAt: listed, pending: map[string]reservation{}}
	if err := ns.setAddress("n1", "/run/n1.sock", nil); err != nil {
		t.Fatal(err)
	}
	s.reg.nodes["n1"] = ns

	row := func(generated, heartbeat time.Time, templates ...string) *catalog.Node {
		rep := &masterpb.NodeReport{NodeId: "n1", Address: "/run/n1.sock", Ok: true, GeneratedAt: timestamppb.New(generated)}
		for _, id := range templates {
			rep.Templates = append(rep.Templates, &masterpb.TemplateRef{Id: id, Digest: "sha256:aa"})
		}
		raw, err := protojson.Marshal(rep)
		if err != nil {
			t.Fatal(err)
		}
		return &catalog.Node{ID: "n1", Address: "/run/n1.sock", Report: raw, RegisteredAt: listed, LastHeartbeat: heartbeat, Schedulable: true}
	}
	has := func() bool {
		for _, tt := range s.Templates() {
			if tt.ID == "shared" && len(tt.Nodes) == 1 {
				return true
			}
		}
		return false
	}

	s.followNodeRows([]*catalog.Node{row(listed.Add(-50*time.Millisecond), listed.Add(10*time.Millisecond))}, time.Now())
	if !has() {
		t.Fatal("a heartbeat generated before the replica's own listing dropped the imported template")
	}
	s.followNodeRows([]*catalog.Node{row(listed.Add(time.Second), listed.Add(time.Second))}, time.Now())
	if has() {
		t.Fatal("control: a report generated after the listing, without the template, did not replace it")
	}
}
