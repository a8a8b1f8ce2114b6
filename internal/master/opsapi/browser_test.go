package opsapi_test

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	masterpb "github.com/cubesandbox/cube/api/master/v1"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/master/catalog"
	"github.com/cubesandbox/cube/internal/master/mastertest"
	"github.com/cubesandbox/cube/internal/master/opsapi"
	"github.com/cubesandbox/cube/internal/testbin"
	"github.com/cubesandbox/cube/internal/testenv"
)

// TestConsoleBrowser runs the console's browser test (hack/console-test:
// Debian's chromium driven by puppeteer-core) against a real master and
// node: log in, see the node, create a sandbox from the UI and watch it
// appear live in another tab, `echo hi` in the terminal, the CPU chart
// rising under a busy loop, pause and resume, a snapshot in the lineage
// tree, kill, and a team user who cannot see another team's sandbox while
// that team can. Screenshots of each page go to $CUBE_ARTIFACTS/console
// (a temporary directory without it).
func TestConsoleBrowser(t *testing.T) {
	chromium := testenv.RequireBinary(t, "chromium", "chromium")
	node := testenv.RequireBinary(t, "node", "nodejs")
	dir := filepath.Join(testbin.Root(), "hack", "console-test")
	if _, err := os.Stat(filepath.Join(dir, "node_modules", "puppeteer-core")); err != nil {
		testenv.Missing(t, "puppeteer-core: run npm ci --prefix hack/console-test (hack/test.sh does)")
	}
	screens := filepath.Join(os.Getenv("CUBE_ARTIFACTS"), "console")
	if os.Getenv("CUBE_ARTIFACTS") == "" {
		screens = t.TempDir()
	}
	const pw = "console test password"
	hash, err := opsapi.HashPassword(pw)
	if err != nil {
		t.Fatal(err)
	}
	m := mastertest.StartMaster(t, fmt.Sprintf("[api]\nops = \"127.0.0.1:0\"\n[console]\nadmin_password_hash = %q\n", hash))
	n := mastertest.StartNodeConfig(t, m, "[usage]\ninterval = \"1s\"\n", "busybox")
	m.WaitHealthy(t, n)
	ctx := context.Background()
	// Whatever the page made (its fork) goes before the node's leak
	// check, even when the browser test stopped half-way.
	t.Cleanup(func() {
		sbs, _, err := m.Server.Service.List(ctx, catalog.Query{})
		if err != nil {
			t.Errorf("list sandboxes at cleanup: %v", err)
			return
		}
		for _, sb := range sbs {
			if err := m.Server.Service.Kill(ctx, sb.ID); err != nil && !errdefs.IsNotFound(err) {
				t.Errorf("kill %s at cleanup: %v", sb.ID, err)
			}
		}
	})
	key := func(team string) string {
		if _, err := m.Admin.CreateTeam(ctx, &masterpb.CreateTeamRequest{Name: team}); err != nil {
			t.Fatal(err)
		}
		r, err := m.Admin.CreateAPIKey(ctx, &masterpb.CreateAPIKeyRequest{Name: team, Team: team})
		if err != nil {
			t.Fatal(err)
		}
		return r.Secret
	}
	keyA, keyB := key("team-a"), key("team-b")
	var sbB struct {
		SandboxID string `json:"sandboxID"`
	}
	b := m.API(keyB)
	if r := b.Do(t, "POST", "/v2/sandboxes", map[string]any{"templateID": "busybox", "timeout": 600}, &sbB); r.StatusCode != http.StatusCreated {
		t.Fatalf("team B create: %d %s", r.StatusCode, r.Body)
	}
	t.Cleanup(func() { b.Do(t, "DELETE", "/sandboxes/"+sbB.SandboxID, nil, nil) })

	cctx, cancel := context.WithTimeout(ctx, 8*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(cctx, node, filepath.Join(dir, "run.mjs"))
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "CUBE_OPS_URL=http://"+m.Server.OpsAddr, "CUBE_OPS_PASSWORD="+pw,
		"CUBE_KEY_A="+keyA, "CUBE_KEY_B="+keyB, "CUBE_SANDBOX_B="+sbB.SandboxID, "CUBE_TEMPLATE_SOURCE="+n.Env.Image, "CUBE_TEMPLATE_ARCHIVE="+tarDir(t, n.Env.Image), "CUBE_SCREENS="+screens, "CHROMIUM="+chromium)
	out, err := cmd.CombinedOutput()
	for _, l := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		t.Log(l)
	}
	if err != nil {
		t.Fatalf("browser test: %v (screenshots in %s)", err, screens)
	}
	t.Logf("screenshots in %s", screens)
}
