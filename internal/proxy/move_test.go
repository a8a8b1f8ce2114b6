package proxy_test

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/proxy"
)

// frozenNode plays a sandbox's node while the sandbox is frozen for a
// move: it accepts connections and reads requests (headers, and the body
// too when readBody), never answers, and destroy closes every connection
// and the listener, as destroying the frozen original does.
type frozenNode struct {
	ln       net.Listener
	mu       sync.Mutex
	conns    []net.Conn
	requests atomic.Int32
}

func startFrozen(t *testing.T, addr string, readBody bool) *frozenNode {
	t.Helper()
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	f := &frozenNode{ln: ln}
	t.Cleanup(f.destroy)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			f.mu.Lock()
			f.conns = append(f.conns, c)
			f.mu.Unlock()
			go func() {
				br := bufio.NewReader(c)
				req, err := http.ReadRequest(br)
				if err != nil {
					return
				}
				f.requests.Add(1)
				if readBody {
					_, _ = io.Copy(io.Discard, req.Body)
				}
			}()
		}
	}()
	return f
}

func (f *frozenNode) destroy() {
	f.ln.Close()
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, c := range f.conns {
		c.Close()
	}
	f.conns = nil
}

// liveNode is the sandbox on its new node: it answers every request with
// its method, path and body, and counts them.
func startLive(t *testing.T, addr string) (*http.Server, *atomic.Int32) {
	t.Helper()
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	var n atomic.Int32
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n.Add(1)
		b, _ := io.ReadAll(r.Body)
		fmt.Fprintf(w, "new node: %s %s %s", r.Method, r.URL.Path, b)
	})}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { srv.Close() })
	return srv, &n
}

// moveResolver plays the master's route through a move: the old place
// until the move begins; while it moves, a resolve waits (the master
// holds it) until the move ends, or fails Aborted when it does not end
// in time (the master's bound); then the new place. It caches the way
// cubeproxy's route cache does: until Forget, a resolve answers what it
// answered before, even after the move.
type moveResolver struct {
	mu       sync.Mutex
	cur      *proxy.Target
	cached   *proxy.Target
	moving   chan struct{} // closed when the move ends
	bound    time.Duration
	resolves atomic.Int32
	forgets  atomic.Int32
}

func (m *moveResolver) Resolve(ctx context.Context, id string) (*proxy.Target, error) {
	m.resolves.Add(1)
	m.mu.Lock()
	if m.cached != nil {
		t := m.cached
		m.mu.Unlock()
		return t, nil
	}
	moving := m.moving
	m.mu.Unlock()
	if moving != nil {
		select {
		case <-moving:
		case <-time.After(m.bound):
			return nil, fmt.Errorf("sandbox %s is being moved to another node and still was after %s; try again: %w", id, m.bound, errdefs.ErrAborted)
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	m.cached = m.cur
	return m.cur, nil
}

func (m *moveResolver) Forget(string) {
	m.forgets.Add(1)
	m.mu.Lock()
	m.cached = nil
	m.mu.Unlock()
}

// begin starts the move: resolves not answered from the cache wait.
func (m *moveResolver) begin() {
	m.mu.Lock()
	m.moving = make(chan struct{})
	m.mu.Unlock()
}

// end finishes the move at to.
func (m *moveResolver) end(to *proxy.Target) {
	m.mu.Lock()
	m.cur = to
	m.cached = nil
	close(m.moving)
	m.moving = nil
	m.mu.Unlock()
}

func routeWith(t *testing.T, cfg proxy.Config) string {
	t.Helper()
	addr, _ := routeHandler(t, cfg)
	return addr
}

func routeHandler(t *testing.T, cfg proxy.Config) (string, *proxy.Handler) {
	t.Helper()
	cfg.Domain = "cube.test"
	h := proxy.New(cfg)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = h.Serve(ctx, ln); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	return ln.Addr().String(), h
}

type answer struct {
	code  int
	body  string
	retry string
	err   error
}

func sendTo(route string, port int, method, body string) <-chan answer {
	ch := make(chan answer, 1)
	go func() {
		var rd io.Reader
		if body != "" {
			rd = strings.NewReader(body)
		}
		req, _ := http.NewRequest(method, "http://"+route+"/work", rd)
		req.Host = fmt.Sprintf("%d-sbmove.cube.test", port)
		resp, err := (&http.Client{Timeout: 20 * time.Second}).Do(req)
		if err != nil {
			ch <- answer{err: err}
			return
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		ch <- answer{code: resp.StatusCode, body: strings.TrimSpace(string(b)), retry: resp.Header.Get("Retry-After")}
	}()
	return ch
}

// sendRaw sends method with an empty chunked body ("0\r\n\r\n"), and
// header (one "Name: value" line, or none): the request is whole once its
// headers are, and none of its body is ever taken (the proxy's transport
// reads only its end), so whether it reached the old place shows in its
// headers alone.
func sendRaw(route string, port int, method, header string) <-chan answer {
	ch := make(chan answer, 1)
	go func() {
		c, err := net.DialTimeout("tcp", route, 5*time.Second)
		if err != nil {
			ch <- answer{err: err}
			return
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(20 * time.Second))
		if header != "" {
			header += "\r\n"
		}
		if _, err := fmt.Fprintf(c, "%s /work HTTP/1.1\r\nHost: %d-sbmove.cube.test\r\n%sTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n0\r\n\r\n", method, port, header); err != nil {
			ch <- answer{err: err}
			return
		}
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			ch <- answer{err: err}
			return
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		ch <- answer{code: resp.StatusCode, body: strings.TrimSpace(string(b)), retry: resp.Header.Get("Retry-After")}
	}()
	return ch
}

func wait(t *testing.T, ch <-chan answer) answer {
	t.Helper()
	select {
	case a := <-ch:
		if a.err != nil {
			t.Fatalf("request: %v", a.err)
		}
		return a
	case <-time.After(15 * time.Second):
		t.Fatal("no answer in 15 s")
	}
	return answer{}
}

// TestRequestsAcrossAMove: a sandbox moves from one node (127.0.0.2) to
// another (127.0.0.3, the same port) while requests are under way
// through the route, which resolves through a cache (moveResolver).
//
//   - in flight at the freeze: a GET on its way to the frozen original
//     is answered by the new node once the original is destroyed (the
//     control, with NoRetry: 502);
//   - a POST whose body the frozen original read is not sent again: 502,
//     and the new node never sees it (also with the retry on);
//   - a POST the frozen original received whole, none of its (empty)
//     body taken, is not sent again either: 502 (the control: the same
//     POST with an Idempotency-Key is answered by the new node);
//   - a DELETE on a stale cached route, refused at the old place
//     (nothing written there), is sent to the new node once;
//   - after the move, from a stale cached route: a POST whose connection
//     the old place refuses (nothing of its body taken) is sent to the
//     new node once, with its body (the control: 502);
//   - arriving during the move: held, then served by the new node; a
//     move that does not end within the master's bound: 503 with
//     Retry-After;
//   - not a move (the place refuses and the route still names it): 502,
//     after one more resolve.
func TestRequestsAcrossAMove(t *testing.T) {
	probe, err := net.Listen("tcp", "127.0.0.2:0")
	if err != nil {
		t.Fatal(err)
	}
	port := probe.Addr().(*net.TCPAddr).Port
	probe.Close()
	oldAt := net.JoinHostPort("127.0.0.2", strconv.Itoa(port))
	newAt := net.JoinHostPort("127.0.0.3", strconv.Itoa(port))
	oldT := &proxy.Target{SandboxID: "sbmove", NodeID: "n1", HostIP: "127.0.0.2"}
	newT := &proxy.Target{SandboxID: "sbmove", NodeID: "n2", HostIP: "127.0.0.3"}
	_, served := startLive(t, newAt)

	inFlightSent := func(t *testing.T, noRetry bool, method string, send func(route string) <-chan answer) (answer, int32) {
		t.Helper()
		old := startFrozen(t, oldAt, true)
		res := &moveResolver{cur: oldT, bound: 10 * time.Second}
		route := routeWith(t, proxy.Config{Resolver: res, NoRetry: noRetry})
		before := served.Load()
		ch := send(route)
		for deadline := time.Now().Add(5 * time.Second); old.requests.Load() == 0; time.Sleep(5 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatal("the request never reached the frozen original")
			}
		}
		res.begin()
		time.Sleep(100 * time.Millisecond) // the move runs
		res.end(newT)
		old.destroy()
		a := wait(t, ch)
		t.Logf("%s in flight at the freeze, retry %v: %d %q (new node served %d)", method, !noRetry, a.code, a.body, served.Load()-before)
		return a, served.Load() - before
	}
	inFlight := func(t *testing.T, noRetry bool, method, body string) answer {
		t.Helper()
		a, n := inFlightSent(t, noRetry, method, func(route string) <-chan answer { return sendTo(route, port, method, body) })
		if method != http.MethodGet && n != 0 {
			t.Errorf("the new node saw a %s whose body the original had read", method)
		}
		return a
	}

	t.Run("GET in flight at the freeze", func(t *testing.T) {
		if a := inFlight(t, false, http.MethodGet, ""); a.code != http.StatusOK || a.body != "new node: GET /work" {
			t.Fatalf("with the retry: %+v, want 200 from the new node", a)
		}
		if a := inFlight(t, true, http.MethodGet, ""); a.code != http.StatusBadGateway {
			t.Fatalf("control, without the retry: %+v, want 502", a)
		}
	})

	t.Run("POST whose body was taken is not repeated", func(t *testing.T) {
		if a := inFlight(t, false, http.MethodPost, "do it once"); a.code != http.StatusBadGateway {
			t.Fatalf("%+v, want 502", a)
		}
	})

	// The original received the whole POST (headers, and an empty body
	// none of which was taken) and may have acted on it: it is not sent
	// again. Control: the same POST carrying an Idempotency-Key, which
	// its client says may be repeated, is answered by the new node.
	t.Run("POST the original received is not repeated", func(t *testing.T) {
		a, n := inFlightSent(t, false, http.MethodPost, func(route string) <-chan answer { return sendRaw(route, port, http.MethodPost, "") })
		if a.code != http.StatusBadGateway || n != 0 {
			t.Fatalf("%+v (new node served %d), want 502 and nothing there", a, n)
		}
		a, n = inFlightSent(t, false, http.MethodPost, func(route string) <-chan answer {
			return sendRaw(route, port, http.MethodPost, "Idempotency-Key: k1")
		})
		if a.code != http.StatusOK || a.body != "new node: POST /work" || n != 1 {
			t.Fatalf("control, with Idempotency-Key: %+v (new node served %d), want 200 from the new node, once", a, n)
		}
	})

	t.Run("DELETE refused at the old place goes to the new one", func(t *testing.T) {
		res := &moveResolver{cur: newT, cached: oldT}
		route := routeWith(t, proxy.Config{Resolver: res})
		before := served.Load()
		a := wait(t, sendTo(route, port, http.MethodDelete, ""))
		t.Logf("DELETE to a stale route (nothing written there): %d %q", a.code, a.body)
		if a.code != http.StatusOK || a.body != "new node: DELETE /work" || served.Load() != before+1 {
			t.Fatalf("%+v (new node served %d), want 200 from the new node, once", a, served.Load()-before)
		}
	})

	t.Run("POST refused at the old place goes to the new one", func(t *testing.T) {
		for _, noRetry := range []bool{false, true} {
			// The route still caches the old place, where nothing listens
			// now (the original destroyed).
			res := &moveResolver{cur: newT, cached: oldT}
			route := routeWith(t, proxy.Config{Resolver: res, NoRetry: noRetry})
			before := served.Load()
			a := wait(t, sendTo(route, port, http.MethodPost, "payload"))
			t.Logf("POST to a stale route, retry %v: %d %q (forgets %d)", !noRetry, a.code, a.body, res.forgets.Load())
			if noRetry {
				if a.code != http.StatusBadGateway || served.Load() != before {
					t.Fatalf("control: %+v (new node served %d), want 502 and nothing there", a, served.Load()-before)
				}
				continue
			}
			if a.code != http.StatusOK || a.body != "new node: POST /work payload" || served.Load() != before+1 {
				t.Fatalf("%+v (new node served %d), want 200 with the body, once", a, served.Load()-before)
			}
		}
	})

	t.Run("arriving during the move: held, then served or 503", func(t *testing.T) {
		res := &moveResolver{cur: oldT, bound: 10 * time.Second}
		route := routeWith(t, proxy.Config{Resolver: res})
		res.begin()
		began := time.Now()
		ch := sendTo(route, port, http.MethodPost, "new work")
		time.Sleep(300 * time.Millisecond)
		res.end(newT)
		a := wait(t, ch)
		t.Logf("POST arriving during the move: %d %q after %s", a.code, a.body, time.Since(began).Round(time.Millisecond))
		if a.code != http.StatusOK || a.body != "new node: POST /work new work" {
			t.Fatalf("%+v, want 200 from the new node", a)
		}

		res = &moveResolver{cur: oldT, bound: 200 * time.Millisecond}
		route = routeWith(t, proxy.Config{Resolver: res})
		res.begin()
		a = wait(t, sendTo(route, port, http.MethodGet, ""))
		t.Logf("GET during a move past the bound: %d Retry-After %q %q", a.code, a.retry, a.body)
		if a.code != http.StatusServiceUnavailable || a.retry == "" || !strings.Contains(a.body, "being moved") {
			t.Fatalf("%+v, want 503 with Retry-After", a)
		}
	})

	t.Run("not a move", func(t *testing.T) {
		// Nothing listens at the old place, and the route names it still.
		res := &moveResolver{cur: oldT}
		route := routeWith(t, proxy.Config{Resolver: res})
		a := wait(t, sendTo(route, port, http.MethodGet, ""))
		t.Logf("GET to a place that refuses: %d (resolves %d)", a.code, res.resolves.Load())
		if a.code != http.StatusBadGateway || res.resolves.Load() != 2 {
			t.Fatalf("%+v after %d resolves, want 502 after 2", a, res.resolves.Load())
		}
		// Polled again at once: its own failure, not asked about again.
		a = wait(t, sendTo(route, port, http.MethodGet, ""))
		if a.code != http.StatusBadGateway || res.resolves.Load() != 3 {
			t.Fatalf("again: %+v after %d resolves, want 502 after 3", a, res.resolves.Load())
		}
		// A second later it may have moved: asked again.
		time.Sleep(1100 * time.Millisecond)
		a = wait(t, sendTo(route, port, http.MethodGet, ""))
		t.Logf("polled at once, then a second later: resolves %d", res.resolves.Load())
		if a.code != http.StatusBadGateway || res.resolves.Load() != 5 {
			t.Fatalf("a second later: %+v after %d resolves, want 502 after 5", a, res.resolves.Load())
		}
	})
}

// TestMovedEndsAttemptsWhereTheSandboxWas: the original never closes its
// connections when it goes (a gVisor sandbox's network stack goes with
// its process), so a request in flight at the freeze would hang. Moved,
// called with where the sandbox is now, ends the attempts still going to
// where it was: a GET is then answered by the new node, a POST whose body
// the original read 502 at once. Moved naming the place the attempts go
// to ends none. Control: before Moved the GET is still waiting.
func TestMovedEndsAttemptsWhereTheSandboxWas(t *testing.T) {
	probe, err := net.Listen("tcp", "127.0.0.2:0")
	if err != nil {
		t.Fatal(err)
	}
	port := probe.Addr().(*net.TCPAddr).Port
	probe.Close()
	oldT := &proxy.Target{SandboxID: "sbmove", NodeID: "n1", HostIP: "127.0.0.2"}
	newT := &proxy.Target{SandboxID: "sbmove", NodeID: "n2", HostIP: "127.0.0.3"}
	old := startFrozen(t, net.JoinHostPort("127.0.0.2", strconv.Itoa(port)), true)
	_, served := startLive(t, net.JoinHostPort("127.0.0.3", strconv.Itoa(port)))
	res := &moveResolver{cur: oldT}
	route, h := routeHandler(t, proxy.Config{Resolver: res})

	get, post := sendTo(route, port, http.MethodGet, ""), sendTo(route, port, http.MethodPost, "once")
	for deadline := time.Now().Add(5 * time.Second); old.requests.Load() < 2; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the requests never reached the frozen original")
		}
	}
	select {
	case a := <-get:
		t.Fatalf("control: the GET ended before Moved: %+v", a)
	case <-time.After(500 * time.Millisecond):
	}
	if n := h.Moved("sbmove", oldT); n != 0 {
		t.Fatalf("Moved to where the attempts go ended %d", n)
	}
	res.begin()
	res.end(newT)
	began := time.Now()
	if n := h.Moved("sbmove", newT); n != 2 {
		t.Fatalf("Moved ended %d attempts, want 2", n)
	}
	ag, ap := wait(t, get), wait(t, post)
	t.Logf("after Moved (%s): GET %d %q; POST %d %q; the new node served %d", time.Since(began).Round(time.Millisecond), ag.code, ag.body, ap.code, ap.body, served.Load())
	if ag.code != http.StatusOK || ag.body != "new node: GET /work" {
		t.Errorf("GET: %+v, want 200 from the new node", ag)
	}
	if ap.code != http.StatusBadGateway || !strings.Contains(ap.body, "moved") || served.Load() != 1 {
		t.Errorf("POST: %+v (new node served %d), want 502 saying it moved, never sent there", ap, served.Load())
	}
}
