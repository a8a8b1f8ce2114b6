package master_test

import (
	"context"
	"net/http"
	"strings"
	"testing"

	"github.com/cubesandbox/cube/internal/cubelet"
	"github.com/cubesandbox/cube/internal/master/catalog"
	"github.com/cubesandbox/cube/internal/master/mastertest"
	"github.com/cubesandbox/cube/internal/nospace/nospacetest"
)

// TestCreateOnFullNode: through the E2B API, a create on a node whose
// storage pool is full answers 507 with a message naming the pool's
// filesystem (no Retry-After: waiting does not free a disk), leaves no
// catalog row and nothing on the node; the same request succeeds once
// space returns, with no restart of either daemon.
func TestCreateOnFullNode(t *testing.T) {
	m := mastertest.StartMaster(t, "")
	node := mastertest.StartNode(t, m, "busybox")
	m.WaitHealthy(t, node)
	ctx := context.Background()
	c := m.API(m.APIKey(t))
	pool := node.Env.Config.PoolDir()

	free := nospacetest.Fill(t, pool)
	r := c.Do(t, "POST", "/v2/sandboxes", map[string]any{"templateID": "busybox"}, nil)
	code, msg := r.Error()
	t.Logf("create on a full node: %d %s (Retry-After %q)", r.StatusCode, msg, r.Header.Get("Retry-After"))
	if r.StatusCode != http.StatusInsufficientStorage || code != http.StatusInsufficientStorage ||
		!strings.Contains(msg, pool) || r.Header.Get("Retry-After") != "" {
		t.Fatalf("create on a full node: %d %s, want 507 naming %s", r.StatusCode, r.Body, pool)
	}
	if rows, _ := m.Server.Service.ListAll(ctx, catalog.Query{}); len(rows) != 0 {
		t.Fatalf("failed create left %d catalog row(s)", len(rows))
	}
	if l, _ := node.Svc.List(ctx, cubelet.ListFilter{}); len(l) != 0 {
		t.Fatalf("failed create left %d sandbox(es) on the node", len(l))
	}

	free()
	var sb struct {
		SandboxID string `json:"sandboxID"`
	}
	if r := c.Do(t, "POST", "/v2/sandboxes", map[string]any{"templateID": "busybox"}, &sb); r.StatusCode != http.StatusCreated {
		t.Fatalf("create after freeing space: %d %s", r.StatusCode, r.Body)
	}
	if r := c.Do(t, "DELETE", "/sandboxes/"+sb.SandboxID, nil, nil); r.StatusCode != http.StatusNoContent {
		t.Fatalf("kill: %d %s", r.StatusCode, r.Body)
	}
	node.Env.AssertNoLeaks(t)
}

// TestCreateWithFullCatalog: with the filesystem under the master's SQLite
// catalog full, a create answers 507 naming that filesystem and leaves
// nothing on the node; reads still answer; once space returns the same
// create succeeds without a restart.
func TestCreateWithFullCatalog(t *testing.T) {
	dir := nospacetest.Mount(t, "ext4", 64)
	m := mastertest.StartMaster(t, "[catalog]\ndsn = \""+dir+"/catalog.db\"\n")
	node := mastertest.StartNode(t, m, "busybox")
	m.WaitHealthy(t, node)
	ctx := context.Background()
	c := m.API(m.APIKey(t))

	free := nospacetest.Fill(t, dir)
	r := c.Do(t, "POST", "/v2/sandboxes", map[string]any{"templateID": "busybox"}, nil)
	code, msg := r.Error()
	t.Logf("create with a full catalog: %d %s", r.StatusCode, msg)
	if r.StatusCode != http.StatusInsufficientStorage || code != http.StatusInsufficientStorage || !strings.Contains(msg, dir) {
		t.Fatalf("create with a full catalog: %d %s, want 507 naming %s", r.StatusCode, r.Body, dir)
	}
	if r := c.Do(t, "GET", "/v2/sandboxes", nil, nil); r.StatusCode != http.StatusOK {
		t.Fatalf("list with a full catalog: %d %s", r.StatusCode, r.Body)
	}
	if l, _ := node.Svc.List(ctx, cubelet.ListFilter{}); len(l) != 0 {
		t.Fatalf("failed create left %d sandbox(es) on the node", len(l))
	}

	free()
	var sb struct {
		SandboxID string `json:"sandboxID"`
	}
	if r := c.Do(t, "POST", "/v2/sandboxes", map[string]any{"templateID": "busybox"}, &sb); r.StatusCode != http.StatusCreated {
		t.Fatalf("create after freeing space: %d %s", r.StatusCode, r.Body)
	}
	if r := c.Do(t, "DELETE", "/sandboxes/"+sb.SandboxID, nil, nil); r.StatusCode != http.StatusNoContent {
		t.Fatalf("kill: %d %s", r.StatusCode, r.Body)
	}
	node.Env.AssertNoLeaks(t)
}
