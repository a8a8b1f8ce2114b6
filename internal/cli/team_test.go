package cli_test

import (
	"bytes"
	"context"
	"net/http"
	"strings"
	"testing"

	cubeletpb "github.com/cubesandbox/cube/api/cubelet/v1"
	masterpb "github.com/cubesandbox/cube/api/master/v1"
	"github.com/cubesandbox/cube/internal/cli"
	"github.com/cubesandbox/cube/internal/master/mastertest"
)

// TestTeamDelete: `cubecli team delete` against a real cubemaster and
// cubelet. A team that holds sandboxes and a snapshot is refused
// (FailedPrecondition, the CLI's exit code for it) and keeps working: its
// key still lists its sandbox (the control for the revocation below).
// With --force the sandbox is killed on the node, the snapshot deleted,
// the key answers 401 and the team is gone; an audit line names the team,
// the caller and what was removed. An empty team is deleted without
// --force; "default" and an unknown team are refused.
func TestTeamDelete(t *testing.T) {
	m := mastertest.StartMaster(t, "")
	node := mastertest.StartNode(t, m, "busybox")
	m.WaitHealthy(t, node)
	run := func(args ...string) (string, string, int) {
		var out, errb bytes.Buffer
		code := cli.Main(append([]string{"--master", m.Socket}, args...), &out, &errb)
		return out.String(), errb.String(), code
	}
	if _, errOut, code := run("team", "create", "doomed"); code != 0 {
		t.Fatalf("team create: %d %s", code, errOut)
	}
	out, errOut, code := run("apikey", "create", "doomed-ci", "--team", "doomed")
	if code != 0 {
		t.Fatalf("apikey create: %d %s", code, errOut)
	}
	api := m.API(strings.TrimSpace(out))

	var sb struct {
		SandboxID string `json:"sandboxID"`
	}
	if r := api.Do(t, "POST", "/v2/sandboxes", map[string]any{"templateID": "busybox", "timeout": 300}, &sb); r.StatusCode != http.StatusCreated {
		t.Fatalf("create: %d %s", r.StatusCode, r.Body)
	}
	t.Cleanup(func() { _, _ = m.Server.Service.DeleteTeam(context.Background(), "doomed", true, "cleanup") })
	var snap struct {
		SnapshotID string `json:"snapshotID"`
	}
	if r := api.Do(t, "POST", "/sandboxes/"+sb.SandboxID+"/snapshots", map[string]any{"name": "keep"}, &snap); r.StatusCode != http.StatusCreated {
		t.Fatalf("snapshot: %d %s", r.StatusCode, r.Body)
	}
	// A second sandbox for --force to kill (the first is killed by hand
	// to show a snapshot alone also holds the team).
	var sb2 struct {
		SandboxID string `json:"sandboxID"`
	}
	if r := api.Do(t, "POST", "/v2/sandboxes", map[string]any{"templateID": "busybox", "timeout": 300}, &sb2); r.StatusCode != http.StatusCreated {
		t.Fatalf("create: %d %s", r.StatusCode, r.Body)
	}

	refused := func(what string) {
		t.Helper()
		_, errOut, code := run("team", "delete", "doomed")
		if code != cli.ExitFailedPrecondition || !strings.Contains(errOut, "force") {
			t.Fatalf("team delete while it holds %s: exit %d %q, want FailedPrecondition naming --force", what, code, errOut)
		}
		t.Logf("team delete while it holds %s: exit %d: %s", what, code, strings.TrimSpace(errOut))
		var list []map[string]any
		if r := api.Do(t, "GET", "/v2/sandboxes", nil, &list); r.StatusCode != http.StatusOK {
			t.Fatalf("control: the team's key after a refused delete: %d %s", r.StatusCode, r.Body)
		}
	}
	refused("2 sandboxes and a snapshot")
	if r := api.Do(t, "DELETE", "/sandboxes/"+sb.SandboxID, nil, nil); r.StatusCode != http.StatusNoContent {
		t.Fatalf("kill: %d %s", r.StatusCode, r.Body)
	}
	refused("a sandbox and a snapshot")

	out, errOut, code = run("team", "delete", "doomed", "--force", "-o", "json")
	if code != 0 {
		t.Fatalf("team delete --force: %d %s", code, errOut)
	}
	t.Logf("team delete --force: %s", strings.Join(strings.Fields(out), " "))
	if !strings.Contains(out, sb2.SandboxID) || !strings.Contains(out, snap.SnapshotID) {
		t.Fatalf("team delete --force did not report the sandbox %s and the snapshot %s:\n%s", sb2.SandboxID, snap.SnapshotID, out)
	}
	if r := api.Do(t, "GET", "/v2/sandboxes", nil, nil); r.StatusCode != http.StatusUnauthorized {
		t.Fatalf("the deleted team's key: %d %s, want 401", r.StatusCode, r.Body)
	}
	resp, err := m.Admin.ListSandboxes(context.Background(), &masterpb.ListSandboxesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range resp.Sandboxes {
		if s.Team == "doomed" {
			t.Fatalf("sandbox %s of the deleted team is still in the catalog", s.SandboxId)
		}
	}
	if _, err := node.Client.GetSandbox(context.Background(), &cubeletpb.GetSandboxRequest{SandboxId: sb2.SandboxID}); err == nil {
		t.Fatalf("sandbox %s of the deleted team still exists on the node", sb2.SandboxID)
	}
	if out, _, _ := run("team", "ls"); strings.Contains(out, "doomed") {
		t.Fatalf("team ls after the delete:\n%s", out)
	}
	logs := m.Logs()
	var audit string
	for _, l := range strings.Split(logs, "\n") {
		if strings.Contains(l, "msg=audit") && strings.Contains(l, `action="team delete"`) {
			audit = l
		}
	}
	if !strings.Contains(audit, "team=doomed") || !strings.Contains(audit, "revoked_keys=1") || !strings.Contains(audit, sb2.SandboxID) || !strings.Contains(audit, snap.SnapshotID) || !strings.Contains(audit, "by=") {
		t.Fatalf("no audit line for the team delete naming the team, key, sandbox and snapshot: %q", audit)
	}
	t.Logf("audit: %s", audit)

	// An empty team goes without --force; default and unknown teams do not.
	if _, _, code := run("team", "create", "empty"); code != 0 {
		t.Fatal("team create empty")
	}
	if out, errOut, code := run("team", "delete", "empty"); code != 0 || !strings.Contains(out, "0 keys revoked") {
		t.Fatalf("delete an empty team: %d %q %s", code, out, errOut)
	}
	if _, errOut, code := run("team", "delete", "default", "--force"); code != cli.ExitFailedPrecondition {
		t.Fatalf("delete the default team: %d %s", code, errOut)
	}
	if _, _, code := run("team", "delete", "nosuch"); code != cli.ExitNotFound {
		t.Fatalf("delete an unknown team: %d", code)
	}
}
