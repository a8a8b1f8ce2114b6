package integration

import (
	"context"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/cubelet"
	"github.com/cubesandbox/cube/internal/cubelet/config"
	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
	"github.com/cubesandbox/cube/internal/errdefs"
)

// TestTemplateGC: an unused template goes after gc.templates_unused_after,
// a template in use and a kept one stay.
func TestTemplateGC(t *testing.T) {
	env := cubelettest.New(t, "")
	env.Config.GC.TemplatesUnusedAfter = config.Duration{Duration: 300 * time.Millisecond}
	env.Config.GC.KeepTemplates = []string{"kept"}
	svc := env.Start(t)
	ctx := context.Background()
	for _, id := range []string{"used", "idle", "kept"} {
		env.ImportBusybox(t, svc, id)
	}
	res, err := svc.Create(ctx, cubelet.CreateRequest{TemplateID: "used"})
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(15 * time.Second)
	for {
		_, err := svc.GetTemplate(ctx, "idle")
		if errdefs.IsNotFound(err) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("unused template was never collected")
		}
		time.Sleep(100 * time.Millisecond)
	}
	for _, id := range []string{"used", "kept"} {
		if _, err := svc.GetTemplate(ctx, id); err != nil {
			t.Errorf("template %s was collected: %v", id, err)
		}
	}
	if _, err := svc.Delete(ctx, res.Sandbox.ID); err != nil {
		t.Fatal(err)
	}
	env.AssertNoLeaks(t)
}
