package agent

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

	envdpb "github.com/cubesandbox/cube/api/envd/process"
	"github.com/cubesandbox/cube/api/envd/process/processconnect"
	"github.com/cubesandbox/cube/internal/agentproto"
	"github.com/cubesandbox/cube/internal/testenv"
)

func newTestServer(t *testing.T) *Server {
	t.Helper()
	db, _, _ := sandboxLike(t)
	return New(Config{
		Starter: reaper, Users: db, DefaultUser: "root",
		Logger:   slog.New(slog.DiscardHandler),
		SetClock: func(unix.Timespec) error { return nil },
	})
}

func rpcBuilt(s *Server) (n int) {
	for _, h := range s.rpc {
		if h.built.Load() {
			n++
		}
	}
	return n
}

// A reinit (a claimed pool entry, a restored clone) builds the envd
// Connect handlers ahead of the first call; an agent only asked /health
// never builds them (an idle sandbox keeps its heap small).
func TestReinitPrebuildsRPCHandlers(t *testing.T) {
	testenv.RequireRoot(t, "chowns the test users' homes")
	s := newTestServer(t)
	if len(s.rpc) != 2 {
		t.Fatalf("%d lazily built handlers, want 2 (process, filesystem)", len(s.rpc))
	}
	for range 3 {
		rec := httptest.NewRecorder()
		s.Handler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/health", nil))
		if rec.Code != http.StatusNoContent {
			t.Fatalf("/health = %d", rec.Code)
		}
	}
	time.Sleep(50 * time.Millisecond)
	if n := rpcBuilt(s); n != 0 {
		t.Fatalf("%d handlers built after /health alone, want 0", n)
	}
	rec := httptest.NewRecorder()
	s.Handler().ServeHTTP(rec, httptest.NewRequest(http.MethodPost, agentproto.PathReinit, strings.NewReader(`{}`)))
	if rec.Code != http.StatusOK {
		t.Fatalf("reinit = %d %s", rec.Code, rec.Body)
	}
	deadline := time.Now().Add(10 * time.Second)
	for rpcBuilt(s) != 2 {
		if time.Now().After(deadline) {
			t.Fatalf("%d of 2 handlers built 10 s after a reinit", rpcBuilt(s))
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// Events smaller than compressMinBytes go out uncompressed to a client
// that accepts gzip; output of compressMinBytes or more is still gzipped.
func TestSmallEventsUncompressed(t *testing.T) {
	testenv.RequireRoot(t, "chowns the test users' homes")
	s := newTestServer(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Serve(ctx, ln) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("serve: %v", err)
		}
	})

	msg, err := proto.Marshal(&envdpb.StartRequest{Process: &envdpb.ProcessConfig{
		Cmd: "/bin/sh", Args: []string{"-c", "head -c 8192 /dev/zero | tr '\\0' a"},
	}})
	if err != nil {
		t.Fatal(err)
	}
	body := make([]byte, 5, 5+len(msg))
	binary.BigEndian.PutUint32(body[1:], uint32(len(msg)))
	body = append(body, msg...)
	req, err := http.NewRequest(http.MethodPost, "http://"+ln.Addr().String()+processconnect.ProcessStartProcedure, bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/connect+proto")
	req.Header.Set("Connect-Protocol-Version", "1")
	req.Header.Set("Connect-Accept-Encoding", "gzip")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		t.Fatalf("Start = %s %s", resp.Status, b)
	}
	r := bufio.NewReader(resp.Body)
	var small, big, bigZipped int
	for {
		var hdr [5]byte
		if _, err := io.ReadFull(r, hdr[:]); err != nil {
			t.Fatalf("read envelope: %v (small %d, big %d)", err, small, big)
		}
		payload := make([]byte, binary.BigEndian.Uint32(hdr[1:]))
		if _, err := io.ReadFull(r, payload); err != nil {
			t.Fatal(err)
		}
		if hdr[0]&0x02 != 0 { // end of stream
			break
		}
		zipped := hdr[0]&0x01 != 0
		var ev envdpb.StartResponse
		if !zipped {
			if err := proto.Unmarshal(payload, &ev); err != nil {
				t.Fatal(err)
			}
		}
		switch {
		case zipped:
			big++
			bigZipped++
		case len(payload) >= compressMinBytes:
			big++
		default:
			small++
			t.Logf("uncompressed event of %d bytes: %v", len(payload), ev.GetEvent().GetEvent())
		}
	}
	t.Logf("%d small events uncompressed, %d of %d events of %d bytes or more compressed", small, bigZipped, big, compressMinBytes)
	if small < 2 { // start and end at least
		t.Errorf("%d small events arrived uncompressed, want start and end at least", small)
	}
	if big == 0 || bigZipped != big {
		t.Errorf("%d of %d large output events compressed, want all (and at least one)", bigZipped, big)
	}
}

// POST /_cube/prepare (a warm-pool entry about to be frozen) answers only
// once the envd Connect handlers are built: the freeze that follows must
// not catch the build half done, leaving it to the claim.
func TestPrepareBuildsRPCHandlersBeforeAnswering(t *testing.T) {
	s := New(Config{Logger: slog.New(slog.DiscardHandler)})
	if n := rpcBuilt(s); n != 0 {
		t.Fatalf("%d handlers built at start, want 0", n)
	}
	rec := httptest.NewRecorder()
	s.Handler().ServeHTTP(rec, httptest.NewRequest(http.MethodPost, agentproto.PathPrepare, nil))
	if rec.Code != http.StatusNoContent {
		t.Fatalf("prepare = %d %s", rec.Code, rec.Body)
	}
	if n := rpcBuilt(s); n != 2 {
		t.Fatalf("%d of 2 handlers built when prepare answered", n)
	}
	rec = httptest.NewRecorder()
	s.Handler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, agentproto.PathPrepare, nil))
	if rec.Code != http.StatusMethodNotAllowed {
		t.Fatalf("GET prepare = %d, want 405", rec.Code)
	}
}
