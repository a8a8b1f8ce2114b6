package proxy_test

import (
	"bufio"
	"context"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/proxy"
)

// resolverFunc is a Resolver from a function.
type resolverFunc func(ctx context.Context, id string) (*proxy.Target, error)

func (f resolverFunc) Resolve(ctx context.Context, id string) (*proxy.Target, error) {
	return f(ctx, id)
}

// upstream is a real HTTP server (HTTP/1.1 and h2c) playing the service
// inside a sandbox.
func upstream(t *testing.T) int {
	t.Helper()
	mux := http.NewServeMux()
	mux.HandleFunc("/echo", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("X-Proto", r.Proto)
		w.Header().Set("X-Host", r.Host)
		w.Header().Set("X-Token-Seen", r.Header.Get(proxy.HeaderTrafficToken))
		body, _ := io.ReadAll(r.Body)
		fmt.Fprintf(w, "%s %s %s", r.Method, r.URL.Path, body)
	})
	// /stream writes a line, then waits for the client to say it got it
	// (over /ack), then writes the next: it only completes if every chunk
	// reaches the client before the response ends, i.e. nothing buffers.
	acks := make(chan struct{}, 10)
	mux.HandleFunc("/ack", func(w http.ResponseWriter, r *http.Request) { acks <- struct{}{} })
	mux.HandleFunc("/stream", func(w http.ResponseWriter, r *http.Request) {
		for i := range 3 {
			fmt.Fprintf(w, "chunk %d\n", i)
			w.(http.Flusher).Flush()
			select {
			case <-acks:
			case <-time.After(5 * time.Second):
				fmt.Fprintln(w, "no ack: the proxy buffered")
				return
			}
		}
	})
	// /duplex answers the first line of the request body at once, then
	// reads the rest: what a Connect stream does, whose first event can go
	// out before the client's body has ended.
	mux.HandleFunc("/duplex", func(w http.ResponseWriter, r *http.Request) {
		_ = http.NewResponseController(w).EnableFullDuplex()
		br := bufio.NewReader(r.Body)
		first, _ := br.ReadString('\n')
		fmt.Fprintf(w, "got: %s", first)
		w.(http.Flusher).Flush()
		rest, err := io.ReadAll(br)
		fmt.Fprintf(w, "rest: %q %v\n", rest, err)
	})
	// /ws upgrades and echoes lines back, like a WebSocket after its
	// handshake (the proxy must pass the Upgrade and the raw bytes).
	mux.HandleFunc("/ws", func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Upgrade") != "echo" {
			http.Error(w, "want upgrade", 400)
			return
		}
		conn, brw, err := http.NewResponseController(w).Hijack()
		if err != nil {
			return
		}
		defer conn.Close()
		// Write errors show up as the next read failing.
		_, _ = brw.WriteString("HTTP/1.1 101 Switching Protocols\r\nUpgrade: echo\r\nConnection: Upgrade\r\n\r\n")
		brw.Flush()
		for {
			line, err := brw.ReadString('\n')
			if err != nil {
				return
			}
			_, _ = brw.WriteString("echo: " + line)
			brw.Flush()
		}
	})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := new(http.Protocols)
	p.SetHTTP1(true)
	p.SetUnencryptedHTTP2(true)
	srv := &http.Server{Handler: mux, Protocols: p}
	go func() { _ = srv.Serve(ln) }() // ErrServerClosed at cleanup
	t.Cleanup(func() { srv.Close() })
	return ln.Addr().(*net.TCPAddr).Port
}

// route starts the real route on a loopback listener.
func route(t *testing.T, r proxy.Resolver) string {
	t.Helper()
	h := proxy.New(proxy.Config{Resolver: r, Domain: "cube.test"})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = h.Serve(ctx, ln); close(done) }() // ends with ctx
	t.Cleanup(func() { cancel(); <-done })
	return ln.Addr().String()
}

func TestRoute(t *testing.T) {
	port := upstream(t)
	targets := map[string]*proxy.Target{
		"direct":  {SandboxID: "direct", HostIP: "127.0.0.1"},
		"netns":   {SandboxID: "netns", NetNS: "/proc/self/ns/net"},
		"secret":  {SandboxID: "secret", HostIP: "127.0.0.1", TrafficAccessToken: "s3cret"},
		"faraway": {SandboxID: "faraway", NodeID: "n9"},
	}
	addr := route(t, resolverFunc(func(_ context.Context, id string) (*proxy.Target, error) {
		switch id {
		case "sleepy":
			return nil, fmt.Errorf("sandbox sleepy is paused: %w", errdefs.ErrFailedPrecondition)
		}
		if tg, ok := targets[id]; ok {
			return tg, nil
		}
		return nil, fmt.Errorf("sandbox %s: %w", id, errdefs.ErrNotFound)
	}))
	// response is what get keeps of an answer whose body it has read and closed.
	type response struct {
		StatusCode int
		Header     http.Header
	}
	get := func(host string, hdr map[string]string, path string) (response, string) {
		req, _ := http.NewRequest(http.MethodPost, "http://"+addr+path, strings.NewReader("body"))
		req.Host = host
		for k, v := range hdr {
			req.Header.Set(k, v)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return response{resp.StatusCode, resp.Header}, string(b)
	}
	ps := strconv.Itoa(port)

	t.Run("by host", func(t *testing.T) {
		resp, body := get(ps+"-direct.cube.test", nil, "/echo")
		if resp.StatusCode != 200 || body != "POST /echo body" || resp.Header.Get("X-Host") != ps+"-direct.cube.test" {
			t.Fatalf("%d %q %v", resp.StatusCode, body, resp.Header)
		}
	})
	t.Run("by headers through the netns dialer", func(t *testing.T) {
		resp, body := get("anything", map[string]string{proxy.HeaderSandboxID: "netns", proxy.HeaderSandboxPort: ps}, "/echo")
		if resp.StatusCode != 200 || body != "POST /echo body" {
			t.Fatalf("%d %q", resp.StatusCode, body)
		}
	})
	t.Run("traffic token", func(t *testing.T) {
		h := map[string]string{proxy.HeaderSandboxID: "secret", proxy.HeaderSandboxPort: ps}
		if resp, _ := get("x", h, "/echo"); resp.StatusCode != http.StatusUnauthorized {
			t.Fatalf("missing token: %d", resp.StatusCode)
		}
		h[proxy.HeaderTrafficToken] = "wrong"
		if resp, _ := get("x", h, "/echo"); resp.StatusCode != http.StatusUnauthorized {
			t.Fatalf("wrong token: %d", resp.StatusCode)
		}
		h[proxy.HeaderTrafficToken] = "s3cret"
		resp, _ := get("x", h, "/echo")
		if resp.StatusCode != 200 || resp.Header.Get("X-Token-Seen") != "" {
			t.Fatalf("right token: %d, token forwarded: %q", resp.StatusCode, resp.Header.Get("X-Token-Seen"))
		}
		// envd's port is guarded by the agent's own token, not this one.
		if resp, _ := get("49983-secret.cube.test", nil, "/health"); resp.StatusCode == http.StatusUnauthorized {
			t.Fatal("traffic token demanded on the envd port")
		}
	})
	t.Run("errors", func(t *testing.T) {
		for _, tc := range []struct {
			host string
			hdr  map[string]string
			path string
			code int
		}{
			{ps + "-ghost.cube.test", nil, "/echo", http.StatusBadGateway},
			{ps + "-sleepy.cube.test", nil, "/echo", http.StatusConflict},
			{ps + "-faraway.cube.test", nil, "/echo", http.StatusBadGateway},
			{"1-direct.cube.test", nil, "/echo", http.StatusBadGateway}, // nothing listens on port 1
			{ps + "-direct.other.domain", nil, "/echo", http.StatusBadRequest},
			{"x", map[string]string{proxy.HeaderSandboxID: "direct", proxy.HeaderSandboxPort: "99999"}, "/echo", http.StatusBadRequest},
			{"x", map[string]string{proxy.HeaderSandboxID: "BAD ID", proxy.HeaderSandboxPort: ps}, "/echo", http.StatusBadRequest},
			{"49983-direct.cube.test", nil, "/_cube/info", http.StatusBadGateway},
		} {
			resp, body := get(tc.host, tc.hdr, tc.path)
			var e struct {
				Code    int
				Message string
			}
			if resp.StatusCode != tc.code || json.Unmarshal([]byte(body), &e) != nil || e.Code != tc.code || e.Message == "" {
				t.Errorf("%s %v %s: %d %s", tc.host, tc.hdr, tc.path, resp.StatusCode, body)
			}
		}
	})
	t.Run("streams without buffering", func(t *testing.T) {
		req, _ := http.NewRequest(http.MethodGet, "http://"+addr+"/stream", nil)
		req.Host = ps + "-direct.cube.test"
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		br := bufio.NewReader(resp.Body)
		for i := range 3 {
			line, err := br.ReadString('\n')
			if err != nil || line != fmt.Sprintf("chunk %d\n", i) {
				t.Fatalf("chunk %d: %q %v", i, line, err)
			}
			ack, _ := http.NewRequest(http.MethodGet, "http://"+addr+"/ack", nil)
			ack.Host = req.Host
			r, err := http.DefaultClient.Do(ack)
			if err != nil {
				t.Fatal(err)
			}
			r.Body.Close()
		}
		if rest, _ := io.ReadAll(br); len(rest) != 0 {
			t.Fatalf("trailing: %q", rest)
		}
	})
	t.Run("the answer streams while the request body is open", func(t *testing.T) {
		// The client holds the end of its body until it has the first line
		// of the answer. A proxy that is not full duplex drains the body
		// when the answer's headers go out: it blocks here, and when the
		// body does end it closes it under the transport still forwarding
		// it, which then drops the upstream connection mid-answer (the
		// "incomplete envelope" / "terminated" of Connect clients).
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		fmt.Fprintf(c, "POST /duplex HTTP/1.1\r\nHost: %s-direct.cube.test\r\nTransfer-Encoding: chunked\r\n\r\n6\r\nhello\n\r\n", ps)
		if err := c.SetReadDeadline(time.Now().Add(3 * time.Second)); err != nil {
			t.Fatal(err)
		}
		br := bufio.NewReader(c)
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatalf("no answer while the request body is open: %v", err)
		}
		defer resp.Body.Close()
		rb := bufio.NewReader(resp.Body)
		if line, err := rb.ReadString('\n'); err != nil || line != "got: hello\n" {
			t.Fatalf("first line: %q %v", line, err)
		}
		t.Log("first line of the answer came back before the request body ended")
		fmt.Fprint(c, "5\r\nmore\n\r\n0\r\n\r\n")
		rest, err := io.ReadAll(rb)
		if err != nil || string(rest) != "rest: \"more\\n\" <nil>\n" {
			t.Fatalf("rest of the answer: %q %v", rest, err)
		}
	})
	t.Run("upgrade", func(t *testing.T) {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		fmt.Fprintf(c, "GET /ws HTTP/1.1\r\nHost: %s-direct.cube.test\r\nConnection: Upgrade\r\nUpgrade: echo\r\n\r\n", ps)
		br := bufio.NewReader(c)
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatalf("handshake: %v", err)
		}
		resp.Body.Close() // a 101 has none: the connection carries on in br
		if resp.StatusCode != http.StatusSwitchingProtocols {
			t.Fatalf("handshake: %v", resp)
		}
		for _, msg := range []string{"hello\n", "again\n"} {
			if _, err := c.Write([]byte(msg)); err != nil {
				t.Fatal(err)
			}
			line, err := br.ReadString('\n')
			if err != nil || line != "echo: "+msg {
				t.Fatalf("echo: %q %v", line, err)
			}
		}
	})
	t.Run("h2c end to end", func(t *testing.T) {
		p := new(http.Protocols)
		p.SetUnencryptedHTTP2(true)
		client := &http.Client{Transport: &http.Transport{Protocols: p, TLSClientConfig: &tls.Config{}}}
		req, _ := http.NewRequest(http.MethodPost, "http://"+addr+"/echo", strings.NewReader("h2"))
		req.Host = ps + "-direct.cube.test"
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		if resp.ProtoMajor != 2 || resp.Header.Get("X-Proto") != "HTTP/2.0" || string(body) != "POST /echo h2" {
			t.Fatalf("client %s, upstream %s, body %q", resp.Proto, resp.Header.Get("X-Proto"), body)
		}
	})
}

func TestParseHost(t *testing.T) {
	for _, tc := range []struct {
		host, domain string
		id           string
		port         int
		ok           bool
	}{
		{"49983-abc.cube.test", "cube.test", "abc", 49983, true},
		{"3000-abc.cube.test:8081", "cube.test:8081", "abc", 3000, true},
		{"3000-abc-def.localhost", "", "abc-def", 3000, true},
		{"3000-abc.evil.test", "cube.test", "", 0, false},
		{"abc.cube.test", "cube.test", "", 0, false},
		{"0-abc.cube.test", "cube.test", "", 0, false},
		{"70000-abc.cube.test", "cube.test", "", 0, false},
		{"80-ABC.cube.test", "cube.test", "", 0, false},
		{"localhost", "", "", 0, false},
	} {
		id, port, ok := proxy.ParseHost(tc.host, tc.domain)
		if id != tc.id || port != tc.port || ok != tc.ok {
			t.Errorf("%s (%s): %q %d %v", tc.host, tc.domain, id, port, ok)
		}
	}
}

func TestIsAPIHost(t *testing.T) {
	for _, tc := range []struct {
		host, domain string
		ok           bool
	}{
		{"api.cube.test", "cube.test", true},
		{"api.cube.test:8443", "cube.test:8443", true},
		{"API.Cube.Test", "cube.test", true},
		{"api.cube.test", "", false},
		{"api.evil.test", "cube.test", false},
		{"49983-abc.cube.test", "cube.test", false},
		{"api.x.cube.test", "cube.test", false},
		{"cube.test", "cube.test", false},
	} {
		if got := proxy.IsAPIHost(tc.host, tc.domain); got != tc.ok {
			t.Errorf("IsAPIHost(%q, %q) = %v, want %v", tc.host, tc.domain, got, tc.ok)
		}
	}
}
