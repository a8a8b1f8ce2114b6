package opsapi_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/cookiejar"
	"net/url"
	"strings"
	"testing"
	"time"

	"golang.org/x/net/websocket"

	masterpb "github.com/cubesandbox/cube/api/master/v1"
	"github.com/cubesandbox/cube/internal/master/mastertest"
	"github.com/cubesandbox/cube/internal/master/opsapi"
)

// client is one browser: a cookie jar and the CSRF token of its login.
type client struct {
	t    *testing.T
	base string
	hc   *http.Client
	csrf string
	key  string
}

func newClient(t *testing.T, base string) *client {
	jar, _ := cookiejar.New(nil)
	return &client{t: t, base: base, hc: &http.Client{Jar: jar, Timeout: 2 * time.Minute}}
}

func (c *client) do(method, path string, body any, out any) int {
	c.t.Helper()
	var rd io.Reader
	if body != nil {
		b, _ := json.Marshal(body)
		rd = bytes.NewReader(b)
	}
	req, _ := http.NewRequest(method, c.base+path, rd)
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
	data, _ := io.ReadAll(resp.Body)
	if out != nil && resp.StatusCode/100 == 2 {
		if err := json.Unmarshal(data, out); err != nil {
			c.t.Fatalf("%s %s: %v: %s", method, path, err, data)
		}
	}
	if resp.StatusCode/100 != 2 {
		c.t.Logf("%s %s -> %d %s", method, path, resp.StatusCode, bytes.TrimSpace(data))
	}
	return resp.StatusCode
}

type sandbox struct {
	ID    string `json:"id"`
	State string `json:"state"`
	Team  string `json:"team"`
}

// TestOps drives CubeOps over a real master and node: the admin's
// password login (a wrong one refused), CSRF on every change a session
// makes (refused without the token, the same call passes with it),
// nodes, a sandbox created, listed live (SSE), paused, resumed,
// snapshotted into the lineage and killed, and team users who see their
// own team only (the admin sees both).
func TestOps(t *testing.T) {
	const pw = "correct horse battery"
	hash, err := opsapi.HashPassword(pw)
	if err != nil {
		t.Fatal(err)
	}
	m := mastertest.StartMaster(t, fmt.Sprintf("[api]\nops = \"127.0.0.1:0\"\n[console]\nadmin_password_hash = %q\n", hash))
	node := mastertest.StartNode(t, m, "busybox")
	m.WaitHealthy(t, node)
	base := "http://" + m.Server.OpsAddr
	admin := newClient(t, base)

	t.Run("console is served", func(t *testing.T) {
		resp, err := http.Get(base + "/")
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || !strings.Contains(string(b), "CubeOps") || resp.Header.Get("X-Frame-Options") != "DENY" {
			t.Fatalf("GET /: %d %q", resp.StatusCode, b)
		}
	})

	t.Run("login", func(t *testing.T) {
		if code := admin.do("GET", "/ops/api/nodes", nil, nil); code != 401 {
			t.Fatalf("nodes before login: %d", code)
		}
		for _, c := range []map[string]string{{"user": "admin", "password": "wrong"}, {"user": "root", "password": pw}} {
			if code := admin.do("POST", "/ops/api/login", c, nil); code != 401 {
				t.Fatalf("login %v: %d, want 401", c, code)
			}
		}
		var s struct{ CSRF string }
		if code := admin.do("POST", "/ops/api/login", map[string]string{"user": "admin", "password": pw}, &s); code != 200 || s.CSRF == "" {
			t.Fatalf("login: %d %+v", code, s)
		}
		admin.csrf = s.CSRF
	})

	var nodes []struct {
		ID      string `json:"id"`
		Healthy bool   `json:"healthy"`
		CPUs    int    `json:"cpus"`
	}
	if code := admin.do("GET", "/ops/api/nodes", nil, &nodes); code != 200 || len(nodes) != 1 || nodes[0].ID != node.ID || !nodes[0].Healthy {
		t.Fatalf("nodes: %d %+v", code, nodes)
	}

	var sb sandbox
	t.Run("CSRF", func(t *testing.T) {
		tok := admin.csrf
		admin.csrf = ""
		if code := admin.do("POST", "/ops/api/sandboxes", map[string]any{"template": "busybox"}, nil); code != 403 {
			t.Fatalf("create without the CSRF token: %d, want 403", code)
		}
		// Another first character (a token may itself start with "0").
		wrong := "0"
		if tok[0] == '0' {
			wrong = "1"
		}
		admin.csrf = wrong + tok[1:]
		if code := admin.do("POST", "/ops/api/sandboxes", map[string]any{"template": "busybox"}, nil); code != 403 {
			t.Fatalf("create with a wrong CSRF token: %d, want 403", code)
		}
		t.Log("refused: a session's create without its CSRF token, and with a wrong one")
		admin.csrf = tok
		if code := admin.do("POST", "/ops/api/sandboxes", map[string]any{"template": "busybox"}, &sb); code != 201 || sb.State != "running" {
			t.Fatalf("control: create with the token: %d %+v", code, sb)
		}
		t.Logf("control: the same create with the token -> 201 %s", sb.ID)
	})
	t.Cleanup(func() { admin.do("POST", "/ops/api/sandboxes/"+sb.ID+"/kill", nil, nil) })

	t.Run("live list", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		req, _ := http.NewRequestWithContext(ctx, "GET", base+"/ops/api/live", nil)
		resp, err := admin.hc.Do(req) //nolint:bodyclose // closed below, after the reader goroutine
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		events := make(chan []sandbox, 8)
		go func() {
			sc := bufio.NewScanner(resp.Body)
			sc.Buffer(make([]byte, 1<<20), 1<<20)
			for sc.Scan() {
				if d, ok := strings.CutPrefix(sc.Text(), "data: "); ok {
					var l []sandbox
					_ = json.Unmarshal([]byte(d), &l)
					events <- l
				}
			}
			close(events)
		}()
		state := func() string {
			l, ok := <-events
			if !ok {
				t.Fatal("stream ended")
			}
			for _, s := range l {
				if s.ID == sb.ID {
					return s.State
				}
			}
			return "gone"
		}
		if st := state(); st != "running" {
			t.Fatalf("first event: %s", st)
		}
		if code := admin.do("POST", "/ops/api/sandboxes/"+sb.ID+"/pause", nil, nil); code != 204 {
			t.Fatalf("pause: %d", code)
		}
		if st := state(); st != "paused" {
			t.Fatalf("after pause: %s", st)
		}
		if code := admin.do("POST", "/ops/api/sandboxes/"+sb.ID+"/resume", nil, nil); code != 204 {
			t.Fatalf("resume: %d", code)
		}
		if st := state(); st != "running" {
			t.Fatalf("after resume: %s", st)
		}
		t.Log("the live stream showed running, paused, running")
	})

	t.Run("snapshot in the lineage", func(t *testing.T) {
		var snap struct{ ID string }
		if code := admin.do("POST", "/ops/api/sandboxes/"+sb.ID+"/snapshot", map[string]string{"name": "ops-snap"}, &snap); code != 201 {
			t.Skipf("snapshot: %d (the node cannot snapshot this runtime here)", code)
		}
		type node struct {
			Kind     string  `json:"kind"`
			ID       string  `json:"id"`
			Children []*node `json:"children"`
		}
		var roots []*node
		admin.do("GET", "/ops/api/lineage", nil, &roots)
		var find func(ns []*node, kind, id string) *node
		find = func(ns []*node, kind, id string) *node {
			for _, n := range ns {
				if n.Kind == kind && n.ID == id {
					return n
				}
				if f := find(n.Children, kind, id); f != nil {
					return f
				}
			}
			return nil
		}
		tmpl := find(roots, "template", "busybox")
		if tmpl == nil || find(tmpl.Children, "sandbox", sb.ID) == nil || find(find(tmpl.Children, "sandbox", sb.ID).Children, "snapshot", snap.ID) == nil {
			b, _ := json.Marshal(roots)
			t.Fatalf("lineage %s: want busybox > sandbox %s > snapshot %s", b, sb.ID, snap.ID)
		}
	})

	t.Run("metrics, logs and trace", func(t *testing.T) {
		var logs []struct {
			Message string            `json:"message"`
			Fields  map[string]string `json:"fields"`
		}
		if code := admin.do("GET", "/ops/api/sandboxes/"+sb.ID+"/logs", nil, &logs); code != 200 || len(logs) == 0 {
			t.Fatalf("logs: %d", code)
		}
		found := false
		for _, l := range logs {
			found = found || (l.Message == "sandbox created" && l.Fields["trace.total"] != "")
		}
		if !found {
			t.Fatalf("no create trace in %+v", logs)
		}
		var ms []map[string]any
		if code := admin.do("GET", "/ops/api/sandboxes/"+sb.ID+"/metrics", nil, &ms); code != 200 {
			t.Fatalf("metrics: %d", code)
		}
	})

	t.Run("a revoked key ends its sessions", func(t *testing.T) {
		ctx := context.Background()
		if _, err := m.Admin.CreateTeam(ctx, &masterpb.CreateTeamRequest{Name: "team-r"}); err != nil {
			t.Fatal(err)
		}
		resp, err := m.Admin.CreateAPIKey(ctx, &masterpb.CreateAPIKeyRequest{Name: "team-r-key", Team: "team-r"})
		if err != nil {
			t.Fatal(err)
		}
		c := newClient(t, base)
		if code := c.do("POST", "/ops/api/login", map[string]string{"key": resp.Secret}, nil); code != 200 {
			t.Fatalf("key login: %d", code)
		}
		if code := c.do("GET", "/ops/api/sandboxes", nil, nil); code != 200 {
			t.Fatalf("control: the key's session before the revoke: %d, want 200", code)
		}
		if _, err := m.Admin.DeleteAPIKey(ctx, &masterpb.DeleteAPIKeyRequest{Key: "team-r-key"}); err != nil {
			t.Fatal(err)
		}
		mastertest.WaitFor(t, time.Minute, "the revoked key's session refused", func() bool {
			return c.do("GET", "/ops/api/sandboxes", nil, nil) == 401
		})
		t.Log("a session started with an API key ends when the key is deleted")
	})

	t.Run("failed logins are limited", func(t *testing.T) {
		c := newClient(t, base)
		codes := map[int]int{}
		for range 12 {
			codes[c.do("POST", "/ops/api/login", map[string]string{"user": "admin", "password": "guess"}, nil)]++
		}
		t.Logf("12 wrong passwords: %v", codes)
		// The earlier subtests' two refusals came from this address too.
		if codes[http.StatusTooManyRequests] < 2 || codes[http.StatusUnauthorized]+codes[http.StatusTooManyRequests] != 12 {
			t.Fatalf("12 wrong passwords answered %v; want 429 once the allowance of 10 is used", codes)
		}
	})

	t.Run("teams", func(t *testing.T) {
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
		var sa sandbox
		if code := a.do("POST", "/ops/api/sandboxes", map[string]any{"template": "busybox"}, &sa); code != 201 {
			t.Fatalf("team A create: %d", code)
		}
		t.Cleanup(func() { a.do("POST", "/ops/api/sandboxes/"+sa.ID+"/kill", nil, nil) })
		ids := func(c *client) map[string]bool {
			var l []sandbox
			if code := c.do("GET", "/ops/api/sandboxes", nil, &l); code != 200 {
				t.Fatalf("list: %d", code)
			}
			out := map[string]bool{}
			for _, s := range l {
				out[s.ID] = true
			}
			return out
		}
		if got := ids(b); got[sa.ID] || got[sb.ID] {
			t.Fatalf("team B lists %v", got)
		}
		for _, p := range []string{"", "/logs", "/metrics"} {
			if code := b.do("GET", "/ops/api/sandboxes/"+sa.ID+p, nil, nil); code != 404 {
				t.Fatalf("team B GET team A's sandbox%s: %d, want 404", p, code)
			}
		}
		if code := b.do("POST", "/ops/api/sandboxes/"+sa.ID+"/kill", nil, nil); code != 404 {
			t.Fatalf("team B kills team A's sandbox: %d, want 404", code)
		}
		if code := b.do("GET", "/ops/api/nodes", nil, nil); code != 403 {
			t.Fatalf("team B lists nodes: %d, want 403", code)
		}
		t.Log("refused: team B listing, reading, killing team A's sandbox, and the node list")
		if got := ids(a); !got[sa.ID] || got[sb.ID] {
			t.Fatalf("control: team A lists %v", got)
		}
		if code := a.do("GET", "/ops/api/sandboxes/"+sa.ID+"/logs", nil, nil); code != 200 {
			t.Fatalf("control: team A reads its logs: %d", code)
		}
		if got := ids(admin); !got[sa.ID] || !got[sb.ID] {
			t.Fatalf("admin lists %v", got)
		}
		t.Log("control: team A sees its sandbox; the admin sees every team's")
	})

	t.Run("terminal", func(t *testing.T) {
		u, _ := url.Parse(base)
		dial := func(origin string) (*websocket.Conn, error) {
			cfg, err := websocket.NewConfig("ws://"+u.Host+"/ops/api/sandboxes/"+sb.ID+"/terminal", origin)
			if err != nil {
				t.Fatal(err)
			}
			cfg.Header = http.Header{}
			for _, ck := range admin.hc.Jar.Cookies(u) {
				cfg.Header.Add("Cookie", ck.Name+"="+ck.Value)
			}
			return websocket.DialConfig(cfg)
		}
		if ws, err := dial("http://evil.example"); err == nil {
			ws.Close()
			t.Fatal("a WebSocket from another origin was admitted")
		} else {
			t.Logf("refused: the terminal from origin http://evil.example: %v", err)
		}
		ws, err := dial(base)
		if err != nil {
			t.Fatalf("control: the terminal from its own origin: %v", err)
		}
		defer ws.Close()
		_ = websocket.Message.Send(ws, `{"type":"resize","cols":100,"rows":30}`)
		_ = websocket.Message.Send(ws, `{"type":"input","data":"echo h\"\"i$((1+1))\n"}`)
		var out strings.Builder
		_ = ws.SetReadDeadline(time.Now().Add(20 * time.Second))
		for !strings.Contains(out.String(), "hi2") {
			var b []byte
			if err := websocket.Message.Receive(ws, &b); err != nil {
				t.Fatalf("terminal: %v (so far %q)", err, out.String())
			}
			out.Write(b)
		}
		t.Logf("control: the terminal ran echo: %q", out.String())
	})

	t.Run("kill and logout", func(t *testing.T) {
		if code := admin.do("POST", "/ops/api/sandboxes/"+sb.ID+"/kill", nil, nil); code != 204 {
			t.Fatalf("kill: %d", code)
		}
		if code := admin.do("POST", "/ops/api/logout", nil, nil); code != 204 {
			t.Fatalf("logout: %d", code)
		}
		if code := admin.do("GET", "/ops/api/sandboxes", nil, nil); code != 401 {
			t.Fatalf("after logout: %d", code)
		}
	})
}
