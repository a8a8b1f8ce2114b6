package opsapi_test

import (
	"archive/tar"
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	masterpb "github.com/cubesandbox/cube/api/master/v1"
	"github.com/cubesandbox/cube/internal/master/mastertest"
	"github.com/cubesandbox/cube/internal/master/opsapi"
	"github.com/cubesandbox/cube/internal/objstore/objstoretest"
)

type jobView struct {
	ID    string `json:"id"`
	Kind  string `json:"kind"`
	State string `json:"state"`
	Error string `json:"error"`
	Done  int    `json:"done"`
	Total int    `json:"total"`
	Steps []struct {
		Level string `json:"level"`
		Text  string `json:"text"`
	} `json:"steps"`
}

// waitJob polls a job until it ends.
func waitJob(t *testing.T, c *client, j jobView) jobView {
	t.Helper()
	mastertest.WaitFor(t, 3*time.Minute, "job "+j.Kind+" to end", func() bool {
		if code := c.do("GET", "/ops/api/jobs/"+j.ID, nil, &j); code != 200 {
			t.Fatalf("job %s: %d", j.ID, code)
		}
		return j.State != "running"
	})
	for _, s := range j.Steps {
		t.Logf("  %s: [%s] %s", j.Kind, s.Level, s.Text)
	}
	return j
}

// tarDir writes dir (an OCI layout) as a tar archive and returns its path.
func tarDir(t *testing.T, dir string) string {
	t.Helper()
	out := filepath.Join(t.TempDir(), "image.tar")
	f, err := os.Create(out)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	tw := tar.NewWriter(f)
	if err := tw.AddFS(os.DirFS(dir)); err != nil {
		t.Fatal(err)
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return out
}

// raw sends body as it is (no JSON) and returns the status and answer.
func (c *client) raw(method, path string, body []byte) (int, []byte) {
	c.t.Helper()
	req, _ := http.NewRequest(method, c.base+path, bytes.NewReader(body))
	if c.csrf != "" {
		req.Header.Set("X-CSRF-Token", c.csrf)
	}
	if c.key != "" {
		req.Header.Set("X-API-Key", c.key)
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		c.t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, b
}

// TestOpsAdmin drives the console's admin actions and the files browser
// over a real master and two nodes: every admin-only call refused to a
// team user (403) and, as the control, done by the admin; a template
// imported as a job whose steps follow it onto the node, warmed (a clear
// failure where the runtime cannot take memory snapshots), deleted; a
// node drained as a job (an empty node: done; a node whose sandbox no
// other node can take: refused, nothing changed); API keys and teams made
// and removed; files listed, uploaded and read in a sandbox, and refused
// for another team's; and the audit log, scoped to the team.
func TestOpsAdmin(t *testing.T) {
	const pw = "correct horse battery"
	hash, err := opsapi.HashPassword(pw)
	if err != nil {
		t.Fatal(err)
	}
	m := mastertest.StartMaster(t, fmt.Sprintf("[api]\nops = \"127.0.0.1:0\"\n[console]\nadmin_password_hash = %q\n", hash))
	// Moves (the drain) go through an object store.
	srv := objstoretest.Start(t)
	store := fmt.Sprintf("[usage]\ninterval = \"1s\"\n[store]\nendpoint = %q\nbucket = %q\naccess_key_file = %q\nsecret_key_file = %q\n",
		srv.Endpoint, srv.Bucket, srv.AccessKeyFile, srv.SecretKeyFile)
	n1 := mastertest.StartNodeConfig(t, m, store, "busybox")
	n2 := mastertest.StartNodeConfig(t, m, store)
	m.WaitHealthy(t, n1)
	m.WaitHealthy(t, n2)
	base := "http://" + m.Server.OpsAddr
	admin := newClient(t, base)
	var s struct{ CSRF string }
	if code := admin.do("POST", "/ops/api/login", map[string]string{"user": "admin", "password": pw}, &s); code != 200 {
		t.Fatalf("login: %d", code)
	}
	admin.csrf = s.CSRF
	ctx := context.Background()
	keyOf := func(team string) string {
		if _, err := m.Admin.CreateTeam(ctx, &masterpb.CreateTeamRequest{Name: team}); err != nil {
			t.Fatal(err)
		}
		resp, err := m.Admin.CreateAPIKey(ctx, &masterpb.CreateAPIKeyRequest{Name: team + "-key", Team: team})
		if err != nil {
			t.Fatal(err)
		}
		return resp.Secret
	}
	a, b := newClient(t, base), newClient(t, base)
	a.key, b.key = keyOf("team-a"), keyOf("team-b")

	t.Run("admin only", func(t *testing.T) {
		calls := []struct{ method, path string }{
			{"GET", "/ops/api/keys"}, {"POST", "/ops/api/keys"}, {"DELETE", "/ops/api/keys/x"},
			{"GET", "/ops/api/teams"}, {"POST", "/ops/api/teams"}, {"PUT", "/ops/api/teams/team-b/quota"}, {"DELETE", "/ops/api/teams/team-b"},
			{"POST", "/ops/api/templates"}, {"POST", "/ops/api/templates/busybox/warm"}, {"PUT", "/ops/api/templates/x/upload"}, {"DELETE", "/ops/api/templates/busybox"},
			{"POST", "/ops/api/nodes/" + n2.ID + "/drain"}, {"POST", "/ops/api/nodes/" + n2.ID + "/cordon"},
		}
		for _, c := range calls {
			if code := a.do(c.method, c.path, map[string]any{}, nil); code != 403 {
				t.Fatalf("team user %s %s: %d, want 403", c.method, c.path, code)
			}
		}
		t.Logf("refused to a team user (403): %d admin-only calls", len(calls))
		for _, p := range []string{"/ops/api/keys", "/ops/api/teams"} {
			if code := admin.do("GET", p, nil, nil); code != 200 {
				t.Fatalf("control: admin GET %s: %d", p, code)
			}
		}
		t.Log("control: the admin lists keys and teams")
	})

	t.Run("template import, warm, delete", func(t *testing.T) {
		var j jobView
		if code := admin.do("POST", "/ops/api/templates", map[string]any{"id": "imported", "source": n1.Env.Image, "nodeID": n1.ID}, &j); code != 202 || j.State != "running" {
			t.Fatalf("import: %d %+v", code, j)
		}
		j = waitJob(t, admin, j)
		if j.State != "done" || j.Done < 1 {
			t.Fatalf("import job: %+v", j)
		}
		onNode := false
		for _, s := range j.Steps {
			onNode = onNode || strings.Contains(s.Text, "on node "+n1.ID) || strings.Contains(s.Text, "imported: on")
		}
		if !onNode {
			t.Fatalf("the import's steps never showed the template on %s", n1.ID)
		}
		j = jobView{}
		if code := admin.do("POST", "/ops/api/templates/imported/warm", map[string]any{"runtime": "runc"}, &j); code != 202 {
			t.Fatalf("warm: %d", code)
		}
		j = waitJob(t, admin, j)
		if j.State != "failed" || !strings.Contains(j.Error, "cannot take memory snapshots") {
			t.Fatalf("warm on runc: %+v; want failed: cannot take memory snapshots", j)
		}
		t.Logf("warm on runc failed clearly: %s", j.Error)
		if code := admin.do("POST", "/ops/api/templates/nosuch/warm", nil, nil); code != 404 {
			t.Fatalf("warm of an unknown template: %d, want 404", code)
		}
		var del struct{ Nodes []string }
		if code := admin.do("DELETE", "/ops/api/templates/imported", nil, &del); code != 200 || len(del.Nodes) == 0 {
			t.Fatalf("delete: %d %+v", code, del)
		}
		mastertest.WaitFor(t, 10*time.Second, "the template gone", func() bool {
			var ts []struct{ ID string }
			admin.do("GET", "/ops/api/templates", nil, &ts)
			for _, tm := range ts {
				if tm.ID == "imported" {
					return false
				}
			}
			return true
		})
		if code := admin.do("DELETE", "/ops/api/templates/imported", nil, nil); code != 404 {
			t.Fatalf("a second delete: %d, want 404", code)
		}

		// An archive sent through the console.
		archive, err := os.ReadFile(tarDir(t, n1.Env.Image))
		if err != nil {
			t.Fatal(err)
		}
		code, body := admin.raw("PUT", "/ops/api/templates/uploaded/upload?nodeID="+n1.ID, archive)
		if code != 201 || !strings.Contains(string(body), `"stored":true`) || !strings.Contains(string(body), n1.ID) {
			t.Fatalf("upload: %d %s", code, body)
		}
		if code, body := admin.raw("PUT", "/ops/api/templates/broken/upload", []byte("not an archive")); code/100 == 2 {
			t.Fatalf("a broken archive: %d %s", code, body)
		} else {
			t.Logf("a broken archive refused: %d %s", code, body)
		}
		t.Logf("an archive of %d bytes uploaded and imported on %s", len(archive), n1.ID)
	})

	var sa sandbox
	if code := a.do("POST", "/ops/api/sandboxes", map[string]any{"template": "busybox"}, &sa); code != 201 {
		t.Fatalf("team A create: %d", code)
	}
	t.Cleanup(func() { a.do("POST", "/ops/api/sandboxes/"+sa.ID+"/kill", nil, nil) })

	t.Run("drain", func(t *testing.T) {
		var j jobView
		if code := admin.do("POST", "/ops/api/nodes/"+n1.ID+"/drain", map[string]any{}, &j); code != 202 {
			t.Fatalf("drain %s: %d", n1.ID, code)
		}
		j = waitJob(t, admin, j)
		if j.State != "failed" || !strings.Contains(j.Error, "refused") {
			t.Fatalf("drain of %s, whose sandbox's template no other node has: %+v; want refused", n1.ID, j)
		}
		var nodes []struct {
			ID          string `json:"id"`
			Schedulable bool   `json:"schedulable"`
		}
		admin.do("GET", "/ops/api/nodes", nil, &nodes)
		for _, n := range nodes {
			if n.ID == n1.ID && !n.Schedulable {
				t.Fatalf("a refused drain cordoned %s", n1.ID)
			}
		}
		t.Logf("refused, node left schedulable: %s", j.Error)
		j = jobView{}
		if code := admin.do("POST", "/ops/api/nodes/"+n2.ID+"/drain", nil, &j); code != 202 {
			t.Fatalf("drain %s: %d", n2.ID, code)
		}
		if j = waitJob(t, admin, j); j.State != "done" {
			t.Fatalf("control: drain of the empty %s: %+v", n2.ID, j)
		}
		admin.do("GET", "/ops/api/nodes", nil, &nodes)
		for _, n := range nodes {
			if n.ID == n2.ID && n.Schedulable {
				t.Fatalf("drained %s is schedulable", n2.ID)
			}
		}
		if code := admin.do("POST", "/ops/api/nodes/"+n2.ID+"/uncordon", nil, nil); code != 204 {
			t.Fatalf("uncordon: %d", code)
		}
		t.Logf("control: the empty %s drained (cordoned), then uncordoned", n2.ID)

		// With the template on n2 too, n1's drain moves team A's sandbox
		// there, step by step.
		j = jobView{}
		if code := admin.do("POST", "/ops/api/templates", map[string]any{"id": "busybox", "source": n1.Env.Image, "nodeID": n2.ID}, &j); code != 202 {
			t.Fatalf("import busybox on %s: %d", n2.ID, code)
		}
		if j = waitJob(t, admin, j); j.State != "done" {
			t.Fatalf("import busybox on %s: %+v", n2.ID, j)
		}
		j = jobView{}
		if code := admin.do("POST", "/ops/api/nodes/"+n1.ID+"/drain", nil, &j); code != 202 {
			t.Fatalf("drain %s: %d", n1.ID, code)
		}
		j = waitJob(t, admin, j)
		moved := false
		for _, s := range j.Steps {
			moved = moved || strings.Contains(s.Text, sa.ID+": moved to "+n2.ID)
		}
		if j.State != "done" || !moved || j.Done != 1 || j.Total != 1 {
			t.Fatalf("drain of %s: %+v; want %s moved to %s", n1.ID, j, sa.ID, n2.ID)
		}
		var where struct {
			NodeID string `json:"nodeID"`
			State  string `json:"state"`
		}
		a.do("GET", "/ops/api/sandboxes/"+sa.ID, nil, &where)
		if where.NodeID != n2.ID || where.State != "running" {
			t.Fatalf("after the drain %s is %s on %s", sa.ID, where.State, where.NodeID)
		}
		if code := admin.do("POST", "/ops/api/nodes/"+n1.ID+"/uncordon", nil, nil); code != 204 {
			t.Fatalf("uncordon: %d", code)
		}
		t.Logf("%s drained: %s moved to %s and runs there", n1.ID, sa.ID, n2.ID)
	})

	t.Run("keys and teams", func(t *testing.T) {
		if code := admin.do("POST", "/ops/api/teams", map[string]any{"name": "team-c", "quota": map[string]any{"maxSandboxes": 2}}, nil); code != 201 {
			t.Fatalf("create team: %d", code)
		}
		if code := admin.do("POST", "/ops/api/teams", map[string]any{"name": "Bad Name"}, nil); code != 400 {
			t.Fatalf("a bad team name: %d, want 400", code)
		}
		var k struct{ ID, Secret, Team string }
		if code := admin.do("POST", "/ops/api/keys", map[string]any{"name": "c-key", "team": "team-c"}, &k); code != 201 || !strings.HasPrefix(k.Secret, "e2b_") || k.Team != "team-c" {
			t.Fatalf("create key: %d %+v", code, k)
		}
		c := newClient(t, base)
		c.key = k.Secret
		if code := c.do("GET", "/ops/api/sandboxes", nil, nil); code != 200 {
			t.Fatalf("the new key: %d", code)
		}
		var keys []struct{ ID, Secret string }
		admin.do("GET", "/ops/api/keys", nil, &keys)
		for _, kk := range keys {
			if kk.Secret != "" {
				t.Fatalf("the key list shows a secret: %+v", kk)
			}
		}
		if code := admin.do("PUT", "/ops/api/teams/team-c/quota", map[string]any{"maxSandboxes": 5}, nil); code != 204 {
			t.Fatalf("quota: %d", code)
		}
		var teams []struct {
			Name  string
			Keys  int
			Quota struct{ MaxSandboxes int64 }
		}
		admin.do("GET", "/ops/api/teams", nil, &teams)
		found := false
		for _, tm := range teams {
			if tm.Name == "team-c" {
				found = tm.Keys == 1 && tm.Quota.MaxSandboxes == 5
			}
		}
		if !found {
			t.Fatalf("teams: %+v", teams)
		}
		if code := admin.do("DELETE", "/ops/api/keys/"+k.ID, nil, nil); code != 204 {
			t.Fatalf("revoke: %d", code)
		}
		mastertest.WaitFor(t, time.Minute, "the revoked key refused", func() bool { return c.do("GET", "/ops/api/sandboxes", nil, nil) == 401 })
		if code := admin.do("DELETE", "/ops/api/teams/team-c", nil, nil); code != 200 {
			t.Fatalf("delete team: %d", code)
		}
		if code := admin.do("DELETE", "/ops/api/teams/default", nil, nil); code != 409 {
			t.Fatalf("delete the default team: %d, want 409", code)
		}
		t.Log("team made, key made and used, quota set, key revoked (refused after), team deleted; the default team refused")
	})

	t.Run("files", func(t *testing.T) {
		content := []byte("hello from the console\n")
		if code, body := a.raw("PUT", "/ops/api/sandboxes/"+sa.ID+"/file?path=/tmp/up/hello.txt", content); code != 204 {
			t.Fatalf("upload: %d %s", code, body)
		}
		var files []struct{ Name, Type, Path string }
		if code := a.do("GET", "/ops/api/sandboxes/"+sa.ID+"/files?path=/tmp/up", nil, &files); code != 200 || len(files) != 1 || files[0].Name != "hello.txt" || files[0].Type != "file" {
			t.Fatalf("list: %d %+v", code, files)
		}
		code, got := a.raw("GET", "/ops/api/sandboxes/"+sa.ID+"/file?path=/tmp/up/hello.txt", nil)
		if code != 200 || !bytes.Equal(got, content) {
			t.Fatalf("read: %d %q", code, got)
		}
		if code := a.do("GET", "/ops/api/sandboxes/"+sa.ID+"/file?path=/tmp/up/nosuch", nil, nil); code != 404 {
			t.Fatalf("read a missing file: %d, want 404", code)
		}
		if code := a.do("GET", "/ops/api/sandboxes/"+sa.ID+"/files?path=relative", nil, nil); code != 400 {
			t.Fatalf("a relative path: %d, want 400", code)
		}
		t.Log("team A uploaded, listed and read a file in its sandbox")
		if code, _ := b.raw("PUT", "/ops/api/sandboxes/"+sa.ID+"/file?path=/tmp/up/evil.txt", []byte("x")); code != 404 {
			t.Fatalf("team B uploads into team A's sandbox: %d, want 404", code)
		}
		for _, p := range []string{"/files?path=/tmp/up", "/file?path=/tmp/up/hello.txt"} {
			if code := b.do("GET", "/ops/api/sandboxes/"+sa.ID+p, nil, nil); code != 404 {
				t.Fatalf("team B GET %s of team A's sandbox: %d, want 404", p, code)
			}
		}
		if code := a.do("GET", "/ops/api/sandboxes/"+sa.ID+"/files?path=/tmp/up", nil, &files); code != 200 || len(files) != 1 {
			t.Fatalf("after team B's tries: %d %+v", code, files)
		}
		t.Log("refused (404): team B listing, reading, uploading into team A's sandbox; its directory unchanged")
	})

	t.Run("fork", func(t *testing.T) {
		if code := b.do("POST", "/ops/api/sandboxes/"+sa.ID+"/fork", map[string]any{"count": 1}, nil); code != 404 {
			t.Fatalf("team B forks team A's sandbox: %d, want 404", code)
		}
		if code := a.do("POST", "/ops/api/sandboxes/"+sa.ID+"/fork", map[string]any{"count": 11}, nil); code != 400 {
			t.Fatalf("11 forks: %d, want 400", code)
		}
		var f struct {
			Sandboxes []sandbox `json:"sandboxes"`
			Errors    []string  `json:"errors"`
		}
		if code := a.do("POST", "/ops/api/sandboxes/"+sa.ID+"/fork", map[string]any{"count": 1}, &f); code != 201 || len(f.Sandboxes) != 1 || len(f.Errors) != 0 {
			t.Fatalf("control: team A forks its sandbox: %d %+v", code, f)
		}
		child := f.Sandboxes[0]
		t.Cleanup(func() { a.do("POST", "/ops/api/sandboxes/"+child.ID+"/kill", nil, nil) })
		if child.Team != "team-a" || child.State != "running" {
			t.Fatalf("fork: %+v", child)
		}
		// The fork holds the parent's files.
		code, got := a.raw("GET", "/ops/api/sandboxes/"+child.ID+"/file?path=/tmp/up/hello.txt", nil)
		if code != 200 || string(got) != "hello from the console\n" {
			t.Fatalf("the fork's copy of hello.txt: %d %q", code, got)
		}
		t.Logf("refused: team B forking team A's sandbox; control: team A forked it into %s, which holds its files", child.ID)

		// The fork's live stream: the sandbox, its samples as the node
		// takes them, its pause, and its end.
		if code := b.do("GET", "/ops/api/sandboxes/"+child.ID+"/live", nil, nil); code != 404 {
			t.Fatalf("team B's live stream of team A's sandbox: %d, want 404", code)
		}
		sctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		req, _ := http.NewRequestWithContext(sctx, "GET", base+"/ops/api/sandboxes/"+child.ID+"/live", nil)
		req.Header.Set("X-API-Key", a.key)
		resp, err := a.hc.Do(req) //nolint:bodyclose // closed below
		if err != nil || resp.StatusCode != 200 {
			t.Fatalf("live: %v %v", err, resp)
		}
		defer resp.Body.Close()
		type event struct{ name, data string }
		events := make(chan event, 64)
		go func() {
			defer close(events)
			sc := bufio.NewScanner(resp.Body)
			sc.Buffer(make([]byte, 1<<20), 1<<20)
			var name string
			for sc.Scan() {
				if v, ok := strings.CutPrefix(sc.Text(), "event: "); ok {
					name = v
				} else if v, ok := strings.CutPrefix(sc.Text(), "data: "); ok {
					events <- event{name, v}
				}
			}
		}()
		next := func(want string) event {
			t.Helper()
			for e := range events {
				if e.name == want {
					return e
				}
			}
			t.Fatalf("the stream ended before a %q event", want)
			return event{}
		}
		if e := next("sandbox"); !strings.Contains(e.data, `"state":"running"`) {
			t.Fatalf("first sandbox event: %s", e.data)
		}
		var first, later []struct{ T int64 }
		_ = json.Unmarshal([]byte(next("metrics").data), &first)
		_ = json.Unmarshal([]byte(next("metrics").data), &later)
		if len(first) == 0 || len(later) == 0 || later[0].T <= first[len(first)-1].T {
			t.Fatalf("samples: %v then %v; want new ones after the first", first, later)
		}
		if code := a.do("POST", "/ops/api/sandboxes/"+child.ID+"/pause", nil, nil); code != 204 {
			t.Fatalf("pause: %d", code)
		}
		for e := next("sandbox"); !strings.Contains(e.data, `"state":"paused"`); e = next("sandbox") {
		}
		if code := a.do("POST", "/ops/api/sandboxes/"+child.ID+"/kill", nil, nil); code != 204 {
			t.Fatalf("kill: %d", code)
		}
		next("gone")
		t.Logf("live stream of %s: the sandbox, %d samples then %d more as taken, paused, gone", child.ID, len(first), len(later))
	})

	t.Run("events", func(t *testing.T) {
		type ev struct {
			Seq    uint64 `json:"seq"`
			Team   string `json:"team"`
			Action string `json:"action"`
			Target string `json:"target"`
			OK     bool   `json:"ok"`
		}
		has := func(es []ev, action, target string) bool {
			for _, e := range es {
				if e.Action == action && e.Target == target {
					return true
				}
			}
			return false
		}
		var all, ofA, ofB []ev
		admin.do("GET", "/ops/api/events?limit=500", nil, &all)
		a.do("GET", "/ops/api/events?limit=500", nil, &ofA)
		b.do("GET", "/ops/api/events?limit=500", nil, &ofB)
		for _, want := range [][2]string{{"template import done", "imported"}, {"template upload", "uploaded"}, {"template warm failed", "imported"}, {"template delete", "imported"},
			{"drain failed", n1.ID}, {"drain done", n2.ID}, {"drain done", n1.ID}, {"api key create", "c-key"}, {"team delete", "team-c"}, {"create", sa.ID}} {
			if !has(all, want[0], want[1]) {
				t.Errorf("the admin's audit log has no %q of %s", want[0], want[1])
			}
		}
		if !has(ofA, "create", sa.ID) || !has(ofA, "file upload", sa.ID+":/tmp/up/hello.txt") {
			t.Errorf("team A's log lacks its create or upload: %+v", ofA)
		}
		for _, e := range ofB {
			if e.Team != "team-b" {
				t.Errorf("team B sees an entry of %q: %+v", e.Team, e)
			}
		}
		for _, e := range ofA {
			if e.Team != "team-a" {
				t.Errorf("team A sees an entry of %q: %+v", e.Team, e)
			}
		}
		if len(all) < 2 {
			t.Fatalf("%d entries", len(all))
		}
		var page []ev
		admin.do("GET", fmt.Sprintf("/ops/api/events?limit=1&before=%d", all[0].Seq), nil, &page)
		if len(page) != 1 || page[0].Seq != all[1].Seq {
			t.Errorf("the page before %d: %+v, want %d", all[0].Seq, page, all[1].Seq)
		}
		t.Logf("audit log: %d entries for the admin, %d for team A, %d for team B (its own only)", len(all), len(ofA), len(ofB))
	})
}
