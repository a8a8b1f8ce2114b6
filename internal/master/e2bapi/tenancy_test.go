package e2bapi_test

import (
	"context"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"testing"

	masterpb "github.com/cubesandbox/cube/api/master/v1"
	"github.com/cubesandbox/cube/internal/master/mastertest"
	"github.com/cubesandbox/cube/internal/proxy"
)

// teamKey makes a team (with quota q, nil for none) and a key of it.
func teamKey(t *testing.T, m *mastertest.Master, team string, admin bool, q *masterpb.TeamQuota) string {
	t.Helper()
	ctx := context.Background()
	if _, err := m.Admin.CreateTeam(ctx, &masterpb.CreateTeamRequest{Name: team, Quota: q}); err != nil && !strings.Contains(err.Error(), "already exists") {
		t.Fatal(err)
	}
	resp, err := m.Admin.CreateAPIKey(ctx, &masterpb.CreateAPIKeyRequest{Name: fmt.Sprintf("%s-%v", team, admin), Team: team, Admin: admin})
	if err != nil {
		t.Fatal(err)
	}
	return resp.Secret
}

// TestTenancyMatrix: every E2B route that names a sandbox or a snapshot,
// called with team B's key on team A's objects, answers 404 (as for an
// object that does not exist) and changes nothing; the control, the same
// call with team A's key, succeeds (or reaches the node), so each 404 is
// the team check and nothing else. Listings show each team its own rows
// only, snapshot names resolve within the caller's team, and team B's
// envd token does not open team A's sandbox through the route.
func TestTenancyMatrix(t *testing.T) {
	m := mastertest.StartMaster(t, "")
	node := mastertest.StartNode(t, m, "busybox")
	m.WaitHealthy(t, node)
	a := m.API(teamKey(t, m, "team-a", false, nil))
	b := m.API(teamKey(t, m, "team-b", false, nil))
	bAdmin := m.API(teamKey(t, m, "team-b", true, nil))

	var created []string
	t.Cleanup(func() {
		for _, id := range created {
			a.Do(t, "DELETE", "/sandboxes/"+id, nil, nil)
			b.Do(t, "DELETE", "/sandboxes/"+id, nil, nil)
		}
	})
	create := func(c *mastertest.Client, template string) sandboxResp {
		t.Helper()
		var sb sandboxResp
		if r := c.Do(t, "POST", "/v2/sandboxes", map[string]any{"templateID": template, "timeout": 300, "metadata": map[string]string{"owner": "a"}}, &sb); r.StatusCode != http.StatusCreated {
			t.Fatalf("create from %s: %d %s", template, r.StatusCode, r.Body)
		}
		created = append(created, sb.SandboxID)
		return sb
	}
	sbA := create(a, "busybox")
	sbB := create(b, "busybox")
	id := sbA.SandboxID

	// probe runs one call as team B (want 404) and then as team A (want
	// one of ok), logging both.
	probe := func(t *testing.T, method, path string, body any, ok ...int) {
		t.Helper()
		rb := b.Do(t, method, path, body, nil)
		t.Logf("team B %s %s -> %d %s", method, path, rb.StatusCode, strings.TrimSpace(string(rb.Body)))
		if code, msg := rb.Error(); rb.StatusCode != http.StatusNotFound || code != http.StatusNotFound || msg == "" {
			t.Errorf("team B %s %s: %d %s, want 404", method, path, rb.StatusCode, rb.Body)
		}
		ra := a.Do(t, method, path, body, nil)
		t.Logf("control: team A %s %s -> %d", method, path, ra.StatusCode)
		for _, c := range ok {
			if ra.StatusCode == c {
				return
			}
		}
		t.Errorf("control: team A %s %s: %d %s, want %v", method, path, ra.StatusCode, ra.Body, ok)
	}

	t.Run("sandbox routes", func(t *testing.T) {
		p := "/sandboxes/" + id
		probe(t, "GET", p, nil, 200)
		probe(t, "POST", p+"/timeout", map[string]any{"timeout": 300}, 204)
		probe(t, "POST", p+"/refreshes", map[string]any{"duration": 60}, 204)
		// Without a network-agent the node refuses (409/501): reaching it
		// is the control.
		probe(t, "PUT", p+"/network", map[string]any{"denyOut": []string{"10.0.0.0/8"}}, 204, 409, 501)
		probe(t, "GET", p+"/metrics", nil, 200)
		probe(t, "GET", p+"/logs", nil, 200)
		probe(t, "GET", "/v2"+p+"/logs", nil, 200)
		probe(t, "POST", "/v2"+p+"/connect", map[string]any{"timeout": 300}, 200)
		probe(t, "POST", p+"/connect", map[string]any{"timeout": 300}, 200)
		probe(t, "POST", p+"/pause", nil, 204)
		probe(t, "POST", p+"/resume", map[string]any{"timeout": 300}, 201)
	})

	t.Run("listings show each team its own", func(t *testing.T) {
		md := url.QueryEscape(url.Values{"owner": {"a"}}.Encode())
		for _, path := range []string{"/v2/sandboxes", "/sandboxes", "/v2/sandboxes?metadata=" + md, "/v2/sandboxes?state=running,paused"} {
			for _, tc := range []struct {
				who        string
				c          *mastertest.Client
				own, other string
			}{{"A", a, sbA.SandboxID, sbB.SandboxID}, {"B", b, sbB.SandboxID, sbA.SandboxID}} {
				var got []listed
				if r := tc.c.Do(t, "GET", path, nil, &got); r.StatusCode != 200 {
					t.Fatalf("team %s %s: %d %s", tc.who, path, r.StatusCode, r.Body)
				}
				ids := map[string]bool{}
				for _, s := range got {
					ids[s.SandboxID] = true
				}
				t.Logf("team %s GET %s -> %d sandboxes", tc.who, path, len(got))
				if ids[tc.other] || !ids[tc.own] || len(got) != 1 {
					t.Errorf("team %s GET %s: %v, want only its own %s", tc.who, path, ids, tc.own)
				}
			}
		}
		var many struct {
			Sandboxes map[string]any `json:"sandboxes"`
		}
		if r := b.Do(t, "GET", "/sandboxes/metrics?sandbox_ids="+id, nil, &many); r.StatusCode != 200 || len(many.Sandboxes) != 0 {
			t.Errorf("team B metrics of team A's sandbox: %d %s", r.StatusCode, r.Body)
		}
	})

	var snapA string
	t.Run("snapshots, names and creates from them", func(t *testing.T) {
		var snap struct {
			SnapshotID string   `json:"snapshotID"`
			Names      []string `json:"names"`
		}
		p := "/sandboxes/" + id + "/snapshots"
		if r := b.Do(t, "POST", p, map[string]any{"name": "golden"}, nil); r.StatusCode != 404 {
			t.Fatalf("team B snapshot of team A's sandbox: %d %s", r.StatusCode, r.Body)
		}
		if r := a.Do(t, "POST", p, map[string]any{"name": "golden"}, &snap); r.StatusCode != 201 {
			t.Fatalf("control: team A snapshot: %d %s", r.StatusCode, r.Body)
		}
		snapA = snap.SnapshotID
		t.Logf("team A snapshot %s named golden", snapA)
		for _, q := range []string{"", "?name=golden", "?sandboxID=" + id, "?name=" + snapA} {
			var bl, al []map[string]any
			b.Do(t, "GET", "/snapshots"+q, nil, &bl)
			a.Do(t, "GET", "/snapshots"+q, nil, &al)
			t.Logf("GET /snapshots%s: team B sees %d, team A %d", q, len(bl), len(al))
			if len(bl) != 0 || len(al) != 1 {
				t.Errorf("GET /snapshots%s: team B sees %d (want 0), team A %d (want 1)", q, len(bl), len(al))
			}
		}
		// Create from the snapshot, by name and by ID.
		for _, ref := range []string{"golden", snapA} {
			r := b.Do(t, "POST", "/v2/sandboxes", map[string]any{"templateID": ref}, nil)
			t.Logf("team B create from team A's snapshot %s -> %d %s", ref, r.StatusCode, strings.TrimSpace(string(r.Body)))
			if r.StatusCode != 404 {
				t.Errorf("team B create from team A's snapshot %s: %d %s", ref, r.StatusCode, r.Body)
			}
		}
		fromA := create(a, "golden")
		t.Logf("control: team A created %s from its snapshot golden", fromA.SandboxID)
		// A name belongs to its team: team B's own "golden" does not take
		// team A's over, and team B's creates resolve to its own.
		if r := b.Do(t, "POST", "/sandboxes/"+sbB.SandboxID+"/snapshots", map[string]any{"name": "golden"}, &snap); r.StatusCode != 201 {
			t.Fatalf("team B snapshot of its own: %d %s", r.StatusCode, r.Body)
		}
		snapB := snap.SnapshotID
		var bl []struct {
			SnapshotID string `json:"snapshotID"`
		}
		b.Do(t, "GET", "/snapshots?name=golden", nil, &bl)
		var al []struct {
			SnapshotID string `json:"snapshotID"`
		}
		a.Do(t, "GET", "/snapshots?name=golden", nil, &al)
		if len(bl) != 1 || bl[0].SnapshotID != snapB || len(al) != 1 || al[0].SnapshotID != snapA {
			t.Errorf("golden resolves to B:%v A:%v, want B:%s A:%s", bl, al, snapB, snapA)
		}
		fromB := create(b, "golden")
		var logs struct {
			Logs []struct {
				Message string            `json:"message"`
				Fields  map[string]string `json:"fields"`
			} `json:"logs"`
		}
		b.Do(t, "GET", "/v2/sandboxes/"+fromB.SandboxID+"/logs", nil, &logs)
		from := ""
		for _, l := range logs.Logs {
			if l.Fields["snapshot"] != "" {
				from = l.Fields["snapshot"]
			}
		}
		if from != snapB {
			t.Errorf("team B's create from golden used snapshot %q, want its own %s", from, snapB)
		}
		// Deleting through the template route: team B's admin key is no
		// key at all for team A's snapshot.
		for _, c := range []*mastertest.Client{b, bAdmin} {
			if r := c.Do(t, "DELETE", "/templates/"+snapA, nil, nil); r.StatusCode != 404 {
				t.Errorf("team B delete team A's snapshot: %d %s", r.StatusCode, r.Body)
			}
		}
		if r := b.Do(t, "DELETE", "/templates/golden", nil, nil); r.StatusCode != 204 {
			t.Errorf("team B delete its own golden: %d %s", r.StatusCode, r.Body)
		}
		if r := bAdmin.Do(t, "DELETE", "/templates/golden", nil, nil); r.StatusCode != 404 {
			t.Errorf("team B admin delete golden after B's is gone (team A's remains): %d %s", r.StatusCode, r.Body)
		}
		if r := a.Do(t, "GET", "/snapshots?name=golden", nil, &al); r.StatusCode != 200 || len(al) != 1 {
			t.Errorf("team A's golden is gone: %d %s", r.StatusCode, r.Body)
		}
		if r := a.Do(t, "DELETE", "/templates/"+snapA, nil, nil); r.StatusCode != 204 {
			t.Errorf("control: team A delete its snapshot: %d %s", r.StatusCode, r.Body)
		}
	})

	t.Run("fork", func(t *testing.T) {
		p := "/sandboxes/" + id + "/fork"
		rb := b.Do(t, "POST", p, map[string]any{"count": 1}, nil)
		t.Logf("team B POST %s -> %d %s", p, rb.StatusCode, strings.TrimSpace(string(rb.Body)))
		if rb.StatusCode != 404 {
			t.Errorf("team B fork: %d %s", rb.StatusCode, rb.Body)
		}
		var res []struct {
			Sandbox *sandboxResp `json:"sandbox"`
		}
		r := a.Do(t, "POST", p, map[string]any{"count": 1}, &res)
		t.Logf("control: team A POST %s -> %d", p, r.StatusCode)
		if r.StatusCode != 201 || len(res) != 1 || res[0].Sandbox == nil {
			t.Fatalf("control: team A fork: %d %s", r.StatusCode, r.Body)
		}
		created = append(created, res[0].Sandbox.SandboxID)
		if r := b.Do(t, "GET", "/sandboxes/"+res[0].Sandbox.SandboxID, nil, nil); r.StatusCode != 404 {
			t.Errorf("team B get team A's fork: %d", r.StatusCode)
		}
		if r := a.Do(t, "GET", "/sandboxes/"+res[0].Sandbox.SandboxID, nil, nil); r.StatusCode != 200 {
			t.Errorf("control: team A get its fork: %d", r.StatusCode)
		}
	})

	t.Run("templates are shared, deleting one needs an admin key", func(t *testing.T) {
		for _, c := range []*mastertest.Client{a, b} {
			if r := c.Do(t, "GET", "/templates/busybox", nil, nil); r.StatusCode != 200 {
				t.Errorf("get template: %d %s", r.StatusCode, r.Body)
			}
		}
		if r := b.Do(t, "DELETE", "/templates/busybox", nil, nil); r.StatusCode != http.StatusForbidden {
			t.Errorf("plain key deletes a template: %d %s", r.StatusCode, r.Body)
		}
		// Control: the admin key reaches the delete, which refuses a
		// template in use.
		if r := bAdmin.Do(t, "DELETE", "/templates/busybox", nil, nil); r.StatusCode != http.StatusConflict {
			t.Errorf("control: admin key deletes a template in use: %d %s", r.StatusCode, r.Body)
		}
	})

	t.Run("route: team B's token does not open team A's sandbox", func(t *testing.T) {
		do := func(sandbox, tok string) int {
			req, _ := http.NewRequest("GET", "http://"+m.Server.ProxyAddr+"/envs", nil)
			req.Header.Set(proxy.HeaderSandboxID, sandbox)
			req.Header.Set(proxy.HeaderSandboxPort, "49983")
			req.Header.Set("X-Access-Token", tok)
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			return resp.StatusCode
		}
		code := do(id, sbB.EnvdAccessToken)
		t.Logf("team B's token at team A's envd: %d", code)
		if code != http.StatusUnauthorized {
			t.Errorf("team B's token at team A's envd: %d, want 401", code)
		}
		if code := do(id, sbA.EnvdAccessToken); code != http.StatusOK {
			t.Errorf("control: team A's token: %d", code)
		}
	})

	t.Run("kill", func(t *testing.T) {
		probe(t, "DELETE", "/sandboxes/"+id, nil, 204)
		if r := b.Do(t, "GET", "/sandboxes/"+sbB.SandboxID, nil, nil); r.StatusCode != 200 {
			t.Errorf("team B's own sandbox: %d", r.StatusCode)
		}
	})

	t.Run("audit names team and key", func(t *testing.T) {
		var logs struct {
			Logs []struct {
				Message string            `json:"message"`
				Fields  map[string]string `json:"fields"`
			} `json:"logs"`
		}
		b.Do(t, "GET", "/v2/sandboxes/"+sbB.SandboxID+"/logs", nil, &logs)
		for _, l := range logs.Logs {
			if l.Fields["audit"] == "create" {
				if l.Fields["team"] != "team-b" || l.Fields["api_key_name"] != "team-b-false" || !strings.Contains(l.Message, `of team "team-b"`) {
					t.Errorf("audit event: %+v", l)
				}
				return
			}
		}
		t.Errorf("no create audit event: %+v", logs.Logs)
	})
}

// TestTeamQuota: a team's creates beyond its quota answer E2B's 429 error
// body ({"code": 429, "message"}) without Retry-After (waiting does not
// free a slot); concurrent creates never exceed the quota; another team
// and a kill are the controls.
func TestTeamQuota(t *testing.T) {
	m := mastertest.StartMaster(t, "")
	node := mastertest.StartNode(t, m, "busybox")
	m.WaitHealthy(t, node)
	two := m.API(teamKey(t, m, "two", false, &masterpb.TeamQuota{MaxSandboxes: 2}))
	mem := m.API(teamKey(t, m, "mem", false, &masterpb.TeamQuota{MaxMemoryMib: 64}))
	cpu := m.API(teamKey(t, m, "cpu", false, &masterpb.TeamQuota{MaxMilliCpu: 1000}))
	free := m.API(teamKey(t, m, "free", false, nil))
	var mu sync.Mutex
	var created []struct {
		c  *mastertest.Client
		id string
	}
	t.Cleanup(func() {
		for _, x := range created {
			x.c.Do(t, "DELETE", "/sandboxes/"+x.id, nil, nil)
		}
	})
	create := func(c *mastertest.Client) *mastertest.Response {
		var sb sandboxResp
		r := c.Do(t, "POST", "/v2/sandboxes", map[string]any{"templateID": "busybox", "timeout": 300}, &sb)
		if r.StatusCode == http.StatusCreated {
			mu.Lock()
			created = append(created, struct {
				c  *mastertest.Client
				id string
			}{c, sb.SandboxID})
			mu.Unlock()
		}
		return r
	}
	is429 := func(t *testing.T, what string, r *mastertest.Response) {
		t.Helper()
		code, msg := r.Error()
		t.Logf("%s -> %d %s (Retry-After %q)", what, r.StatusCode, strings.TrimSpace(string(r.Body)), r.Header.Get("Retry-After"))
		if r.StatusCode != http.StatusTooManyRequests || code != 429 || !strings.Contains(msg, "quota") || r.Header.Get("Retry-After") != "" {
			t.Errorf("%s: %d %s, want 429 with E2B's error body and no Retry-After", what, r.StatusCode, r.Body)
		}
	}

	t.Run("concurrent creates stop at the quota", func(t *testing.T) {
		const n = 6
		codes := make([]int, n)
		var wg sync.WaitGroup
		for i := range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				codes[i] = create(two).StatusCode
			}()
		}
		wg.Wait()
		ok, over := 0, 0
		for _, c := range codes {
			switch c {
			case http.StatusCreated:
				ok++
			case http.StatusTooManyRequests:
				over++
			}
		}
		t.Logf("%d concurrent creates under max_sandboxes=2: %v", n, codes)
		if ok != 2 || over != n-2 {
			t.Fatalf("%d created, %d refused with 429; want 2 and %d", ok, over, n-2)
		}
		is429(t, "third create", create(two))
		// A paused sandbox still counts.
		mu.Lock()
		first := created[0].id
		mu.Unlock()
		if r := two.Do(t, "POST", "/sandboxes/"+first+"/pause", nil, nil); r.StatusCode != 204 {
			t.Fatalf("pause: %d %s", r.StatusCode, r.Body)
		}
		is429(t, "create with one of two paused", create(two))
		// Control: a kill frees a slot.
		if r := two.Do(t, "DELETE", "/sandboxes/"+first, nil, nil); r.StatusCode != 204 {
			t.Fatalf("kill: %d", r.StatusCode)
		}
		if r := create(two); r.StatusCode != http.StatusCreated {
			t.Fatalf("control: create after a kill: %d %s", r.StatusCode, r.Body)
		}
	})

	t.Run("memory and vCPU", func(t *testing.T) {
		// The test master's sandboxes have 64 MiB and 1 vCPU each.
		for _, c := range []*mastertest.Client{mem, cpu} {
			if r := create(c); r.StatusCode != http.StatusCreated {
				t.Fatalf("control: first create: %d %s", r.StatusCode, r.Body)
			}
		}
		is429(t, "second create over max_memory_mib=64", create(mem))
		is429(t, "second create over max_milli_cpu=1000", create(cpu))
	})

	t.Run("another team is not limited", func(t *testing.T) {
		for range 3 {
			if r := create(free); r.StatusCode != http.StatusCreated {
				t.Fatalf("team without quota: %d %s", r.StatusCode, r.Body)
			}
		}
	})

	t.Run("a fork over the quota is refused per child", func(t *testing.T) {
		var sbs []listed
		two.Do(t, "GET", "/v2/sandboxes", nil, &sbs)
		if len(sbs) != 2 {
			t.Fatalf("team two holds %d", len(sbs))
		}
		var res []struct {
			Sandbox *sandboxResp `json:"sandbox"`
			Error   *struct {
				Code int `json:"code"`
			} `json:"error"`
		}
		r := two.Do(t, "POST", "/sandboxes/"+sbs[0].SandboxID+"/fork", map[string]any{"count": 1}, &res)
		t.Logf("fork at the quota: %d %s", r.StatusCode, r.Body)
		if r.StatusCode == 501 {
			t.Skip("the node cannot snapshot")
		}
		if r.StatusCode != 201 || len(res) != 1 || res[0].Sandbox != nil || res[0].Error == nil || res[0].Error.Code != 429 {
			t.Errorf("fork at the quota: %d %s", r.StatusCode, r.Body)
		}
	})
}
