package master_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/random"
	"github.com/google/go-containerregistry/pkg/v1/types"

	masterpb "github.com/cubesandbox/cube/api/master/v1"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/master/catalog/catalogtest"
	"github.com/cubesandbox/cube/internal/master/mastertest"
	"github.com/cubesandbox/cube/internal/objstore"
	"github.com/cubesandbox/cube/internal/objstore/objstoretest"
	"github.com/cubesandbox/cube/internal/testimage"
)

// TestTemplatesAcrossReplicas: replicas a and b share a MariaDB catalog
// and an object store; the only node reports to b. A template imported
// through a (from a source only a is told of) is listed by b at once,
// reaches the node through b (which fetches its image from the object
// store: nothing of it was in b's store), and sandboxes are created from
// it through b. Deleted through b while a is down, it leaves the object
// store and the catalog, and a drops its copy when it starts again. The control: replica c on the same catalog without an
// object store imports a template the same way, and the node cannot get
// it through b (b says why).
func TestTemplatesAcrossReplicas(t *testing.T) {
	db := catalogtest.StartMariaDB(t)
	dsn := db.NewDatabase(t)
	srv := objstoretest.Start(t)
	conf := func(id string, store bool) string {
		s := fmt.Sprintf("[catalog]\ndriver = \"mysql\"\ndsn = %q\n[ha]\nreplica_id = %q\nlease_ttl = \"2s\"\n[sandbox]\nmilli_cpu = 100\n", dsn, id)
		if store {
			s += fmt.Sprintf("[templates.object_store]\nendpoint = %q\nbucket = %q\naccess_key_file = %q\nsecret_key_file = %q\n",
				srv.Endpoint, srv.Bucket, srv.AccessKeyFile, srv.SecretKeyFile)
		}
		return s
	}
	ctx := context.Background()
	a := mastertest.StartMasterProcess(t, conf("a", true))
	b := mastertest.StartMasterProcess(t, conf("b", true))
	n := mastertest.StartNodeReplicas(t, []*mastertest.Master{b}, "")
	a.WaitHealthy(t, n)
	b.WaitHealthy(t, n)

	image := func(name string) string {
		img, err := testimage.BusyboxImage()
		if err != nil {
			t.Fatal(err)
		}
		extra, err := random.Layer(4096, types.OCILayer)
		if err != nil {
			t.Fatal(err)
		}
		if img, err = mutate.AppendLayers(img, extra); err != nil {
			t.Fatal(err)
		}
		dir := filepath.Join(t.TempDir(), name)
		p, err := layout.Write(dir, empty.Index)
		if err != nil {
			t.Fatal(err)
		}
		if err := p.AppendImage(img); err != nil {
			t.Fatal(err)
		}
		return dir
	}
	stored := func(m *mastertest.Master, id string) *masterpb.ClusterTemplate {
		resp, err := m.Admin.ListTemplates(ctx, &masterpb.ListTemplatesRequest{})
		if err != nil {
			t.Fatal(err)
		}
		for _, tt := range resp.Templates {
			if tt.TemplateId == id {
				return tt
			}
		}
		return nil
	}

	begin := time.Now()
	resp, err := a.Admin.ImportTemplate(ctx, &masterpb.ImportTemplateRequest{TemplateId: "shared", Source: image("shared")})
	if err != nil {
		t.Fatalf("import through a: %v\nb's log:\n%s", err, tail(b.Logs()))
	}
	t.Logf("imported through a and pulled by the node through b in %s: %v", time.Since(begin).Round(time.Millisecond), resp.Template.Nodes)
	if len(resp.Template.Nodes) != 1 || resp.Template.Nodes[0] != n.ID {
		t.Fatalf("after the import the template is on %v, want [%s]", resp.Template.Nodes, n.ID)
	}
	if !strings.Contains(b.Logs(), "template fetched from the object store") {
		t.Errorf("b served the node without fetching the image from the object store")
	}
	if tt := stored(b, "shared"); tt == nil || !tt.Stored {
		t.Fatalf("b lists %+v, want the stored template", tt)
	}
	key := b.APIKey(t)
	api := b.API(key)
	var sb e2bSandbox
	if r := api.Do(t, "POST", "/v2/sandboxes", map[string]any{"templateID": "shared", "timeout": 60}, &sb); r.StatusCode != http.StatusCreated {
		t.Fatalf("create from the template through b: %d %s", r.StatusCode, r.Body)
	}
	if r := api.Do(t, "DELETE", "/sandboxes/"+sb.SandboxID, nil, nil); r.StatusCode != http.StatusNoContent {
		t.Fatalf("kill: %d %s", r.StatusCode, r.Body)
	}

	obj, err := objstore.Open(objstore.Config{Endpoint: srv.Endpoint, Bucket: srv.Bucket, AccessKeyFile: srv.AccessKeyFile, SecretKeyFile: srv.SecretKeyFile})
	if err != nil {
		t.Fatal(err)
	}
	objects := func() []string {
		ids, err := obj.In(objstore.Templates).List(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return ids
	}
	if ids := objects(); len(ids) != 1 || !strings.HasPrefix(ids[0], "shared.") {
		t.Fatalf("object store templates %v, want shared's", ids)
	}

	// Deleted through b while a is down: gone everywhere, and a, started
	// again with the template in its store, drops its copy rather than
	// publishing it again.
	a.Kill()
	if _, err := b.Admin.DeleteTemplate(ctx, &masterpb.DeleteTemplateRequest{TemplateId: "shared"}); err != nil {
		t.Fatal(err)
	}
	if ids := objects(); len(ids) != 0 {
		t.Errorf("after the delete the object store holds %v", ids)
	}
	a.Start()
	mastertest.WaitFor(t, 10*time.Second, "a drops its copy", func() bool {
		return strings.Contains(a.Logs(), "template copy dropped") && stored(a, "shared") == nil
	})
	if tt := stored(b, "shared"); tt != nil {
		t.Fatalf("after a's restart b lists %+v: a published the deleted template again", tt)
	}
	if ids := objects(); len(ids) != 0 {
		t.Errorf("after a's restart the object store holds %v", ids)
	}
	if m, _ := filepath.Glob(filepath.Join(a.Dir, "templates", "templates", "*.json")); len(m) != 0 {
		t.Errorf("a's store still has records %v", m)
	}

	// The control: replica c has no object store.
	c := mastertest.StartMasterProcess(t, conf("c", false))
	c.WaitHealthy(t, n)
	_, err = c.Admin.ImportTemplate(ctx, &masterpb.ImportTemplateRequest{TemplateId: "solo", Source: image("solo")})
	t.Logf("import through c (no object store): %v", err)
	if err == nil || !strings.Contains(err.Error(), `imported through replica "c"`) {
		t.Fatalf("import through c, node on b: %v; want the node refused by b for want of an object store", err)
	}
	if tt := stored(b, "solo"); tt == nil || len(tt.Nodes) != 0 {
		t.Fatalf("b lists solo as %+v; want stored, on no node", tt)
	}
	if _, err := c.Admin.DeleteTemplate(ctx, &masterpb.DeleteTemplateRequest{TemplateId: "solo"}); err != nil && !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatal(err)
	}
}

// tail is the end of a log, for failure messages.
func tail(s string) string {
	if len(s) > 6000 {
		return s[len(s)-6000:]
	}
	return s
}
