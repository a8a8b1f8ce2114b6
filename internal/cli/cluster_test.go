package cli_test

import (
	"bytes"
	"context"
	"encoding/json"
	"strings"
	"testing"

	"github.com/cubesandbox/cube/internal/cli"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/master"
	"github.com/cubesandbox/cube/internal/master/mastertest"
)

// TestClusterCLI drives the cluster commands against a real cubemaster
// and a real cubelet registered with it.
func TestClusterCLI(t *testing.T) {
	m := mastertest.StartMaster(t, "")
	node := mastertest.StartNode(t, m, "busybox")
	m.WaitHealthy(t, node)
	run := func(args ...string) (string, string, int) {
		var out, errb bytes.Buffer
		code := cli.Main(append([]string{"--master", m.Socket, "--addr", node.Env.Config.API.Socket}, args...), &out, &errb)
		return out.String(), errb.String(), code
	}

	out, errOut, code := run("apikey", "create", "ci")
	secret := strings.TrimSpace(out)
	if code != 0 || !strings.HasPrefix(secret, "e2b_") {
		t.Fatalf("apikey create: %d %q %s", code, out, errOut)
	}
	if _, err := m.Server.Service.VerifyAPIKey(context.Background(), secret); err != nil {
		t.Fatalf("created key does not verify: %v", err)
	}
	if _, _, code := run("apikey", "create", "ci"); code != cli.ExitAlreadyExists {
		t.Fatalf("duplicate key name: %d", code)
	}
	out, _, _ = run("apikey", "ls")
	if !strings.Contains(out, "ci") || strings.Contains(out, secret) {
		t.Fatalf("apikey ls shows the secret or misses the key:\n%s", out)
	}

	// Teams: create with a quota, list (table and JSON), change the quota,
	// and keys that belong to a team.
	if out, errOut, code := run("team", "create", "acme", "--max-sandboxes", "2", "--max-vcpu", "4", "--max-memory-mib", "1024"); code != 0 || strings.TrimSpace(out) != "acme" {
		t.Fatalf("team create: %d %q %s", code, out, errOut)
	}
	if _, _, code := run("team", "create", "acme"); code != cli.ExitAlreadyExists {
		t.Fatalf("duplicate team: %d", code)
	}
	if _, _, code := run("team", "create", "Bad Name"); code != cli.ExitUsage {
		t.Fatalf("bad team name: %d", code)
	}
	out, _, _ = run("team", "ls")
	if !strings.Contains(out, "default") || !strings.Contains(out, "acme") || !strings.Contains(out, "0/2") || !strings.Contains(out, "0MiB/1024MiB") {
		t.Fatalf("team ls:\n%s", out)
	}
	if _, _, code := run("team", "quota", "acme", "--max-sandboxes", "5"); code != 0 {
		t.Fatalf("team quota: %d", code)
	}
	out, _, _ = run("team", "ls", "-o", "json")
	var teams struct {
		Teams []struct {
			Name  string
			Quota struct{ MaxSandboxes string }
		}
	}
	if err := json.Unmarshal([]byte(out), &teams); err != nil || len(teams.Teams) != 2 || teams.Teams[0].Name != "acme" || teams.Teams[0].Quota.MaxSandboxes != "5" {
		t.Fatalf("team ls -o json (%v):\n%s", err, out)
	}
	out, _, code = run("apikey", "create", "acme-ci", "--team", "acme")
	key, err := m.Server.Service.VerifyAPIKey(context.Background(), strings.TrimSpace(out))
	if code != 0 || err != nil || key.Team != "acme" {
		t.Fatalf("apikey create --team: %d %+v %v", code, key, err)
	}
	if _, _, code := run("apikey", "create", "lost", "--team", "nosuch"); code != cli.ExitNotFound {
		t.Fatalf("key for an unknown team: %d", code)
	}
	if out, _, _ = run("apikey", "ls"); !strings.Contains(out, "acme-ci") || !strings.Contains(out, "TEAM") {
		t.Fatalf("apikey ls:\n%s", out)
	}

	out, _, code = run("node", "ls")
	if code != 0 || !strings.Contains(out, node.ID) || !strings.Contains(out, "healthy") {
		t.Fatalf("node ls: %d\n%s", code, out)
	}
	if out, _, code = run("node", "cordon", node.ID); code != 0 || !strings.Contains(out, "cordoned") {
		t.Fatalf("cordon: %d\n%s", code, out)
	}
	if _, _, code = run("node", "uncordon", node.ID); code != 0 {
		t.Fatalf("uncordon: %d", code)
	}
	if _, _, code = run("node", "cordon", "nosuchnode"); code != cli.ExitNotFound {
		t.Fatalf("cordon unknown: %d", code)
	}

	sb, err := m.Server.Service.Create(context.Background(), master.CreateRequest{Template: "busybox", Metadata: map[string]string{"team": "a"}})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := m.Server.Service.Kill(context.Background(), sb.ID); err != nil && !errdefs.IsNotFound(err) {
			t.Errorf("kill %s: %v", sb.ID, err)
		}
	}()
	out, _, code = run("sandbox", "ls", "--all-nodes", "-l", "team=a")
	if code != 0 || !strings.Contains(out, sb.ID) || !strings.Contains(out, node.ID) || !strings.Contains(out, "team=a") || !strings.Contains(out, "default") {
		t.Fatalf("sandbox ls --all-nodes: %d\n%s", code, out)
	}
	// Drain: the only node, so nothing can take the sandbox: refused
	// (exit 5, naming why) and the node left schedulable; an unknown
	// node is not found. (Moves: internal/master TestDrain, test/cluster.)
	_, errOut, code = run("node", "drain", node.ID)
	if code != cli.ExitFailedPrecondition || !strings.Contains(errOut, "no other node can take sandbox "+sb.ID) {
		t.Fatalf("drain of the only node: %d %s", code, errOut)
	}
	if v := m.Node(t, node.ID); !v.Schedulable {
		t.Fatalf("a refused drain cordoned %s", node.ID)
	}
	if _, _, code = run("node", "drain", "nosuchnode"); code != cli.ExitNotFound {
		t.Fatalf("drain unknown: %d", code)
	}
	out, _, _ = run("sandbox", "ls", "--all-nodes", "-l", "team=b", "-o", "json")
	var empty struct{ Sandboxes []any }
	if json.Unmarshal([]byte(out), &empty) != nil || len(empty.Sandboxes) != 0 {
		t.Fatalf("filtered list: %s", out)
	}

	if out, _, code = run("template", "import", "--all-nodes", "second", node.Env.Image); code != 0 || !strings.Contains(out, node.ID) {
		t.Fatalf("template import --all-nodes: %d\n%s", code, out)
	}
	out, _, _ = run("template", "ls", "--all-nodes")
	if !strings.Contains(out, "second") || !strings.Contains(out, "busybox") {
		t.Fatalf("template ls --all-nodes:\n%s", out)
	}
	if _, _, code = run("template", "rm", "--all-nodes", "busybox"); code != cli.ExitFailedPrecondition {
		t.Fatalf("rm a template in use: %d", code)
	}
	if out, _, code = run("template", "rm", "--all-nodes", "second"); code != 0 || !strings.Contains(out, node.ID) {
		t.Fatalf("template rm --all-nodes: %d %s", code, out)
	}
	// The node command without --all-nodes still talks to the cubelet.
	if out, _, _ = run("template", "ls"); strings.Contains(out, "second") {
		t.Fatalf("template still on the node:\n%s", out)
	}
	// --upload sends a layout directory of the caller's to the master,
	// tarred on the way; --source-on-nodes is the per-node import.
	if out, errOut, code = run("template", "import", "--all-nodes", "--upload", "up", node.Env.Image); code != 0 || !strings.Contains(out, node.ID) {
		t.Fatalf("template import --all-nodes --upload: %d\n%s%s", code, out, errOut)
	}
	if _, err := m.Server.Service.TemplateStore().Get("up"); err != nil {
		t.Fatalf("uploaded template not stored: %v", err)
	}
	if out, errOut, code = run("template", "import", "--all-nodes", "--source-on-nodes", "pernode", node.Env.Image); code != 0 || !strings.Contains(out, node.ID) {
		t.Fatalf("template import --all-nodes --source-on-nodes: %d\n%s%s", code, out, errOut)
	}
	if _, err := m.Server.Service.TemplateStore().Get("pernode"); err == nil {
		t.Fatal("--source-on-nodes put the template in the store")
	}
	for _, id := range []string{"up", "pernode"} {
		if out, _, code = run("template", "rm", "--all-nodes", id); code != 0 || !strings.Contains(out, node.ID) {
			t.Fatalf("template rm --all-nodes %s: %d %s", id, code, out)
		}
	}

	if _, _, code = run("apikey", "rm", "ci"); code != 0 {
		t.Fatalf("apikey rm: %d", code)
	}
	if _, _, code = run("apikey", "rm", "ci"); code != cli.ExitNotFound {
		t.Fatalf("apikey rm twice: %d", code)
	}
	var outb, errb bytes.Buffer
	if code := cli.Main([]string{"--master", "/nonexistent.sock", "--timeout", "1s", "node", "ls"}, &outb, &errb); code != cli.ExitUnavailable {
		t.Fatalf("unreachable master: %d %s", code, errb.String())
	}
}
