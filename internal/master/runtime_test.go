package master_test

import (
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	masterpb "github.com/cubesandbox/cube/api/master/v1"
	"github.com/cubesandbox/cube/internal/master"
	"github.com/cubesandbox/cube/internal/master/catalog"
	"github.com/cubesandbox/cube/internal/master/mastertest"
)

// noVM leaves the node with runc only: gVisor and QEMU are not
// registered, whatever this machine has installed.
const noVM = "[vm]\nenabled = false\n[gvisor]\nbinary = \"/nonexistent/runsc\"\n"

// TestRuntimeChoice drives the create extension "runtime" through the
// E2B API of a real master over a real runc-only cubelet.
func TestRuntimeChoice(t *testing.T) {
	m := mastertest.StartMaster(t, "")
	n := mastertest.StartNodeConfig(t, m, noVM, "busybox")
	m.WaitHealthy(t, n)
	if rts := m.Node(t, n.ID).Report.Runtimes; len(rts) != 1 || rts[0].Name != "runc" {
		t.Fatalf("test node runtimes %v, want runc only", rts)
	}
	ctx := context.Background()
	c := m.API(m.APIKey(t))
	type sandboxRuntime struct {
		SandboxID string `json:"sandboxID"`
		Runtime   string `json:"runtime"`
	}
	rows := func(t *testing.T) int {
		t.Helper()
		all, err := m.Server.Service.ListAll(ctx, catalog.Query{})
		if err != nil {
			t.Fatal(err)
		}
		return len(all)
	}

	var named sandboxRuntime
	t.Run("create with runtime runc", func(t *testing.T) {
		if r := c.Do(t, "POST", "/v2/sandboxes", map[string]any{"templateID": "busybox", "runtime": "runc"}, &named); r.StatusCode != http.StatusCreated {
			t.Fatalf("create: %d %s", r.StatusCode, r.Body)
		}
		if named.Runtime != "runc" {
			t.Fatalf("create response runtime %q", named.Runtime)
		}
		var d sandboxRuntime
		if r := c.Do(t, "GET", "/sandboxes/"+named.SandboxID, nil, &d); r.StatusCode != 200 || d.Runtime != "runc" {
			t.Fatalf("detail: %d %s", r.StatusCode, r.Body)
		}
		var l []sandboxRuntime
		if r := c.Do(t, "GET", "/v2/sandboxes", nil, &l); r.StatusCode != 200 || len(l) != 1 || l[0].Runtime != "runc" {
			t.Fatalf("list: %d %s", r.StatusCode, r.Body)
		}
		resp, err := m.Admin.ListSandboxes(ctx, &masterpb.ListSandboxesRequest{})
		if err != nil || len(resp.Sandboxes) != 1 || resp.Sandboxes[0].Runtime != "runc" {
			t.Fatalf("admin list: %v %v", resp, err)
		}
	})

	t.Run("no runtime: what the node used", func(t *testing.T) {
		var sb sandboxRuntime
		if r := c.Do(t, "POST", "/v2/sandboxes", map[string]any{"templateID": "busybox"}, &sb); r.StatusCode != http.StatusCreated {
			t.Fatalf("create: %d %s", r.StatusCode, r.Body)
		}
		row, err := m.Server.Service.Get(ctx, sb.SandboxID)
		if err != nil || row.Runtime != "runc" || sb.Runtime != "runc" {
			t.Fatalf("runtime: response %q, row %+v %v", sb.Runtime, row, err)
		}
		if r := c.Do(t, "DELETE", "/sandboxes/"+sb.SandboxID, nil, nil); r.StatusCode != http.StatusNoContent {
			t.Fatalf("kill: %d %s", r.StatusCode, r.Body)
		}
	})

	t.Run("refused runtimes leave no row", func(t *testing.T) {
		before := rows(t)
		for _, tc := range []struct{ runtime, want string }{
			{"firecracker", `runtime: unknown runtime "firecracker"; cube has gvisor, runc, vm`},
			{"run c", `runtime: "run c": 1-32 letters, digits or '-'`},
			{"vm", `runtime: no node offers runtime "vm" (the nodes offer: runc)`},
		} {
			r := c.Do(t, "POST", "/v2/sandboxes", map[string]any{"templateID": "busybox", "runtime": tc.runtime}, nil)
			if code, msg := r.Error(); r.StatusCode != http.StatusBadRequest || code != 400 || !strings.Contains(msg, tc.want) {
				t.Errorf("runtime %q: %d %s, want 400 with %q", tc.runtime, r.StatusCode, r.Body, tc.want)
			}
		}
		if after := rows(t); after != before {
			t.Fatalf("catalog rows %d -> %d", before, after)
		}
	})

	t.Run("snapshots and their sandboxes inherit", func(t *testing.T) {
		svc := m.Server.Service
		snap, err := svc.Snapshot(ctx, named.SandboxID, "")
		if err != nil {
			t.Fatal(err)
		}
		if snap.Runtime != "runc" {
			t.Fatalf("snapshot runtime %q", snap.Runtime)
		}
		defer func() {
			if err := svc.DeleteSnapshot(context.WithoutCancel(ctx), snap.ID); err != nil {
				t.Error(err)
			}
		}()
		if _, err := svc.Create(ctx, master.CreateRequest{Template: snap.ID, Runtime: "gvisor", Timeout: time.Minute}); err == nil ||
			!strings.Contains(err.Error(), `no node offers runtime "gvisor"`) {
			t.Fatalf("snapshot with another runtime: %v", err)
		}
		sb, err := svc.Create(ctx, master.CreateRequest{Template: snap.ID, Timeout: time.Minute})
		if err != nil {
			t.Fatal(err)
		}
		defer func() {
			if err := svc.Kill(context.WithoutCancel(ctx), sb.ID); err != nil {
				t.Error(err)
			}
		}()
		if sb.Runtime != "runc" {
			t.Fatalf("sandbox from snapshot: runtime %q", sb.Runtime)
		}
	})

	t.Run("template import through the master", func(t *testing.T) {
		tmpl, err := m.Admin.ImportTemplate(ctx, &masterpb.ImportTemplateRequest{TemplateId: "rt-runc", Source: n.Env.Image, NodeId: n.ID, Runtime: "runc"})
		if err != nil {
			t.Fatal(err)
		}
		if got := tmpl.Template.Runtimes[n.ID]; got != "runc" || len(tmpl.Template.WarmNodes) != 0 {
			t.Fatalf("imported template: %v", tmpl.Template)
		}
		if _, err := m.Admin.ImportTemplate(ctx, &masterpb.ImportTemplateRequest{TemplateId: "rt-vm", Source: n.Env.Image, Runtime: "vm"}); err == nil ||
			!strings.Contains(err.Error(), `no node offers runtime "vm"`) {
			t.Fatalf("import for vm: %v", err)
		}
		if _, err := m.Server.Service.GetTemplate(ctx, "rt-vm"); err == nil {
			t.Fatal("rt-vm imported")
		}
		if _, err := m.Admin.DeleteTemplate(ctx, &masterpb.DeleteTemplateRequest{TemplateId: "rt-runc"}); err != nil {
			t.Fatal(err)
		}
	})

	if r := c.Do(t, "DELETE", "/sandboxes/"+named.SandboxID, nil, nil); r.StatusCode != http.StatusNoContent {
		t.Fatalf("kill: %d %s", r.StatusCode, r.Body)
	}
}
