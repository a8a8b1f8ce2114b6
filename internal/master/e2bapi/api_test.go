package e2bapi_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	masterpb "github.com/cubesandbox/cube/api/master/v1"
	"github.com/cubesandbox/cube/internal/master/mastertest"
	"github.com/cubesandbox/cube/internal/proxy"
)

// Shapes the SDK reads (a subset, decoded loosely on purpose: the test
// checks the field names the SDK uses).
type sandboxResp struct {
	SandboxID          string  `json:"sandboxID"`
	TemplateID         string  `json:"templateID"`
	Alias              string  `json:"alias"`
	ClientID           string  `json:"clientID"`
	EnvdVersion        string  `json:"envdVersion"`
	EnvdAccessToken    string  `json:"envdAccessToken"`
	TrafficAccessToken *string `json:"trafficAccessToken"`
	Domain             *string `json:"domain"`
}

type listed struct {
	SandboxID  string            `json:"sandboxID"`
	TemplateID string            `json:"templateID"`
	State      string            `json:"state"`
	Metadata   map[string]string `json:"metadata"`
	StartedAt  time.Time         `json:"startedAt"`
	EndAt      time.Time         `json:"endAt"`
	CPUCount   int               `json:"cpuCount"`
	MemoryMB   int               `json:"memoryMB"`
	Lifecycle  *struct {
		OnTimeout  string `json:"onTimeout"`
		AutoResume bool   `json:"autoResume"`
	} `json:"lifecycle"`
}

// TestE2BAPI drives the REST API of a real master over a real cubelet, the
// way the e2b SDK does.
func TestE2BAPI(t *testing.T) {
	m := mastertest.StartMaster(t, "")
	node := mastertest.StartNode(t, m, "busybox")
	m.WaitHealthy(t, node)
	key := m.APIKey(t)
	c := m.API(key)

	var ids []string
	create := func(t *testing.T, body any) sandboxResp {
		t.Helper()
		var sb sandboxResp
		if r := c.Do(t, "POST", "/v2/sandboxes", body, &sb); r.StatusCode != http.StatusCreated {
			t.Fatalf("create: %d %s", r.StatusCode, r.Body)
		}
		ids = append(ids, sb.SandboxID)
		return sb
	}
	get := func(t *testing.T, id string) (listed, int) {
		t.Helper()
		var d listed
		r := c.Do(t, "GET", "/sandboxes/"+id, nil, &d)
		return d, r.StatusCode
	}

	t.Run("health needs no key", func(t *testing.T) {
		if r := m.API("").Do(t, "GET", "/health", nil, nil); r.StatusCode != 200 {
			t.Fatalf("%d %s", r.StatusCode, r.Body)
		}
	})

	t.Run("auth", func(t *testing.T) {
		for _, k := range []string{"", "e2b_0000000000000000000000000000000000000000", "garbage"} {
			r := m.API(k).Do(t, "GET", "/v2/sandboxes", nil, nil)
			if code, msg := r.Error(); r.StatusCode != 401 || code != 401 || msg == "" {
				t.Errorf("key %q: %d %s", k, r.StatusCode, r.Body)
			}
		}
	})

	var first sandboxResp
	t.Run("create with the default template alias", func(t *testing.T) {
		start := time.Now()
		first = create(t, map[string]any{
			"templateID": "base", "timeout": 300,
			"metadata": map[string]string{"user": "alice", "app": "prod"},
			"envVars":  map[string]string{"GREETING": "hi"},
		})
		t.Logf("create took %s", time.Since(start))
		if first.SandboxID == "" || first.TemplateID != "busybox" || first.Alias != "base" || first.ClientID != node.ID ||
			first.EnvdVersion == "" || first.EnvdAccessToken == "" || first.Domain == nil || *first.Domain != "cube.test" ||
			first.TrafficAccessToken != nil {
			t.Fatalf("create response: %+v", first)
		}
		d, code := get(t, first.SandboxID)
		if code != 200 || d.State != "running" || d.Metadata["user"] != "alice" || d.CPUCount != 1 || d.MemoryMB != 64 ||
			d.Lifecycle == nil || d.Lifecycle.OnTimeout != "kill" {
			t.Fatalf("get: %d %+v", code, d)
		}
		if left := time.Until(d.EndAt); left < 290*time.Second || left > 301*time.Second {
			t.Fatalf("endAt %s is %s away, want ~300s", d.EndAt, left)
		}
	})

	t.Run("the route reaches the agent", func(t *testing.T) {
		route := "http://" + m.Server.ProxyAddr
		// do returns the status code; the body is drained and closed.
		do := func(method, path, tok string, host string) int {
			req, _ := http.NewRequest(method, route+path, strings.NewReader("{}"))
			if host != "" {
				req.Host = host
			} else {
				req.Header.Set(proxy.HeaderSandboxID, first.SandboxID)
				req.Header.Set(proxy.HeaderSandboxPort, "49983")
			}
			req.Header.Set("Content-Type", "application/json")
			if tok != "" {
				req.Header.Set("X-Access-Token", tok)
			}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			if _, err := io.Copy(io.Discard, resp.Body); err != nil {
				t.Fatal(err)
			}
			return resp.StatusCode
		}
		if code := do("GET", "/health", "", ""); code != http.StatusNoContent {
			t.Fatalf("health by headers: %d", code)
		}
		if code := do("GET", "/health", "", "49983-"+first.SandboxID+".cube.test"); code != http.StatusNoContent {
			t.Fatalf("health by host: %d", code)
		}
		// The access token the master handed to the agent is enforced.
		if code := do("GET", "/envs", "", ""); code != http.StatusUnauthorized {
			t.Fatalf("envs without token: %d", code)
		}
		if code := do("GET", "/envs", first.EnvdAccessToken, ""); code != http.StatusOK {
			t.Fatalf("envs with token: %d", code)
		}
		if code := do("GET", "/_cube/info", first.EnvdAccessToken, ""); code == http.StatusOK {
			t.Fatal("internal agent endpoint reachable through the route")
		}
	})

	t.Run("list, filters and paging", func(t *testing.T) {
		for i := range 4 {
			create(t, map[string]any{"templateID": "busybox", "metadata": map[string]string{"user": "bob", "n": fmt.Sprint(i)}})
		}
		var all []listed
		if r := c.Do(t, "GET", "/v2/sandboxes", nil, &all); r.StatusCode != 200 || len(all) != 5 {
			t.Fatalf("list: %d %d", r.StatusCode, len(all))
		}
		if !all[0].StartedAt.After(all[4].StartedAt) {
			t.Error("default order is not newest first")
		}
		seen := map[string]bool{}
		tok, pages := "", 0
		for {
			var page []listed
			path := "/v2/sandboxes?limit=2"
			if tok != "" {
				path += "&nextToken=" + url.QueryEscape(tok)
			}
			r := c.Do(t, "GET", path, nil, &page)
			if r.StatusCode != 200 || len(page) > 2 {
				t.Fatalf("page: %d %d", r.StatusCode, len(page))
			}
			pages++
			for _, s := range page {
				seen[s.SandboxID] = true
			}
			if tok = r.Header.Get("X-Next-Token"); tok == "" {
				break
			}
		}
		if len(seen) != 5 || pages != 3 {
			t.Fatalf("paging: %d sandboxes in %d pages", len(seen), pages)
		}
		// The SDK double-encodes metadata: pairs URL-encoded, then the query.
		md := url.Values{"user": {"bob"}, "n": {"2"}}.Encode()
		var got []listed
		c.Do(t, "GET", "/v2/sandboxes?metadata="+url.QueryEscape(md), nil, &got)
		if len(got) != 1 || got[0].Metadata["n"] != "2" {
			t.Fatalf("metadata filter: %+v", got)
		}
		var v1 []listed
		c.Do(t, "GET", "/sandboxes?metadata="+url.QueryEscape("user=alice"), nil, &v1)
		if len(v1) != 1 || v1[0].SandboxID != first.SandboxID {
			t.Fatalf("v1 list: %+v", v1)
		}
		for _, bad := range []string{"limit=0", "limit=101", "state=dead", "order=up", "nextToken=%21%21", "startedAfter=yesterday"} {
			if r := c.Do(t, "GET", "/v2/sandboxes?"+bad, nil, nil); r.StatusCode != 400 {
				t.Errorf("%s: %d %s", bad, r.StatusCode, r.Body)
			}
		}
	})

	t.Run("pause, connect, resume", func(t *testing.T) {
		id := first.SandboxID
		if r := c.Do(t, "POST", "/sandboxes/"+id+"/pause", nil, nil); r.StatusCode != 204 {
			t.Fatalf("pause: %d %s", r.StatusCode, r.Body)
		}
		if r := c.Do(t, "POST", "/sandboxes/"+id+"/pause", nil, nil); r.StatusCode != 409 {
			t.Fatalf("second pause: %d %s", r.StatusCode, r.Body)
		}
		if d, _ := get(t, id); d.State != "paused" {
			t.Fatalf("state %s", d.State)
		}
		var paused []listed
		c.Do(t, "GET", "/v2/sandboxes?state=paused", nil, &paused)
		if len(paused) != 1 || paused[0].SandboxID != id {
			t.Fatalf("paused filter: %+v", paused)
		}
		req, _ := http.NewRequest("GET", "http://"+m.Server.ProxyAddr+"/health", nil)
		req.Host = "49983-" + id + ".cube.test"
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatalf("route to a paused sandbox: %v", err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusBadGateway { // what the SDKs read as not running
			t.Fatalf("route to a paused sandbox: %v", resp)
		}
		var sb sandboxResp
		if r := c.Do(t, "POST", "/v2/sandboxes/"+id+"/connect", map[string]any{"timeout": 60}, &sb); r.StatusCode != 201 || sb.SandboxID != id {
			t.Fatalf("connect to paused: %d %s", r.StatusCode, r.Body)
		}
		d, _ := get(t, id)
		if d.State != "running" || time.Until(d.EndAt) > 61*time.Second {
			t.Fatalf("after connect: %+v", d)
		}
		// Connect extends, never shortens.
		c.Do(t, "POST", "/sandboxes/"+id+"/timeout", map[string]any{"timeout": 600}, nil)
		if r := c.Do(t, "POST", "/v2/sandboxes/"+id+"/connect", map[string]any{"timeout": 10}, &sb); r.StatusCode != 200 {
			t.Fatalf("connect to running: %d %s", r.StatusCode, r.Body)
		}
		if d, _ := get(t, id); time.Until(d.EndAt) < 590*time.Second {
			t.Fatalf("connect shortened the deadline: %s", time.Until(d.EndAt))
		}
		// v1 resume: 409 while running, 201 once paused.
		if r := c.Do(t, "POST", "/sandboxes/"+id+"/resume", map[string]any{"timeout": 30}, nil); r.StatusCode != 409 {
			t.Fatalf("resume running: %d %s", r.StatusCode, r.Body)
		}
		c.Do(t, "POST", "/sandboxes/"+id+"/pause", nil, nil)
		// A paused sandbox has no timeout to set (E2B: 404; SDK 2.0's
		// connect resumes on it); a running one takes it ("deadlines").
		if r := c.Do(t, "POST", "/sandboxes/"+id+"/timeout", map[string]any{"timeout": 60}, nil); r.StatusCode != 404 {
			t.Fatalf("timeout of a paused sandbox: %d %s", r.StatusCode, r.Body)
		}
		if r := c.Do(t, "POST", "/sandboxes/"+id+"/resume", map[string]any{"timeout": 30}, &sb); r.StatusCode != 201 {
			t.Fatalf("resume paused: %d %s", r.StatusCode, r.Body)
		}
		if r := c.Do(t, "POST", "/sandboxes/"+id+"/refreshes", map[string]any{"duration": 120}, nil); r.StatusCode != 204 {
			t.Fatalf("refresh: %d", r.StatusCode)
		}
		if d, _ := get(t, id); time.Until(d.EndAt) < 110*time.Second {
			t.Fatalf("refresh did not extend: %s", time.Until(d.EndAt))
		}
	})

	t.Run("deadlines", func(t *testing.T) {
		kill := create(t, map[string]any{"templateID": "busybox", "timeout": 300})
		if r := c.Do(t, "POST", "/sandboxes/"+kill.SandboxID+"/timeout", map[string]any{"timeout": 1}, nil); r.StatusCode != 204 {
			t.Fatalf("timeout: %d %s", r.StatusCode, r.Body)
		}
		pause := create(t, map[string]any{"templateID": "busybox", "timeout": 1, "autoPause": true})
		if d, _ := get(t, pause.SandboxID); d.Lifecycle.OnTimeout != "pause" {
			t.Fatalf("lifecycle: %+v", d.Lifecycle)
		}
		mastertest.WaitFor(t, 15*time.Second, "deadline kill", func() bool { _, code := get(t, kill.SandboxID); return code == 404 })
		mastertest.WaitFor(t, 15*time.Second, "deadline pause", func() bool { d, _ := get(t, pause.SandboxID); return d.State == "paused" })
	})

	t.Run("bad requests", func(t *testing.T) {
		id := first.SandboxID
		for _, tc := range []struct {
			method, path string
			body         any
			code         int
		}{
			{"POST", "/v2/sandboxes", "{not json", 400},
			{"POST", "/v2/sandboxes", map[string]any{}, 400},
			{"POST", "/v2/sandboxes", map[string]any{"templateID": "ghost"}, 404},
			{"POST", "/v2/sandboxes", map[string]any{"templateID": "Not A Template!"}, 400},
			{"POST", "/v2/sandboxes", map[string]any{"templateID": "busybox", "timeout": -5}, 400},
			{"POST", "/v2/sandboxes", map[string]any{"templateID": "busybox", "timeout": 999999}, 400},
			{"POST", "/v2/sandboxes", map[string]any{"templateID": "busybox", "envVars": map[string]string{"1BAD": "x"}}, 400},
			{"POST", "/v2/sandboxes", map[string]any{"templateID": "busybox", "volumeMounts": []map[string]string{{"name": "v", "path": "/v"}}}, 404},
			{"POST", "/v2/sandboxes", map[string]any{"templateID": "busybox", "volumeMounts": []map[string]string{{"name": "v", "path": "v"}}}, 400},
			{"POST", "/v2/sandboxes", map[string]any{"templateID": "busybox", "volumeMounts": []map[string]string{{"name": "v", "path": "/proc/v"}}}, 400},
			{"POST", "/v2/sandboxes", map[string]any{"templateID": "busybox", "network": map[string]any{"allowOut": []string{"not-a-cidr"}}}, 400},
			{"POST", "/v2/sandboxes", map[string]any{"templateID": "busybox", "autoResume": map[string]bool{"enabled": true}}, 400},
			{"GET", "/sandboxes/nosuchsandbox", nil, 404},
			{"GET", "/sandboxes/BAD_ID", nil, 400},
			{"DELETE", "/sandboxes/nosuchsandbox", nil, 404},
			{"POST", "/sandboxes/nosuchsandbox/pause", nil, 404},
			{"POST", "/v2/sandboxes/nosuchsandbox/connect", nil, 404},
			{"POST", "/sandboxes/" + id + "/timeout", map[string]any{}, 400},
			{"POST", "/sandboxes/" + id + "/timeout", map[string]any{"timeout": 0}, 400},
			{"POST", "/sandboxes/" + id + "/connect", map[string]any{}, 400},
			{"PUT", "/sandboxes/" + id + "/network", map[string]any{"denyOut": []string{"example.com"}}, 400},
			{"PUT", "/sandboxes/" + id + "/network", map[string]any{"allowOut": []string{"api.*.example.com"}}, 400},
			{"PUT", "/sandboxes/" + id + "/network", map[string]any{"rules": "a.com"}, 400},
			{"PUT", "/sandboxes/" + id + "/network", map[string]any{"rules": map[string]any{"a.com": []any{map[string]any{"transform": map[string]any{"headers": map[string]string{"Host": "b.com"}}}}}}, 400},
			{"GET", "/sandboxes/metrics", nil, 400},
			{"GET", "/templates/ghost", nil, 404},
			{"GET", "/no/such/route", nil, 404},
		} {
			r := c.Do(t, tc.method, tc.path, tc.body, nil)
			code, msg := r.Error()
			if r.StatusCode != tc.code || code != tc.code || msg == "" {
				t.Errorf("%s %s %v: %d %s", tc.method, tc.path, tc.body, r.StatusCode, r.Body)
			}
		}
	})

	t.Run("metrics, logs, templates", func(t *testing.T) {
		id := first.SandboxID
		var ms []map[string]any
		if r := c.Do(t, "GET", "/sandboxes/"+id+"/metrics", nil, &ms); r.StatusCode != 200 {
			t.Fatalf("metrics: %d %s", r.StatusCode, r.Body)
		}
		if len(ms) == 1 && ms[0]["memTotal"] == nil {
			t.Fatalf("metric shape: %v", ms[0])
		}
		var many struct {
			Sandboxes map[string]map[string]any `json:"sandboxes"`
		}
		if r := c.Do(t, "GET", "/sandboxes/metrics?sandbox_ids="+id+",nosuchsandbox", nil, &many); r.StatusCode != 200 {
			t.Fatalf("metrics many: %d %s", r.StatusCode, r.Body)
		}
		var logs struct {
			Logs []struct{ Message string } `json:"logs"`
		}
		c.Do(t, "GET", "/v2/sandboxes/"+id+"/logs", nil, &logs)
		created := false
		for _, l := range logs.Logs {
			created = created || l.Message == "sandbox created"
		}
		// The agent's own lines (it starts before the create returns)
		// may come first.
		if len(logs.Logs) < 3 || !created {
			t.Fatalf("logs: %+v", logs)
		}
		var tmpls []struct {
			TemplateID string   `json:"templateID"`
			Aliases    []string `json:"aliases"`
			BuildID    string   `json:"buildID"`
		}
		c.Do(t, "GET", "/templates", nil, &tmpls)
		if len(tmpls) != 1 || tmpls[0].TemplateID != "busybox" || fmt.Sprint(tmpls[0].Aliases) != "[base]" {
			t.Fatalf("templates: %+v", tmpls)
		}
		var one struct {
			TemplateID string            `json:"templateID"`
			Builds     []json.RawMessage `json:"builds"`
		}
		if r := c.Do(t, "GET", "/templates/base", nil, &one); r.StatusCode != 200 || one.TemplateID != "busybox" || len(one.Builds) != 1 {
			t.Fatalf("template by alias: %d %s", r.StatusCode, r.Body)
		}
		// Deleting a template needs an admin key: 403 for this one, and
		// the admin key reaches the delete (409: the template is in use).
		if r := c.Do(t, "DELETE", "/templates/busybox", nil, nil); r.StatusCode != http.StatusForbidden {
			t.Fatalf("delete a template with a plain key: %d %s", r.StatusCode, r.Body)
		}
		if r := m.API(m.AdminAPIKey(t)).Do(t, "DELETE", "/templates/busybox", nil, nil); r.StatusCode != 409 {
			t.Fatalf("control: delete a template in use with an admin key: %d %s", r.StatusCode, r.Body)
		}
	})

	t.Run("network and snapshots answer clearly", func(t *testing.T) {
		id := first.SandboxID
		// Without a network-agent on the node the update is refused with a
		// message (409), or 501 where the node lacks the verb; with one, 204.
		r := c.Do(t, "PUT", "/sandboxes/"+id+"/network", map[string]any{"denyOut": []string{"10.0.0.0/8"}}, nil)
		if _, msg := r.Error(); r.StatusCode != 204 && !((r.StatusCode == 409 || r.StatusCode == 501) && msg != "") {
			t.Fatalf("network: %d %s", r.StatusCode, r.Body)
		}
		// Domains pass the API's validation as in E2B (the node decides).
		r = c.Do(t, "PUT", "/sandboxes/"+id+"/network", map[string]any{"allowOut": []string{"api.github.com", "*.pypi.org"}, "denyOut": []string{"0.0.0.0/0"}}, nil)
		if _, msg := r.Error(); r.StatusCode != 204 && !((r.StatusCode == 409 || r.StatusCode == 501) && msg != "") {
			t.Fatalf("network with domains: %d %s", r.StatusCode, r.Body)
		}
		var snap struct {
			SnapshotID string   `json:"snapshotID"`
			Names      []string `json:"names"`
		}
		r = c.Do(t, "POST", "/sandboxes/"+id+"/snapshots", map[string]any{"name": "golden"}, &snap)
		switch r.StatusCode {
		case 201:
			if snap.SnapshotID == "" || fmt.Sprint(snap.Names) != "[golden]" {
				t.Fatalf("snapshot: %s", r.Body)
			}
			var list []map[string]any
			if r := c.Do(t, "GET", "/snapshots?sandboxID="+id, nil, &list); r.StatusCode != 200 || len(list) != 1 {
				t.Fatalf("list snapshots: %d %s", r.StatusCode, r.Body)
			}
			if r := c.Do(t, "DELETE", "/templates/"+snap.SnapshotID, nil, nil); r.StatusCode != 204 {
				t.Fatalf("delete snapshot: %d %s", r.StatusCode, r.Body)
			}
		case 501:
			if _, msg := r.Error(); !strings.Contains(msg, "not supported") {
				t.Fatalf("501 without a clear message: %s", r.Body)
			}
		default:
			t.Fatalf("snapshot: %d %s", r.StatusCode, r.Body)
		}
	})

	t.Run("audit events say which key did what", func(t *testing.T) {
		resp, err := m.Admin.CreateAPIKey(context.Background(), &masterpb.CreateAPIKeyRequest{Name: "auditor"})
		if err != nil {
			t.Fatal(err)
		}
		c2 := m.API(resp.Secret)
		var sb sandboxResp
		if r := c2.Do(t, "POST", "/v2/sandboxes", map[string]any{"templateID": "busybox", "timeout": 120}, &sb); r.StatusCode != http.StatusCreated {
			t.Fatalf("create: %d %s", r.StatusCode, r.Body)
		}
		if r := c2.Do(t, "POST", "/sandboxes/"+sb.SandboxID+"/pause", nil, nil); r.StatusCode != http.StatusNoContent {
			t.Fatalf("pause: %d %s", r.StatusCode, r.Body)
		}
		if r := c2.Do(t, "POST", "/sandboxes/"+sb.SandboxID+"/pause", nil, nil); r.StatusCode != http.StatusConflict {
			t.Fatalf("pause twice: %d %s", r.StatusCode, r.Body)
		}
		if r := c.Do(t, "POST", "/v2/sandboxes/"+sb.SandboxID+"/connect", map[string]any{"timeout": 60}, nil); r.StatusCode != http.StatusCreated && r.StatusCode != http.StatusOK {
			t.Fatalf("connect: %d %s", r.StatusCode, r.Body)
		}
		var logs struct {
			Logs []struct{ Message string } `json:"logs"`
		}
		if r := c.Do(t, "GET", "/v2/sandboxes/"+sb.SandboxID+"/logs", nil, &logs); r.StatusCode != http.StatusOK {
			t.Fatalf("logs: %d %s", r.StatusCode, r.Body)
		}
		var audit []string
		for _, l := range logs.Logs {
			if strings.HasPrefix(l.Message, "audit: ") {
				audit = append(audit, l.Message)
			}
		}
		t.Logf("audit events: %q", audit)
		wantKey := func(action, name string) string { return "audit: " + action + " by API key \"" + name + "\"" }
		firstKeyName := ""
		if len(audit) == 3 {
			if _, rest, ok := strings.Cut(audit[2], "\""); ok {
				firstKeyName, _, _ = strings.Cut(rest, "\"")
			}
		}
		// The failed second pause leaves none.
		want := []string{wantKey("create", "auditor"), wantKey("pause", "auditor"), wantKey("connect", firstKeyName)}
		if len(audit) != len(want) || !strings.HasPrefix(firstKeyName, "test-") {
			t.Fatalf("audit events %q, want %d: create, pause, connect (the other key)", audit, len(want))
		}
		for i := range want {
			if !strings.HasPrefix(audit[i], want[i]) {
				t.Fatalf("audit event %d: %q, want %q…", i, audit[i], want[i])
			}
		}
		if r := c2.Do(t, "DELETE", "/sandboxes/"+sb.SandboxID, nil, nil); r.StatusCode != http.StatusNoContent {
			t.Fatalf("kill: %d %s", r.StatusCode, r.Body)
		}
	})

	t.Run("kill", func(t *testing.T) {
		for _, id := range ids {
			r := c.Do(t, "DELETE", "/sandboxes/"+id, nil, nil)
			if r.StatusCode != 204 && r.StatusCode != 404 {
				t.Errorf("kill %s: %d %s", id, r.StatusCode, r.Body)
			}
		}
		if r := c.Do(t, "DELETE", "/sandboxes/"+first.SandboxID, nil, nil); r.StatusCode != 404 {
			t.Fatalf("kill twice: %d", r.StatusCode)
		}
		var left []listed
		c.Do(t, "GET", "/v2/sandboxes", nil, &left)
		if len(left) != 0 {
			t.Fatalf("left: %+v", left)
		}
	})
	node.Env.AssertNoLeaks(t)
}
