package cubeproxy_test

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/master/mastertest"
	"github.com/cubesandbox/cube/internal/proxy"
	"github.com/cubesandbox/cube/internal/sandboxid"
)

// TestUnknownIDFlood sends random well-formed sandbox IDs (50,000 unless
// CUBE_FLOOD_IDS says otherwise) at the master's route, half named by the
// Host <port>-<id>.<domain> and half by the E2b-Sandbox-Id header, from 64
// source addresses (64 per-client buckets, so that a good part reaches
// the master, not just the 429 of one client's empty bucket). What the
// flood leaves must stay bounded: no per-ID metric series (distinct
// sandbox_id label values on proxy.metrics), no per-ID state in the master
// (activity entries, cached routes), at most 10,000 IDs in the replica's
// negative cache, and the Go heap in use after a GC grows by less than
// 16 MiB, and by less than 4 MiB over the second half of the flood (the
// state levels off instead of growing per ID). The control: one request to a real sandbox adds its labelled
// series and its activity entry (the probes see per-ID state when there
// is some), and the sandbox is still served after the flood.
func TestUnknownIDFlood(t *testing.T) {
	n := 50000
	if v := os.Getenv("CUBE_FLOOD_IDS"); v != "" {
		var err error
		if n, err = strconv.Atoi(v); err != nil || n <= 0 {
			t.Fatalf("CUBE_FLOOD_IDS=%q: want a positive count", v)
		}
	}
	t.Setenv("CUBE_TEST_QUIET", "1") // t.Log keeps every line: 50,000 access lines would be measured as heap
	m := mastertest.StartMaster(t, "")
	node := mastertest.StartNode(t, m, "busybox")
	m.WaitHealthy(t, node)
	c := m.API(m.APIKey(t))
	route, metricsAddr := m.Server.ProxyAddr, m.Server.ProxyMetricsAddr
	mastertest.WaitFor(t, 10*time.Second, "route watching", func() bool { return watching(m.Server.Proxy) })

	labels := regexp.MustCompile(`sandbox_id="([^"]*)"`)
	seriesIDs := func() map[string]bool {
		t.Helper()
		_, page := get(t, http.DefaultClient, "http://"+metricsAddr+"/metrics", metricsAddr, nil)
		ids := map[string]bool{}
		for _, line := range strings.Split(page, "\n") {
			if strings.HasPrefix(line, "#") {
				continue
			}
			for _, mm := range labels.FindAllStringSubmatch(line, -1) {
				if mm[1] != "" {
					ids[mm[1]] = true
				}
			}
		}
		return ids
	}
	heap := func() (inuse, rss uint64) {
		runtime.GC()
		runtime.GC()
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		return ms.HeapInuse, vmRSS(t)
	}
	svc, routes := m.Server.Service, m.Server.Proxy.Routes

	// Control: a real sandbox's request adds per-ID state the probes see.
	var sb created
	if r := c.Do(t, "POST", "/v2/sandboxes", map[string]any{"templateID": "busybox", "timeout": 300}, &sb); r.StatusCode != http.StatusCreated {
		t.Fatalf("create: %d %s", r.StatusCode, r.Body)
	}
	t.Cleanup(func() { c.Do(t, "DELETE", "/sandboxes/"+sb.SandboxID, nil, nil) })
	if code, _ := get(t, http.DefaultClient, "http://"+route+"/health", "49983-"+sb.SandboxID+".cube.test", nil); code != http.StatusNoContent {
		t.Fatalf("control: the real sandbox through the route: %d", code)
	}
	mastertest.WaitFor(t, 5*time.Second, "the real sandbox's series", func() bool { return seriesIDs()[sb.SandboxID] })
	mastertest.WaitFor(t, 10*time.Second, "the real sandbox's activity", func() bool { a, _ := svc.PerIDState(); return a >= 1 })
	series0 := seriesIDs()
	act0, routes0 := svc.PerIDState()
	neg0 := routes.Negative()
	heap0, rss0 := heap()
	t.Logf("control: after one request to sandbox %s: per-ID series %d %v, master activity entries %d, cached routes %d, negative cache %d",
		sb.SandboxID, len(series0), keys(series0), act0, routes0, neg0)

	// The flood.
	const sources, workers = 64, 8
	clients := make([]*http.Client, sources)
	for i := range clients {
		src := &net.TCPAddr{IP: net.IPv4(127, 0, 1, byte(i+1))}
		clients[i] = &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{
			DialContext:         (&net.Dialer{LocalAddr: src}).DialContext,
			MaxIdleConnsPerHost: 2,
		}}
	}
	t.Cleanup(func() {
		for _, hc := range clients {
			hc.CloseIdleConnections()
		}
	})
	var mu sync.Mutex
	codes := map[int]int{}
	var errs []error
	flood := func(n int) {
		var next atomic.Int64
		var wg sync.WaitGroup
		for range workers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				local := map[int]int{}
				for {
					i := next.Add(1) - 1
					if i >= int64(n) {
						break
					}
					id := sandboxid.New()
					req, _ := http.NewRequestWithContext(context.Background(), "GET", "http://"+route+"/health", nil)
					if i%2 == 0 {
						req.Host = "49983-" + id + ".cube.test"
					} else {
						req.Host = "cube.test"
						req.Header.Set(proxy.HeaderSandboxID, id)
						req.Header.Set(proxy.HeaderSandboxPort, "49983")
					}
					resp, err := clients[i%sources].Do(req)
					if err != nil {
						mu.Lock()
						errs = append(errs, err)
						mu.Unlock()
						continue
					}
					_, _ = io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
					local[resp.StatusCode]++
				}
				mu.Lock()
				for k, v := range local {
					codes[k] += v
				}
				mu.Unlock()
			}()
		}
		wg.Wait()
	}
	// Two halves: the second shows growth levels off (bounded, not per ID).
	start := time.Now()
	flood(n / 2)
	heapHalf, _ := heap()
	flood(n - n/2)
	took := time.Since(start)

	series1 := seriesIDs()
	act1, routes1 := svc.PerIDState()
	neg1 := routes.Negative()
	heap1, rss1 := heap()
	t.Logf("%d random IDs (Host and E2b-Sandbox-Id, %d sources) in %s (%.0f/s): answers %v, %d transport errors",
		n, sources, took.Round(time.Millisecond), float64(n)/took.Seconds(), codes, len(errs))
	t.Logf("per-ID metric series %d -> %d; master activity entries %d -> %d, cached routes %d -> %d; negative cache %d -> %d (bound 10000)",
		len(series0), len(series1), act0, act1, routes0, routes1, neg0, neg1)
	t.Logf("Go heap in use after GC %.1f -> %.1f (after the first half) -> %.1f MiB (%+.1f, second half %+.1f); process RSS %.1f -> %.1f MiB",
		mib(heap0), mib(heapHalf), mib(heap1), mib(heap1)-mib(heap0), mib(heap1)-mib(heapHalf), mib(rss0), mib(rss1))

	if len(errs) > 0 {
		t.Fatalf("%d requests failed in transport, first: %v", len(errs), errs[0])
	}
	for code := range codes {
		if code != http.StatusBadGateway && code != http.StatusTooManyRequests {
			t.Errorf("an unknown ID was answered %d (want 502 or 429): %v", code, codes)
		}
	}
	if codes[http.StatusBadGateway] == 0 {
		t.Errorf("no request reached the master (no 502): %v", codes)
	}
	if len(series1) != len(series0) {
		t.Errorf("per-ID series grew from %d to %d", len(series0), len(series1))
	}
	if act1 > act0 || routes1 > routes0 {
		t.Errorf("the master's per-ID state grew: activity %d -> %d, routes %d -> %d", act0, act1, routes0, routes1)
	}
	if neg1 > 10000 {
		t.Errorf("negative cache holds %d IDs, bound 10000", neg1)
	}
	if heap1 > heap0 && heap1-heap0 > 16<<20 {
		t.Errorf("heap in use grew by %.1f MiB, bound 16", mib(heap1-heap0))
	}
	if n >= 20000 && heap1 > heapHalf && heap1-heapHalf > 4<<20 {
		t.Errorf("heap in use grew by %.1f MiB in the second half of the flood: it grows with the IDs", mib(heap1-heapHalf))
	}
	if code, _ := get(t, http.DefaultClient, "http://"+route+"/health", "49983-"+sb.SandboxID+".cube.test", nil); code != http.StatusNoContent {
		t.Fatalf("control: the real sandbox after the flood: %d", code)
	}
}

func keys(m map[string]bool) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	return out
}

func mib(b uint64) float64 { return float64(b) / (1 << 20) }

// vmRSS is this process's resident set (the master runs in it).
func vmRSS(t *testing.T) uint64 {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			var kb uint64
			if _, err := fmt.Sscan(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), &kb); err == nil {
				return kb << 10
			}
		}
	}
	return 0
}
