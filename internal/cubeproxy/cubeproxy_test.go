package cubeproxy_test

import (
	"bufio"
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	cubeletpb "github.com/cubesandbox/cube/api/cubelet/v1"
	"github.com/cubesandbox/cube/api/envd/process/processconnect"
	masterpb "github.com/cubesandbox/cube/api/master/v1"
	"github.com/cubesandbox/cube/internal/cubeproxy"
	"github.com/cubesandbox/cube/internal/envdtest"
	"github.com/cubesandbox/cube/internal/master/mastertest"
	"github.com/cubesandbox/cube/internal/nsdial"
	"github.com/cubesandbox/cube/internal/proxy"
	"github.com/cubesandbox/cube/internal/sandboxid"
)

type created struct {
	SandboxID          string  `json:"sandboxID"`
	EnvdAccessToken    string  `json:"envdAccessToken"`
	TrafficAccessToken *string `json:"trafficAccessToken"`
}

// webScript answers every connection with a small HTTP response.
const webScript = `cr=$(printf '\r')
while IFS= read -r l; do case "$l" in "$cr"|"") break;; esac; done
printf 'HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 6\r\nConnection: close\r\n\r\nhello\n'`

// wsScript accepts a WebSocket upgrade and then echoes every byte.
const wsScript = `cr=$(printf '\r')
while IFS= read -r l; do case "$l" in "$cr"|"") break;; esac; done
printf 'HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n'
exec cat`

// headerTransport names the sandbox and port the way the SDKs do with
// E2B_SANDBOX_URL.
type headerTransport struct {
	id, port, token string
}

func (h headerTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set(proxy.HeaderSandboxID, h.id)
	r.Header.Set(proxy.HeaderSandboxPort, h.port)
	if h.token != "" {
		r.Header.Set("X-Access-Token", h.token)
	}
	return http.DefaultTransport.RoundTrip(r)
}

func processClient(addr string, sb created) processconnect.ProcessClient {
	hc := &http.Client{Transport: headerTransport{id: sb.SandboxID, port: "49983", token: sb.EnvdAccessToken}}
	return processconnect.NewProcessClient(hc, "http://"+addr)
}

// serve starts a long-running command in the sandbox through the proxy and
// keeps its stream open until the test ends.
func serve(t *testing.T, addr string, sb created, script string) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	s, err := processClient(addr, sb).Start(ctx, envdtest.Sh(script))
	if err != nil {
		cancel()
		t.Fatalf("start server: %v", err)
	}
	if !s.Receive() {
		cancel()
		t.Fatalf("start server: %v", s.Err())
	}
	go func() {
		for s.Receive() {
		}
	}()
	t.Cleanup(func() { cancel(); s.Close() })
}

func get(t *testing.T, hc *http.Client, url, host string, hdr map[string]string) (int, string) {
	t.Helper()
	req, _ := http.NewRequest("GET", url, nil)
	req.Host = host
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	resp, err := hc.Do(req)
	if err != nil {
		t.Fatalf("GET %s (host %s): %v", url, host, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// scrape reads one series' value from a /metrics page; 0 when absent.
func scrape(t *testing.T, addr, series string) float64 {
	t.Helper()
	_, body := get(t, http.DefaultClient, "http://"+addr+"/metrics", addr, nil)
	re := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(series) + ` (\S+)$`)
	m := re.FindStringSubmatch(body)
	if m == nil {
		return 0
	}
	v, _ := strconv.ParseFloat(m[1], 64)
	return v
}

func TestCubeProxy(t *testing.T) {
	m := mastertest.StartMaster(t, "")
	node := mastertest.StartNode(t, m, "busybox")
	m.WaitHealthy(t, node)
	c := m.API(m.APIKey(t))
	if m.Server.Proxy == nil {
		t.Fatal("the master does not run cubeproxy in-process")
	}
	inproc, inprocMetrics := m.Server.ProxyAddr, m.Server.ProxyMetricsAddr

	// A standalone replica, as cmd/cubeproxy runs it, over the admin socket.
	// Replicas live until the whole test ends, whichever subtest starts them.
	owner := t
	startReplica := func(t *testing.T, listen string) *cubeproxy.Server {
		t.Helper()
		conn, err := cubeproxy.DialMaster(m.Socket, "", nil)
		if err != nil {
			t.Fatal(err)
		}
		p, err := cubeproxy.Start(context.Background(), cubeproxy.Config{Listen: listen, MetricsListen: "127.0.0.1:0", Domain: "cube.test", ID: "replica-" + listen},
			masterpb.NewRouteServiceClient(conn), mastertest.Log(t).With("replica", listen))
		if err != nil {
			conn.Close()
			t.Fatal(err)
		}
		owner.Cleanup(func() {
			if err := p.Stop(); err != nil {
				owner.Errorf("stop replica %s: %v", listen, err)
			}
			conn.Close()
		})
		mastertest.WaitFor(t, 10*time.Second, "replica watching", func() bool { return p.Routes != nil && watching(p) })
		return p
	}
	replica := startReplica(t, "127.0.0.1:0")

	create := func(t *testing.T, body map[string]any) created {
		t.Helper()
		body["templateID"] = "busybox"
		var sb created
		if r := c.Do(t, "POST", "/v2/sandboxes", body, &sb); r.StatusCode != http.StatusCreated {
			t.Fatalf("create: %d %s", r.StatusCode, r.Body)
		}
		t.Cleanup(func() { c.Do(t, "DELETE", "/sandboxes/"+sb.SandboxID, nil, nil) })
		return sb
	}
	state := func(t *testing.T, id string) string {
		var d struct {
			State string `json:"state"`
		}
		c.Do(t, "GET", "/sandboxes/"+id, nil, &d)
		return d.State
	}

	web := create(t, map[string]any{"timeout": 300, "autoPause": true, "autoResume": map[string]any{"enabled": true}})
	serve(t, inproc, web, "cat > /tmp/web.sh <<'EOF'\n"+webScript+"\nEOF\ncat > /tmp/ws.sh <<'EOF'\n"+wsScript+
		"\nEOF\nnc -ll -p 8001 -e /bin/sh /tmp/ws.sh & exec nc -ll -p 8000 -e /bin/sh /tmp/web.sh")
	host := "8000-" + web.SandboxID + ".cube.test"

	t.Run("web server at its port URL, every replica", func(t *testing.T) {
		for _, addr := range []string{inproc, replica.Addr} {
			var code int
			var body string
			mastertest.WaitFor(t, 10*time.Second, "web server up", func() bool {
				code, body = get(t, http.DefaultClient, "http://"+addr+"/", host, nil)
				return code == 200
			})
			if body != "hello\n" {
				t.Fatalf("%s: %d %q", addr, code, body)
			}
			code, body = get(t, http.DefaultClient, "http://"+addr+"/", addr,
				map[string]string{proxy.HeaderSandboxID: web.SandboxID, proxy.HeaderSandboxPort: "8000"})
			if code != 200 || body != "hello\n" {
				t.Fatalf("%s by headers: %d %q", addr, code, body)
			}
		}
		if code, body := get(t, http.DefaultClient, "http://"+inproc+"/_cube/info", "49983-"+web.SandboxID+".cube.test", nil); code != http.StatusBadGateway ||
			!strings.Contains(body, "internal to the node") {
			t.Fatalf("agent-internal path proxied: %d %s", code, body)
		}
	})

	t.Run("WebSocket upgrade echoes both ways", func(t *testing.T) {
		conn, err := net.Dial("tcp", replica.Addr)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		if err := conn.SetDeadline(time.Now().Add(10 * time.Second)); err != nil {
			t.Fatal(err)
		}
		fmt.Fprintf(conn, "GET /ws HTTP/1.1\r\nHost: 8001-%s.cube.test\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"+
			"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n", web.SandboxID)
		br := bufio.NewReader(conn)
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatalf("upgrade: %v", err)
		}
		resp.Body.Close() // a 101 has none: the connection carries on in br
		if resp.StatusCode != http.StatusSwitchingProtocols {
			t.Fatalf("upgrade: %v", resp)
		}
		for _, msg := range []string{"ping 1\n", "ping 2\n"} {
			if _, err := io.WriteString(conn, msg); err != nil {
				t.Fatal(err)
			}
			line, err := br.ReadString('\n')
			if err != nil || line != msg {
				t.Fatalf("echo: %q %v", line, err)
			}
		}
	})

	t.Run("Connect stream is not buffered", func(t *testing.T) {
		firstAt, endAt := envdtest.Unbuffered(t, processClient(replica.Addr, web))
		t.Logf("first event after %s, end after %s", firstAt, endAt)
	})

	t.Run("latency of the proxy hop", func(t *testing.T) {
		resp, err := node.Client.GetSandbox(context.Background(), &cubeletpb.GetSandboxRequest{SandboxId: web.SandboxID})
		if err != nil {
			t.Fatal(err)
		}
		netns := fmt.Sprintf("/proc/%d/ns/net", resp.Sandbox.Pid)
		direct := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return nsdial.DialContext(ctx, netns, "tcp", "127.0.0.1:49983")
		}}}
		viaProxy := &http.Client{Transport: &http.Transport{}}
		median := func(hc *http.Client, url, host string) time.Duration {
			ds := make([]time.Duration, 0, 1000)
			for range 1000 {
				s := time.Now()
				if code, _ := get(t, hc, url, host, nil); code != http.StatusNoContent {
					t.Fatalf("health: %d", code)
				}
				ds = append(ds, time.Since(s))
			}
			slices.Sort(ds)
			return ds[len(ds)/2]
		}
		d := median(direct, "http://sandbox/health", "sandbox")
		p := median(viaProxy, "http://"+replica.Addr+"/health", "49983-"+web.SandboxID+".cube.test")
		t.Logf("LATENCY proxy hop: median of 1000 GET /health: direct (netns) %s, via cubeproxy %s, added %s", d, p, p-d)
	})

	t.Run("token checks", func(t *testing.T) {
		sec := create(t, map[string]any{"timeout": 120, "network": map[string]any{"allowPublicTraffic": false}})
		if sec.TrafficAccessToken == nil || *sec.TrafficAccessToken == "" {
			t.Fatalf("no traffic token: %+v", sec)
		}
		serve(t, inproc, sec, "cat > /tmp/web.sh <<'EOF'\n"+webScript+"\nEOF\nexec nc -ll -p 8000 -e /bin/sh /tmp/web.sh")
		h := "8000-" + sec.SandboxID + ".cube.test"
		for name, tok := range map[string]string{"missing": "", "wrong": "nope"} {
			hdr := map[string]string{}
			if tok != "" {
				hdr[proxy.HeaderTrafficToken] = tok
			}
			if code, body := get(t, http.DefaultClient, "http://"+replica.Addr+"/", h, hdr); code != http.StatusUnauthorized {
				t.Fatalf("%s token: %d %s", name, code, body)
			}
		}
		mastertest.WaitFor(t, 10*time.Second, "served with the right token", func() bool {
			code, body := get(t, http.DefaultClient, "http://"+replica.Addr+"/", h, map[string]string{proxy.HeaderTrafficToken: *sec.TrafficAccessToken})
			return code == 200 && body == "hello\n"
		})
		// envd's port is guarded by the envd access token instead.
		hc := &http.Client{Transport: headerTransport{id: sec.SandboxID, port: "49983"}}
		if code, _ := get(t, hc, "http://"+replica.Addr+"/envs", replica.Addr, nil); code != http.StatusUnauthorized {
			t.Fatalf("envd without its token: %d", code)
		}
	})

	t.Run("paused without autoResume answers 502", func(t *testing.T) {
		plain := create(t, map[string]any{"timeout": 120})
		if r := c.Do(t, "POST", "/sandboxes/"+plain.SandboxID+"/pause", nil, nil); r.StatusCode != http.StatusNoContent {
			t.Fatalf("pause: %d %s", r.StatusCode, r.Body)
		}
		code, body := get(t, http.DefaultClient, "http://"+replica.Addr+"/health", "49983-"+plain.SandboxID+".cube.test", nil)
		if code != http.StatusBadGateway || !strings.Contains(body, "autoResume") || !strings.Contains(body, plain.SandboxID) {
			t.Fatalf("paused: %d %s", code, body)
		}
	})

	pause := func(t *testing.T, id string) {
		t.Helper()
		if r := c.Do(t, "POST", "/sandboxes/"+id+"/pause", nil, nil); r.StatusCode != http.StatusNoContent {
			t.Fatalf("pause: %d %s", r.StatusCode, r.Body)
		}
	}
	resumes := func(t *testing.T) float64 {
		s := `cubeproxy_resumes_total{sandbox_id="` + web.SandboxID + `"}`
		return scrape(t, inprocMetrics, s) + scrape(t, replica.MetricsAddr, s)
	}

	t.Run("auto-resume on the first request", func(t *testing.T) {
		pause(t, web.SandboxID)
		before := resumes(t)
		start := time.Now()
		code, body := get(t, http.DefaultClient, "http://"+replica.Addr+"/", host, nil)
		took := time.Since(start)
		if code != 200 || body != "hello\n" {
			t.Fatalf("after auto-resume: %d %q", code, body)
		}
		if st := state(t, web.SandboxID); st != "running" {
			t.Fatalf("state %s", st)
		}
		if n := resumes(t) - before; n != 1 {
			t.Fatalf("%v resumes", n)
		}
		t.Logf("LATENCY auto-resume (runc): first request to answer %s", took)
	})

	t.Run("a paused private sandbox resumes only for its tokens", func(t *testing.T) {
		priv := create(t, map[string]any{"timeout": 300, "autoPause": true, "autoResume": map[string]any{"enabled": true},
			"secure": true, "network": map[string]any{"allowPublicTraffic": false}})
		if priv.TrafficAccessToken == nil || priv.EnvdAccessToken == "" {
			t.Fatalf("want both tokens: %+v", priv)
		}
		serve(t, replica.Addr, priv, "cat > /tmp/web.sh <<'EOF'\n"+webScript+"\nEOF\nexec nc -ll -p 8000 -e /bin/sh /tmp/web.sh")
		ph := "8000-" + priv.SandboxID + ".cube.test"
		mastertest.WaitFor(t, 10*time.Second, "the web server", func() bool {
			code, _ := get(t, http.DefaultClient, "http://"+replica.Addr+"/", ph, map[string]string{proxy.HeaderTrafficToken: *priv.TrafficAccessToken})
			return code == http.StatusOK
		})
		pause(t, priv.SandboxID)
		eh := "49983-" + priv.SandboxID + ".cube.test"
		for _, c := range []struct {
			name, host string
			hdr        map[string]string
		}{
			{"its port, no token", ph, nil},
			{"its port, a wrong token", ph, map[string]string{proxy.HeaderTrafficToken: "nope"}},
			{"its port, the envd token", ph, map[string]string{proxy.HeaderTrafficToken: priv.EnvdAccessToken}},
			{"envd's port, no token", eh, nil},
			{"envd's port, the traffic token", eh, map[string]string{proxy.HeaderEnvdToken: *priv.TrafficAccessToken}},
		} {
			code, body := get(t, http.DefaultClient, "http://"+replica.Addr+"/", c.host, c.hdr)
			if code != http.StatusUnauthorized {
				t.Fatalf("%s: %d %s, want 401", c.name, code, body)
			}
			if st := state(t, priv.SandboxID); st != "paused" {
				t.Fatalf("%s: the sandbox is %s, want still paused", c.name, st)
			}
			t.Logf("%s: 401, still paused", c.name)
		}
		// Controls: the same requests with the right tokens resume it.
		code, body := get(t, http.DefaultClient, "http://"+replica.Addr+"/", ph, map[string]string{proxy.HeaderTrafficToken: *priv.TrafficAccessToken})
		if code != 200 || body != "hello\n" || state(t, priv.SandboxID) != "running" {
			t.Fatalf("control: the traffic token: %d %q, %s", code, body, state(t, priv.SandboxID))
		}
		pause(t, priv.SandboxID)
		code, _ = get(t, http.DefaultClient, "http://"+replica.Addr+"/health", eh, map[string]string{proxy.HeaderEnvdToken: priv.EnvdAccessToken})
		if code != http.StatusNoContent || state(t, priv.SandboxID) != "running" {
			t.Fatalf("control: envd's port with its token: %d, %s", code, state(t, priv.SandboxID))
		}
		t.Log("controls: the right token resumes it on either port")
	})

	t.Run("100 concurrent requests to a paused sandbox resume it once", func(t *testing.T) {
		pause(t, web.SandboxID)
		before := resumes(t)
		var wg sync.WaitGroup
		errs := make(chan string, 100)
		for i := range 100 {
			addr := inproc
			if i%2 == 1 {
				addr = replica.Addr
			}
			wg.Go(func() {
				req, _ := http.NewRequest("GET", "http://"+addr+"/health", nil)
				req.Host = "49983-" + web.SandboxID + ".cube.test"
				// Resuming for envd's port needs envd's token.
				req.Header.Set(proxy.HeaderEnvdToken, web.EnvdAccessToken)
				resp, err := http.DefaultClient.Do(req)
				if err != nil {
					errs <- err.Error()
					return
				}
				_, _ = io.Copy(io.Discard, resp.Body) // only the status matters
				resp.Body.Close()
				if resp.StatusCode != http.StatusNoContent {
					errs <- resp.Status
				}
			})
		}
		wg.Wait()
		close(errs)
		for e := range errs {
			t.Error(e)
		}
		if n := resumes(t) - before; n != 1 {
			t.Fatalf("%v resumes across two replicas, want 1", n)
		}
	})

	t.Run("commands started back to back on fresh sandboxes complete", func(t *testing.T) {
		// What an SDK does: create, run a command, touch the API, run
		// another, from several clients at once. Each Start streams its
		// first event back while the proxy may still be forwarding the
		// request body; a proxy that is not full duplex breaks a few of
		// these streams mid-answer ("incomplete envelope: unexpected EOF").
		var broken, ran atomic.Int64
		var wg sync.WaitGroup
		for g := range 4 {
			wg.Go(func() {
				for range 12 {
					var sb created
					if r := c.Do(t, "POST", "/v2/sandboxes", map[string]any{"templateID": "busybox", "timeout": 120}, &sb); r.StatusCode != http.StatusCreated {
						t.Errorf("create: %d %s", r.StatusCode, r.Body)
						return
					}
					for k := range 3 {
						req := envdtest.Sh("echo mine > /tmp/owner; cat /tmp/owner")
						req.Header().Set("Keepalive-Ping-Interval", "50")
						s, err := processClient(replica.Addr, sb).Start(context.Background(), req)
						if err != nil {
							t.Errorf("client %d, %s, command %d: start: %v", g, sb.SandboxID, k, err)
							continue
						}
						n := 0
						for s.Receive() {
							n++
						}
						s.Close()
						ran.Add(1)
						if err := s.Err(); err != nil {
							broken.Add(1)
							t.Errorf("client %d, %s, command %d: stream broken after %d events: %v", g, sb.SandboxID, k, n, err)
						}
						c.Do(t, "POST", "/sandboxes/"+sb.SandboxID+"/timeout", map[string]any{"timeout": 200}, nil)
					}
					c.Do(t, "DELETE", "/sandboxes/"+sb.SandboxID, nil, nil)
				}
			})
		}
		wg.Wait()
		t.Logf("%d commands, %d streams broken", ran.Load(), broken.Load())
	})

	t.Run("idle policy pauses only when nothing is open", func(t *testing.T) {
		idle := create(t, map[string]any{"timeout": 120, "idleTimeout": 1})
		// An open stream (a running command) keeps it awake past the timeout.
		s, err := processClient(replica.Addr, idle).Start(context.Background(), envdtest.Sh("sleep 3; echo done"))
		if err != nil {
			t.Fatal(err)
		}
		for s.Receive() {
		}
		s.Close()
		if s.Err() != nil {
			t.Fatal(s.Err())
		}
		if st := state(t, idle.SandboxID); st != "running" {
			t.Fatalf("paused while a command ran: %s", st)
		}
		mastertest.WaitFor(t, 10*time.Second, "idle pause", func() bool { return state(t, idle.SandboxID) == "paused" })
	})

	t.Run("a proxy restart loses nothing", func(t *testing.T) {
		addr := replica.Addr
		if err := replica.Stop(); err != nil {
			t.Fatal(err)
		}
		again := startReplica(t, addr)
		if code, body := get(t, http.DefaultClient, "http://"+again.Addr+"/", host, nil); code != 200 || body != "hello\n" {
			t.Fatalf("after restart: %d %q", code, body)
		}
		replica = again
	})

	t.Run("a killed sandbox answers a clear error at once", func(t *testing.T) {
		// Both replicas have its route cached; the kill invalidates it.
		get(t, http.DefaultClient, "http://"+inproc+"/", host, nil)
		get(t, http.DefaultClient, "http://"+replica.Addr+"/", host, nil)
		if r := c.Do(t, "DELETE", "/sandboxes/"+web.SandboxID, nil, nil); r.StatusCode != http.StatusNoContent {
			t.Fatalf("kill: %d %s", r.StatusCode, r.Body)
		}
		for _, addr := range []string{inproc, replica.Addr} {
			start := time.Now()
			code, body := get(t, http.DefaultClient, "http://"+addr+"/", host, nil)
			if code != http.StatusBadGateway || !strings.Contains(body, web.SandboxID) || !strings.Contains(body, "not found") {
				t.Fatalf("%s: killed sandbox: %d %s", addr, code, body)
			}
			if d := time.Since(start); d > time.Second {
				t.Fatalf("killed sandbox answered after %s", d)
			}
		}
	})

	t.Run("RouteService and create validate input", func(t *testing.T) {
		conn, err := cubeproxy.DialMaster(m.Socket, "", nil)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		rs := masterpb.NewRouteServiceClient(conn)
		ctx := context.Background()
		for id, want := range map[string]codes.Code{"": codes.InvalidArgument, "../x": codes.InvalidArgument, "nosuchsandbox0000000": codes.NotFound} {
			if _, err := rs.ResolveRoute(ctx, &masterpb.ResolveRouteRequest{SandboxId: id, Resume: true}); status.Code(err) != want {
				t.Errorf("resolve %q: %v, want %s", id, err, want)
			}
		}
		for name, req := range map[string]*masterpb.ReportActivityRequest{
			"no proxy id":     {Sandboxes: []*masterpb.SandboxActivity{{SandboxId: "abc", InFlight: 1}}},
			"bad sandbox id":  {ProxyId: "p", Sandboxes: []*masterpb.SandboxActivity{{SandboxId: "a b"}}},
			"negative counts": {ProxyId: "p", Sandboxes: []*masterpb.SandboxActivity{{SandboxId: "abc", InFlight: -1}}},
		} {
			if _, err := rs.ReportActivity(ctx, req); status.Code(err) != codes.InvalidArgument {
				t.Errorf("%s: %v", name, err)
			}
		}
		for _, idle := range []any{-1, 1 << 40, "soon"} {
			r := c.Do(t, "POST", "/v2/sandboxes", map[string]any{"templateID": "busybox", "idleTimeout": idle}, nil)
			if r.StatusCode != http.StatusBadRequest {
				t.Errorf("idleTimeout %v: %d %s", idle, r.StatusCode, r.Body)
			}
		}
	})

	t.Run("IDs that resolve to nothing leave no per-sandbox state", func(t *testing.T) {
		// Series labelled with a sandbox ID on the replica's /metrics.
		series := func() int {
			_, page := get(t, http.DefaultClient, "http://"+replica.MetricsAddr+"/metrics", replica.MetricsAddr, nil)
			return len(regexp.MustCompile(`(?m)^cubeproxy_\w+\{[^}]*sandbox_id="[^"]+"`).FindAllString(page, -1))
		}
		sec := create(t, map[string]any{"timeout": 120, "network": map[string]any{"allowPublicTraffic": false}})
		serve(t, replica.Addr, sec, "cat > /tmp/web.sh <<'EOF'\n"+webScript+"\nEOF\nexec nc -ll -p 8000 -e /bin/sh /tmp/web.sh")
		before := series()
		const n = 2000
		for i := range n {
			id := sandboxid.New()
			if i%2 == 1 {
				// A real sandbox with a wrong traffic token: refused too (401;
				// an unknown ID is 502, E2B's "sandbox not found", or 429
				// once this client asked for too many).
				id = sec.SandboxID
			}
			if code, body := get(t, http.DefaultClient, "http://"+replica.Addr+"/", "8000-"+id+".cube.test", map[string]string{proxy.HeaderTrafficToken: "wrong"}); code != http.StatusBadGateway && code != http.StatusUnauthorized && code != http.StatusTooManyRequests {
				t.Fatalf("request %d for %s: %d %s", i, id, code, body)
			}
		}
		if after := series(); after != before {
			t.Fatalf("%d refused requests (unknown IDs, a wrong token) grew the labelled series from %d to %d", n, before, after)
		}
		t.Logf("%d refused requests: labelled series %d before and after", n, before)
		// Control: the same request with the right token is admitted and
		// its sandbox gets its series.
		mastertest.WaitFor(t, 10*time.Second, "served with the right token", func() bool {
			code, _ := get(t, http.DefaultClient, "http://"+replica.Addr+"/", "8000-"+sec.SandboxID+".cube.test", map[string]string{proxy.HeaderTrafficToken: *sec.TrafficAccessToken})
			return code == http.StatusOK
		})
		// The handler counts a request after its response went out, so
		// the client can read /metrics a moment before the count lands.
		mastertest.WaitFor(t, 5*time.Second, "the admitted request's labelled series", func() bool { return series() > before })
	})

	t.Run("unknown IDs cost the master little", func(t *testing.T) {
		conn, err := cubeproxy.DialMaster(m.Socket, "", nil)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		cc := &countingRoutes{RouteServiceClient: masterpb.NewRouteServiceClient(conn)}
		p, err := cubeproxy.Start(context.Background(), cubeproxy.Config{Listen: "127.0.0.1:0", Domain: "cube.test", ID: "counting"}, cc, mastertest.Log(t))
		if err != nil {
			t.Fatal(err)
		}
		defer func() {
			if err := p.Stop(); err != nil {
				t.Error(err)
			}
		}()
		mastertest.WaitFor(t, 10*time.Second, "replica watching", func() bool { return watching(p) })
		known := create(t, map[string]any{"timeout": 120})
		health := func(hc *http.Client, id string) int {
			code, _ := get(t, hc, "http://"+p.Addr+"/health", "49983-"+id+".cube.test", nil)
			return code
		}
		if code := health(http.DefaultClient, known.SandboxID); code != http.StatusNoContent {
			t.Fatalf("a running sandbox: %d", code)
		}

		// The same unknown ID asked 50 times: the master is asked once.
		unknown, calls := sandboxid.New(), cc.n.Load()
		for range 50 {
			if code := health(http.DefaultClient, unknown); code != http.StatusBadGateway {
				t.Fatalf("unknown ID: %d", code)
			}
		}
		if n := cc.n.Load() - calls; n != 1 {
			t.Fatalf("50 requests for one unknown ID asked the master %d times, want 1", n)
		}

		// 2,000 distinct random IDs from one client.
		calls, start := cc.n.Load(), time.Now()
		codes := map[int]int{}
		for range 2000 {
			codes[health(http.DefaultClient, sandboxid.New())]++
		}
		took, asked := time.Since(start), cc.n.Load()-calls
		bound := int64(100 + 20*took.Seconds() + 5)
		t.Logf("2000 random IDs from one client in %s: answers %v, the master asked %d times (bound %d), %d IDs remembered as unknown",
			took.Round(time.Millisecond), codes, asked, bound, p.Routes.Negative())
		if codes[http.StatusTooManyRequests] == 0 || asked > bound {
			t.Fatalf("the flood was not limited: answers %v, master asked %d times (bound %d)", codes, asked, bound)
		}
		// Controls: the same client still reaches the sandbox it uses (its
		// route is cached), and another client's unknown ID is asked for
		// (502, not 429): the limit is per client and per unknown ID.
		if code := health(http.DefaultClient, known.SandboxID); code != http.StatusNoContent {
			t.Fatalf("control: the limited client's own sandbox: %d", code)
		}
		other := &http.Client{Transport: &http.Transport{DialContext: (&net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP("127.0.0.2")}}).DialContext}}
		if code := health(other, sandboxid.New()); code != http.StatusBadGateway {
			t.Fatalf("control: another client's unknown ID: %d, want 502", code)
		}
		t.Log("controls: the limited client reaches its own sandbox; another client is not limited")
	})

	t.Run("metrics and TLS", func(t *testing.T) {
		if v := scrape(t, inprocMetrics, `cubeproxy_in_flight`); v < 0 {
			t.Fatalf("in flight %v", v)
		}
		// The data-plane listeners do not serve /metrics (its series name
		// live sandboxes); their metrics listeners do (the control).
		for _, addr := range []string{inproc, replica.Addr} {
			if code, body := get(t, http.DefaultClient, "http://"+addr+"/metrics", addr, nil); code == http.StatusOK || strings.Contains(body, "cubeproxy_") {
				t.Fatalf("the route at %s served /metrics: %d", addr, code)
			} else {
				t.Logf("GET /metrics on the route %s: %d", addr, code)
			}
		}
		_, page := get(t, http.DefaultClient, "http://"+inprocMetrics+"/metrics", inprocMetrics, nil)
		for _, want := range []string{"cubeproxy_requests_total{", "cubeproxy_bytes_total{", "cubeproxy_request_duration_seconds_bucket{"} {
			if !strings.Contains(page, want) {
				t.Errorf("/metrics lacks %s", want)
			}
		}
		conn, err := cubeproxy.DialMaster(m.Socket, "", nil)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		p, err := cubeproxy.Start(context.Background(), cubeproxy.Config{Listen: "127.0.0.1:0", Domain: "cube.test", TLS: cubeproxy.TLSConfig{SelfSigned: true}},
			masterpb.NewRouteServiceClient(conn), mastertest.Log(t))
		if err != nil {
			t.Fatal(err)
		}
		defer func() {
			if err := p.Stop(); err != nil {
				t.Error(err)
			}
		}()
		hc := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}, ForceAttemptHTTP2: true}}
		resp, err := hc.Get("https://" + p.Addr + "/health")
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != 200 || resp.ProtoMajor != 2 || resp.TLS == nil ||
			!slices.Contains(resp.TLS.PeerCertificates[0].DNSNames, "*.cube.test") {
			t.Fatalf("TLS: %s %s", resp.Status, resp.Proto)
		}
	})
}

func watching(p *cubeproxy.Server) bool { return p.Routes.Watching() }

// countingRoutes counts the ResolveRoute calls a replica makes to the
// real master.
type countingRoutes struct {
	masterpb.RouteServiceClient
	n atomic.Int64
}

func (c *countingRoutes) ResolveRoute(ctx context.Context, in *masterpb.ResolveRouteRequest, opts ...grpc.CallOption) (*masterpb.ResolveRouteResponse, error) {
	c.n.Add(1)
	return c.RouteServiceClient.ResolveRoute(ctx, in, opts...)
}
