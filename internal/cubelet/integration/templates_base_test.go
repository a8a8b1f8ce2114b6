package integration

import (
	"context"
	"os"
	"testing"

	"github.com/cubesandbox/cube/internal/cubelet"
	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
	"github.com/cubesandbox/cube/internal/lifecycle"
	"github.com/cubesandbox/cube/internal/template/baseimage"
)

// TestBaseTemplateBoots imports the debootstrap-built `base` image (cached;
// see internal/template/baseimage) and runs a sandbox from it: the agent
// must come up in the Debian rootfs. Only with CUBE_TEST_BASE=1.
func TestBaseTemplateBoots(t *testing.T) {
	if os.Getenv("CUBE_TEST_BASE") != "1" {
		t.Skip("set CUBE_TEST_BASE=1 to build and boot the base template")
	}
	cache := os.Getenv("CUBE_BASE_CACHE")
	if cache == "" {
		cache = "/var/cache/cube/base"
	}
	env := cubelettest.New(t, "")
	ctx := context.Background()
	res, err := baseimage.Build(ctx, baseimage.Options{Dir: cache})
	if err != nil {
		t.Fatal(err)
	}
	svc := env.Start(t)
	tmpl, err := svc.ImportTemplate(ctx, "base", res.Layout, nil)
	if err != nil {
		t.Fatal(err)
	}
	if tmpl.WorkingDir != "/home/user" {
		t.Errorf("template %+v", tmpl)
	}
	sb, err := svc.Create(ctx, cubelet.CreateRequest{TemplateID: "base", SandboxID: "base-one"})
	if err != nil {
		t.Fatalf("create from base: %v", err)
	}
	if sb.Sandbox.State != lifecycle.Running {
		t.Errorf("state %s", sb.Sandbox.State)
	}
	if _, err := svc.Delete(ctx, "base-one"); err != nil {
		t.Fatal(err)
	}
	if err := svc.DeleteTemplate(ctx, "base"); err != nil {
		t.Fatal(err)
	}
	env.AssertNoLeaks(t)
}
