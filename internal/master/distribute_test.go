package master_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	cubeletpb "github.com/cubesandbox/cube/api/cubelet/v1"
	masterpb "github.com/cubesandbox/cube/api/master/v1"
	"github.com/cubesandbox/cube/internal/cubelet"
	"github.com/cubesandbox/cube/internal/failpoint"
	"github.com/cubesandbox/cube/internal/master"
	"github.com/cubesandbox/cube/internal/master/catalog"
	"github.com/cubesandbox/cube/internal/master/mastertest"
	"github.com/cubesandbox/cube/internal/template/registrytest"
	"github.com/cubesandbox/cube/internal/testimage"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/random"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// TestClusterTemplates imports a template once through the master, from a
// source only the master reads, and checks that every node gets it from
// the master's template store, that a node joining later gets it too, that
// a node refuses a blob whose bytes no longer match their digest (and
// takes the same pull once the bytes are right), and that creates go to
// nodes that hold the template while the others pull it.
func TestClusterTemplates(t *testing.T) {
	m := mastertest.StartMaster(t, "[scheduler.weights]\nload = 1.0\nlocality = 0.0\nspread = 0.5\n")
	ctx := context.Background()
	svc := func() *master.Service { return m.Server.Service }

	// Before any node: the import only stores it, and the E2B API shows
	// it waiting; the nodes get it as they register.
	early := filepath.Join(m.Dir, "early")
	bb, err := testimage.BusyboxImage()
	if err != nil {
		t.Fatal(err)
	}
	// A layer of its own, so that the nodes' dedupe does not make the
	// later imports of busybox clones of this one.
	extra, err := random.Layer(4096, types.OCILayer)
	if err != nil {
		t.Fatal(err)
	}
	if bb, err = mutate.AppendLayers(bb, extra); err != nil {
		t.Fatal(err)
	}
	if p, err := layout.Write(early, empty.Index); err != nil {
		t.Fatal(err)
	} else if err := p.AppendImage(bb); err != nil {
		t.Fatal(err)
	}
	if resp, err := m.Admin.ImportTemplate(ctx, &masterpb.ImportTemplateRequest{TemplateId: "early", Source: early}); err != nil || !resp.Template.Stored || len(resp.Template.Nodes) != 0 {
		t.Fatalf("import with no node: %v %v", resp, err)
	}
	api := m.API(m.APIKey(t))
	if r := api.Do(t, "GET", "/templates", nil, nil); !strings.Contains(string(r.Body), `"buildStatus":"waiting"`) {
		t.Fatalf("GET /templates with early on no node: %d %s", r.StatusCode, r.Body)
	}
	a := mastertest.StartNode(t, m)
	b := mastertest.StartNode(t, m)
	c := mastertest.StartNode(t, m)
	a.Templates, b.Templates, c.Templates = []string{"early"}, []string{"early"}, []string{"early"}
	m.WaitHealthy(t, a, b, c) // with early, pulled at registration
	var list []struct {
		TemplateID  string `json:"templateID"`
		BuildStatus string `json:"buildStatus"`
	}
	if r := api.Do(t, "GET", "/templates", nil, &list); r.StatusCode != 200 || len(list) != 1 || list[0].BuildStatus != "ready" {
		t.Fatalf("GET /templates with early on 3 nodes: %d %s", r.StatusCode, r.Body)
	}

	// The source lives in a directory of the master's; the nodes are told
	// only a digest, and it is gone before the late node joins.
	src := filepath.Join(m.Dir, "src")
	if out, err := exec.Command("cp", "-a", a.Env.Image, src).CombinedOutput(); err != nil {
		t.Fatalf("copy the image: %v %s", err, out)
	}
	hasTemplate := func(n *mastertest.Node, id string) (*cubeletpb.Template, bool) {
		resp, err := n.Client.GetTemplate(ctx, &cubeletpb.GetTemplateRequest{TemplateId: id})
		if err != nil {
			return nil, false
		}
		return resp.Template, true
	}
	var digest string
	var distBytes int64
	// onNodes waits for the master's view: a heartbeat generated before
	// an import ended may briefly replace the view the import refreshed.
	onNodes := func(t *testing.T, id string, n int) {
		t.Helper()
		mastertest.WaitFor(t, 5*time.Second, fmt.Sprintf("the master to see %s on %d nodes", id, n), func() bool {
			tm, err := svc().GetTemplate(ctx, id)
			return err == nil && len(tm.Nodes) == n
		})
	}

	t.Run("import once, created on every node", func(t *testing.T) {
		start := time.Now()
		resp, err := m.Admin.ImportTemplate(ctx, &masterpb.ImportTemplateRequest{TemplateId: "dist", Source: src, Runtime: "runc"})
		if err != nil {
			t.Fatal(err)
		}
		took := time.Since(start)
		rec, err := svc().TemplateStore().Get("dist")
		if err != nil {
			t.Fatal(err)
		}
		distBytes = rec.Blobs
		ct := resp.Template
		t.Logf("template distribution: %d bytes of image to 3 nodes in %s (store, pull and build on each, in parallel)", distBytes, took)
		if !ct.Stored {
			t.Fatalf("after the import: stored=%v", ct.Stored)
		}
		onNodes(t, "dist", 3)
		digest = ct.Digest
		for _, n := range []*mastertest.Node{a, b, c} {
			tp, ok := hasTemplate(n, "dist")
			if !ok || tp.Digest != digest || !strings.HasPrefix(tp.Source, "cubemaster:") {
				t.Fatalf("node %s: template %+v, want digest %s from the master", n.ID, tp, digest)
			}
		}
	})
	if err := os.RemoveAll(src); err != nil {
		t.Fatal(err)
	}

	var d *mastertest.Node
	outer := t // the late node lives as long as the whole test
	t.Run("a node that joins later gets it", func(t *testing.T) {
		start := time.Now()
		d = mastertest.StartNode(outer, m)
		mastertest.WaitFor(t, 60*time.Second, "the late node to pull dist", func() bool {
			_, ok := hasTemplate(d, "dist")
			return ok
		})
		t.Logf("late node: started, registered and pulled dist in %s", time.Since(start))
		if tp, _ := hasTemplate(d, "dist"); tp.Runtime != "runc" {
			t.Fatalf("the late node's copy is for runtime %q; the import named runc", tp.Runtime)
		}
		mastertest.WaitFor(t, 10*time.Second, "the master to see dist on the late node", func() bool {
			tm, err := svc().GetTemplate(ctx, "dist")
			return err == nil && len(tm.Nodes) == 4
		})
	})
	if d == nil {
		t.FailNow()
	}

	t.Run("a tampered blob is refused", func(t *testing.T) {
		if _, err := d.Client.DeleteTemplate(ctx, &cubeletpb.DeleteTemplateRequest{TemplateId: "dist"}); err != nil {
			t.Fatal(err)
		}
		blob := largestLayer(t, svc().TemplateStore().BlobPath(digest))
		pull := func() error {
			stream, err := d.Client.ImportTemplate(ctx, &cubeletpb.ImportTemplateRequest{TemplateId: "dist", Artifact: digest})
			if err != nil {
				return err
			}
			for {
				if _, err := stream.Recv(); err != nil {
					if errors.Is(err, io.EOF) {
						return nil
					}
					return err
				}
			}
		}
		flip(t, blob)
		err := pull()
		t.Logf("pull with one byte of layer %s flipped in the store: %v", filepath.Base(blob), err)
		if err == nil || !strings.Contains(err.Error(), "refused") || !strings.Contains(err.Error(), filepath.Base(blob)) {
			t.Fatalf("pull of a tampered blob: %v, want it refused for that blob's digest", err)
		}
		if _, ok := hasTemplate(d, "dist"); ok {
			t.Fatal("the node kept a template from a tampered blob")
		}
		flip(t, blob) // back as it was: the same pull is the control
		if err := pull(); err != nil {
			t.Fatalf("control: the untampered pull: %v", err)
		}
		if tp, ok := hasTemplate(d, "dist"); !ok || tp.Digest != digest {
			t.Fatalf("control: template %+v", tp)
		}
	})

	t.Run("creates prefer nodes that hold the template", func(t *testing.T) {
		if _, err := d.Client.DeleteTemplate(ctx, &cubeletpb.DeleteTemplateRequest{TemplateId: "dist"}); err != nil {
			t.Fatal(err)
		}
		mastertest.WaitFor(t, 10*time.Second, "the master to see dist gone from the late node", func() bool {
			tm, err := svc().GetTemplate(ctx, "dist")
			return err == nil && len(tm.Nodes) == 3
		})
		// Hold the late node's background pull until the creates are done.
		if err := failpoint.Enable(cubelet.FailpointTemplatePull, "1*sleep(3s)"); err != nil {
			t.Fatal(err)
		}
		defer failpoint.Disable(cubelet.FailpointTemplatePull)
		var made []*catalog.Sandbox
		for range 3 {
			sb, err := svc().Create(ctx, master.CreateRequest{Template: "dist", Timeout: 10 * time.Minute})
			if err != nil {
				t.Fatal(err)
			}
			made = append(made, sb)
			if sb.NodeID == d.ID {
				t.Fatalf("sandbox %s placed on %s, which does not hold dist yet", sb.ID, d.ID)
			}
		}
		// The empty late node pulled meanwhile, and is now the first choice.
		mastertest.WaitFor(t, 60*time.Second, "the late node to pull dist in the background", func() bool {
			tm, err := svc().GetTemplate(ctx, "dist")
			return err == nil && len(tm.Nodes) == 4
		})
		sb, err := svc().Create(ctx, master.CreateRequest{Template: "dist", Timeout: 10 * time.Minute})
		if err != nil {
			t.Fatal(err)
		}
		made = append(made, sb)
		if sb.NodeID != d.ID {
			t.Fatalf("after its pull, the empty late node %s should win; placed on %s", d.ID, sb.NodeID)
		}
		for _, s := range made {
			if err := svc().Kill(ctx, s.ID); err != nil {
				t.Errorf("kill %s: %v", s.ID, err)
			}
		}
	})

	t.Run("distribution time of a 32 MiB image", func(t *testing.T) {
		// busybox plus a layer of 32 MiB of random (incompressible) bytes.
		idx, err := layout.ImageIndexFromPath(a.Env.Image)
		if err != nil {
			t.Fatal(err)
		}
		im, err := idx.IndexManifest()
		if err != nil {
			t.Fatal(err)
		}
		base, err := idx.Image(im.Manifests[0].Digest)
		if err != nil {
			t.Fatal(err)
		}
		big, err := random.Layer(32<<20, types.OCILayer)
		if err != nil {
			t.Fatal(err)
		}
		img, err := mutate.AppendLayers(base, big)
		if err != nil {
			t.Fatal(err)
		}
		dir := filepath.Join(m.Dir, "big")
		p, err := layout.Write(dir, empty.Index)
		if err != nil {
			t.Fatal(err)
		}
		if err := p.AppendImage(img); err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		if _, err := m.Admin.ImportTemplate(ctx, &masterpb.ImportTemplateRequest{TemplateId: "big", Source: dir, NodeId: a.ID}); err != nil {
			t.Fatal(err)
		}
		one := time.Since(start)
		start = time.Now()
		resp, err := m.Admin.ImportTemplate(ctx, &masterpb.ImportTemplateRequest{TemplateId: "big", Source: dir})
		if err != nil {
			t.Fatal(err)
		}
		three := time.Since(start)
		onNodes(t, "big", 4)
		rec, err := svc().TemplateStore().Get("big")
		if err != nil || rec.Digest != resp.Template.Digest {
			t.Fatalf("big in the store: %+v %v", rec, err)
		}
		t.Logf("template distribution, %d bytes of image: store + 1 node %s; then 3 more nodes in parallel %s", rec.Blobs, one, three)
		if _, err := m.Admin.DeleteTemplate(ctx, &masterpb.DeleteTemplateRequest{TemplateId: "big"}); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("an image from a registry, pulled by the master", func(t *testing.T) {
		reg := registrytest.Start(t, registrytest.Options{})
		bb, err := testimage.BusyboxImage()
		if err != nil {
			t.Fatal(err)
		}
		if _, err := reg.Push(ctx, "busybox:1", bb); err != nil {
			t.Fatal(err)
		}
		want, _ := bb.Digest()
		start := time.Now()
		resp, err := m.Admin.ImportTemplate(ctx, &masterpb.ImportTemplateRequest{TemplateId: "reg", ImageRef: reg.Ref("busybox:1"), Insecure: true})
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("--image through the master: pulled, stored and on %d nodes in %s", len(resp.Template.Nodes), time.Since(start))
		if resp.Template.Digest != want.String() {
			t.Fatalf("reg: digest %s, want %s", resp.Template.Digest, want)
		}
		onNodes(t, "reg", 4)
		if _, err := m.Admin.DeleteTemplate(ctx, &masterpb.DeleteTemplateRequest{TemplateId: "reg"}); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("delete through the master removes it from the store", func(t *testing.T) {
		if _, err := m.Admin.DeleteTemplate(ctx, &masterpb.DeleteTemplateRequest{TemplateId: "early"}); err != nil {
			t.Fatal(err)
		}
		if _, err := m.Admin.DeleteTemplate(ctx, &masterpb.DeleteTemplateRequest{TemplateId: "dist"}); err != nil {
			t.Fatal(err)
		}
		if _, err := svc().TemplateStore().Get("dist"); err == nil {
			t.Fatal("record kept")
		}
		if _, err := os.Stat(svc().TemplateStore().BlobPath(digest)); !os.IsNotExist(err) {
			t.Fatalf("manifest blob kept: %v", err)
		}
		for _, n := range []*mastertest.Node{a, b, c, d} {
			if _, ok := hasTemplate(n, "dist"); ok {
				t.Errorf("node %s kept dist", n.ID)
			}
			n.Env.AssertNoLeaks(t)
		}
	})
}

// largestLayer is the path of the biggest layer blob the manifest at
// manifestPath names.
func largestLayer(t *testing.T, manifestPath string) string {
	t.Helper()
	raw, err := os.ReadFile(manifestPath)
	if err != nil {
		t.Fatal(err)
	}
	var m struct {
		Layers []struct {
			Digest string `json:"digest"`
			Size   int64  `json:"size"`
		} `json:"layers"`
	}
	if err := json.Unmarshal(raw, &m); err != nil || len(m.Layers) == 0 {
		t.Fatalf("manifest: %v %s", err, raw)
	}
	best := m.Layers[0]
	for _, l := range m.Layers {
		if l.Size > best.Size {
			best = l
		}
	}
	return filepath.Join(filepath.Dir(manifestPath), strings.TrimPrefix(best.Digest, "sha256:"))
}

// flip inverts one byte in the middle of a file.
func flip(t *testing.T, path string) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		t.Fatal(err)
	}
	b := make([]byte, 1)
	off := st.Size() / 2
	if _, err := f.ReadAt(b, off); err != nil {
		t.Fatal(err)
	}
	b[0] ^= 0xff
	if _, err := f.WriteAt(b, off); err != nil {
		t.Fatal(err)
	}
}
