package master_test

import (
	"context"
	"net/http"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/master/catalog"
	"github.com/cubesandbox/cube/internal/master/mastertest"
)

type e2bSandbox struct {
	SandboxID string `json:"sandboxID"`
	State     string `json:"state"`
}

// TestSandboxDeath: a sandbox whose init is killed on its node shows as
// failed through the E2B API within seconds, with the reason in its
// logs; it leaves the running list and a kill removes it. Control: a
// paused sandbox (frozen, not dead) stays paused.
func TestSandboxDeath(t *testing.T) {
	m := mastertest.StartMaster(t, "")
	n := mastertest.StartNode(t, m, "busybox")
	m.WaitHealthy(t, n)
	ctx := context.Background()
	c := m.API(m.APIKey(t))
	create := func(t *testing.T) string {
		t.Helper()
		var sb e2bSandbox
		if r := c.Do(t, "POST", "/v2/sandboxes", map[string]any{"templateID": "busybox"}, &sb); r.StatusCode != http.StatusCreated {
			t.Fatalf("create: %d %s", r.StatusCode, r.Body)
		}
		return sb.SandboxID
	}
	state := func(t *testing.T, id string) string {
		t.Helper()
		var sb e2bSandbox
		if r := c.Do(t, "GET", "/sandboxes/"+id, nil, &sb); r.StatusCode != 200 {
			t.Fatalf("get %s: %d %s", id, r.StatusCode, r.Body)
		}
		return sb.State
	}

	t.Run("killed init", func(t *testing.T) {
		id := create(t)
		rec, err := n.Svc.Get(ctx, id)
		if err != nil {
			t.Fatal(err)
		}
		if err := unix.Kill(rec.Container.PID, unix.SIGKILL); err != nil {
			t.Fatal(err)
		}
		begin := time.Now()
		mastertest.WaitFor(t, 5*time.Second, "failed through the E2B API", func() bool { return state(t, id) == catalog.StateFailed })
		t.Logf("GET /sandboxes/%s says failed %s after the kill", id, time.Since(begin).Round(time.Millisecond))
		r := c.Do(t, "GET", "/v2/sandboxes/"+id+"/logs", nil, nil)
		if r.StatusCode != 200 || !strings.Contains(string(r.Body), "sandbox died: killed by signal 9") {
			t.Fatalf("logs: %d %s", r.StatusCode, r.Body)
		}
		var running []e2bSandbox
		if r := c.Do(t, "GET", "/v2/sandboxes", nil, &running); r.StatusCode != 200 || len(running) != 0 {
			t.Fatalf("running list %d %s, want empty", r.StatusCode, r.Body)
		}
		if r := c.Do(t, "DELETE", "/sandboxes/"+id, nil, nil); r.StatusCode != http.StatusNoContent {
			t.Fatalf("kill the dead sandbox: %d %s", r.StatusCode, r.Body)
		}
		if _, err := n.Svc.Get(ctx, id); err == nil {
			t.Fatal("the node still has the killed sandbox")
		}
	})

	t.Run("paused is not dead", func(t *testing.T) {
		id := create(t)
		defer c.Do(t, "DELETE", "/sandboxes/"+id, nil, nil)
		if r := c.Do(t, "POST", "/sandboxes/"+id+"/pause", nil, nil); r.StatusCode != http.StatusNoContent {
			t.Fatalf("pause: %d %s", r.StatusCode, r.Body)
		}
		for end := time.Now().Add(1500 * time.Millisecond); time.Now().Before(end); time.Sleep(100 * time.Millisecond) {
			if st := state(t, id); st != catalog.StatePaused {
				t.Fatalf("paused sandbox is %s", st)
			}
		}
	})
}

// TestCreateLoad: 50 creates through the E2B API, 10 in flight, every
// other one killed at once (runtime state churns as it would under real
// load), all succeed: the node's health conditions do not flap it
// unhealthy under the burst. Latencies are logged.
func TestCreateLoad(t *testing.T) {
	m := mastertest.StartMaster(t, "")
	n := mastertest.StartNode(t, m, "busybox")
	m.WaitHealthy(t, n)
	c := m.API(m.APIKey(t))
	const total, inFlight = 50, 10
	var (
		mu    sync.Mutex
		ids   []string
		fails []string
		lat   []time.Duration
	)
	t.Cleanup(func() {
		for _, id := range ids {
			c.Do(t, "DELETE", "/sandboxes/"+id, nil, nil)
		}
	})
	sem := make(chan struct{}, inFlight)
	var wg sync.WaitGroup
	begin := time.Now()
	for i := range total {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			start := time.Now()
			var sb e2bSandbox
			r := c.Do(t, "POST", "/v2/sandboxes", map[string]any{"templateID": "busybox"}, &sb)
			mu.Lock()
			defer mu.Unlock()
			if r.StatusCode != http.StatusCreated {
				fails = append(fails, r.Status+" "+string(r.Body))
				return
			}
			lat = append(lat, time.Since(start))
			if i%2 == 0 {
				ids = append(ids, sb.SandboxID)
				return
			}
			mu.Unlock()
			if r := c.Do(t, "DELETE", "/sandboxes/"+sb.SandboxID, nil, nil); r.StatusCode != http.StatusNoContent {
				t.Errorf("kill %s: %d %s", sb.SandboxID, r.StatusCode, r.Body)
			}
			mu.Lock()
		})
	}
	wg.Wait()
	sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
	if len(lat) > 0 {
		t.Logf("%d creates, %d in flight: %d ok in %s; latency p50 %s p99 %s", total, inFlight, len(lat),
			time.Since(begin).Round(time.Millisecond), lat[len(lat)/2].Round(time.Millisecond), lat[len(lat)*99/100].Round(time.Millisecond))
	}
	if len(fails) > 0 {
		t.Fatalf("%d of %d creates failed, e.g. %s", len(fails), total, fails[0])
	}
	if v := m.Node(t, n.ID); !v.Healthy {
		t.Fatalf("node unhealthy after the burst: %s", v.Reason)
	}
}
