package integration

import (
	"context"
	"fmt"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"

	"github.com/cubesandbox/cube/internal/agent/agenttest"
	"github.com/cubesandbox/cube/internal/agentproto"
	"github.com/cubesandbox/cube/internal/cubelet"
	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
	"github.com/cubesandbox/cube/internal/nsdial"
	"github.com/cubesandbox/cube/internal/sandbox"
	"github.com/cubesandbox/cube/internal/template"
	"github.com/cubesandbox/cube/internal/testimage"
)

// busyboxWithService writes a layout of the busybox test image whose
// labels declare a template service.
func busyboxWithService(t *testing.T, start, ready string) string {
	t.Helper()
	bb, err := testimage.BusyboxImage()
	if err != nil {
		t.Fatal(err)
	}
	cf, err := bb.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	cf = cf.DeepCopy()
	cf.Config.Labels = map[string]string{template.LabelStartCmd: start, template.LabelReadyCmd: ready}
	img, err := mutate.ConfigFile(bb, cf)
	if err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(t.TempDir(), "layout")
	p, err := layout.Write(dir, empty.Index)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.AppendImage(img); err != nil {
		t.Fatal(err)
	}
	return dir
}

// A template's service (its image's start and ready labels) is serving
// when the create returns; a service that dies before it is ready fails
// the create with its output, and leaves nothing behind.
func TestTemplateService(t *testing.T) {
	env := cubelettest.New(t, "")
	svc := env.Start(t)
	testTemplateService(t, env, svc, "", func(sb *sandbox.Record) (*http.Client, string) {
		return nsdial.HTTPClient(fmt.Sprintf("/proc/%d/ns/net", sb.Container.PID)), fmt.Sprintf("http://127.0.0.1:%d", agentproto.Port)
	})
}

// The same in a micro-VM: the service starts and the ready command runs
// over the VM's agent channel (HTTP/2, one connection).
func TestVMTemplateService(t *testing.T) {
	env, svc := vmEnv(t, "")
	testTemplateService(t, env, svc, "vm", func(sb *sandbox.Record) (*http.Client, string) {
		return agentClient(), agentURL(t, svc, sb.ID, "")
	})
}

func testTemplateService(t *testing.T, env *cubelettest.Env, svc *cubelet.Service, runtime string, agent func(*sandbox.Record) (*http.Client, string)) {
	ctx := context.Background()
	good := busyboxWithService(t, `echo up > /tmp/index.html; exec /bin/busybox httpd -f -p 127.0.0.1:8080 -h /tmp`,
		`/bin/busybox wget -q -O /dev/null http://127.0.0.1:8080/index.html`)
	tmpl, err := svc.ImportTemplate(ctx, "with-service", good, nil)
	if err != nil {
		t.Fatal(err)
	}
	if tmpl.StartCmd == "" || tmpl.ReadyCmd == "" {
		t.Fatalf("template record without the service: %+v", tmpl)
	}
	start := time.Now()
	sb, err := svc.Create(ctx, cubelet.CreateRequest{TemplateID: "with-service", SandboxID: "svc-good", Runtime: runtime})
	if err != nil {
		t.Fatalf("create: %v", err)
	}
	t.Logf("create with the service ready: %v", time.Since(start).Round(time.Millisecond))
	hc, base := agent(sb.Sandbox)
	defer hc.CloseIdleConnections()
	// No wait: the create returned only once the ready command passed.
	if out := agenttest.Shell(ctx, t, hc, base, "/bin/busybox wget -q -O- http://127.0.0.1:8080/index.html"); out != "up\n" {
		t.Errorf("the service answers %q right after create, want up", out)
	}
	if _, err := svc.Delete(ctx, "svc-good"); err != nil {
		t.Fatal(err)
	}

	bad := busyboxWithService(t, `echo service-broke >&2; exit 3`, `/bin/busybox false`)
	if _, err := svc.ImportTemplate(ctx, "broken-service", bad, nil); err != nil {
		t.Fatal(err)
	}
	_, err = svc.Create(ctx, cubelet.CreateRequest{TemplateID: "broken-service", SandboxID: "svc-bad", Runtime: runtime})
	t.Logf("create with a service that exits: %v", err)
	if err == nil || !strings.Contains(err.Error(), "service-broke") || !strings.Contains(err.Error(), "exited (3") {
		t.Errorf("create = %v, want the service's exit and output", err)
	}
	for _, id := range []string{"with-service", "broken-service"} {
		if err := svc.DeleteTemplate(ctx, id); err != nil {
			t.Fatal(err)
		}
	}
	env.AssertNoLeaks(t)
}
