package master_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"

	envdpb "github.com/cubesandbox/cube/api/envd/process"
	"github.com/cubesandbox/cube/api/envd/process/processconnect"
	masterpb "github.com/cubesandbox/cube/api/master/v1"
	"github.com/cubesandbox/cube/internal/agentproto"
	"github.com/cubesandbox/cube/internal/cubeproxy"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/hostload"
	"github.com/cubesandbox/cube/internal/master"
	"github.com/cubesandbox/cube/internal/master/mastertest"
	"github.com/cubesandbox/cube/internal/objstore/objstoretest"
	"github.com/cubesandbox/cube/internal/proxy"
)

// TestDrainQuiescesTraffic: a master, two runc nodes with an object
// store, and two cubeproxy replicas watching the master. A running
// sandbox is drained while requests go to it through a proxy:
//
//   - idle: nothing in flight; the hold before the freeze takes one
//     round trip to the proxies (well under their 1 s report interval);
//   - in flight: a POST (an upload whose body takes 1 s to arrive, so its
//     answer comes ~1 s after it began) in flight when the move starts is
//     answered 200 by the original (its file, complete, moved with the
//     sandbox; the catalog still named the old node when it was
//     answered); a POST sent once the hold began (the proxy's cached
//     route dropped) is answered 200 only after the move, by the new node
//     (the catalog names it when the answer comes), its file there.
//     Control: the same in-flight POST with the wait off (RequestWait < 0)
//     is answered 502 (the sandbox froze under it, and a POST is not sent
//     again);
//   - a stream (an upload that never ends) outlives the bound: the move
//     freezes the sandbox after the bound and completes within the bound
//     plus an idle move's time (and slack); the stream is cut.
func TestDrainQuiescesTraffic(t *testing.T) {
	srv := objstoretest.Start(t)
	store := fmt.Sprintf("[store]\nendpoint = %q\nbucket = %q\naccess_key_file = %q\nsecret_key_file = %q\n",
		srv.Endpoint, srv.Bucket, srv.AccessKeyFile, srv.SecretKeyFile)
	m := mastertest.StartMaster(t, "[drain]\nrequest_wait = \"5s\"\n")
	n1 := mastertest.StartNodeConfig(t, m, noVM+store, "busybox")
	n2 := mastertest.StartNodeConfig(t, m, noVM+store, "busybox")
	m.WaitHealthy(t, n1, n2)
	svc := m.Server.Service
	ctx := context.Background()
	nodes := map[string]*mastertest.Node{n1.ID: n1, n2.ID: n2}
	t.Cleanup(func() {
		_, _ = svc.SetSchedulable(context.Background(), n1.ID, true)
		_, _ = svc.SetSchedulable(context.Background(), n2.ID, true)
	})
	other := func(n string) string {
		if n == n1.ID {
			return n2.ID
		}
		return n1.ID
	}

	pxLog := &syncBuffer{}
	startProxy := func(name string, log *slog.Logger) *cubeproxy.Server {
		pconn, err := cubeproxy.DialMaster("unix://"+m.Socket, "", nil)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { pconn.Close() })
		px, err := cubeproxy.Start(ctx, cubeproxy.Config{Listen: "127.0.0.1:0", Domain: "cube.test", ID: name},
			masterpb.NewRouteServiceClient(pconn), log)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			if err := px.Stop(); err != nil {
				t.Error(err)
			}
		})
		return px
	}
	// The second proxy carries no traffic: the hold waits for its answer
	// too.
	px, _ := startProxy("px-1", slog.New(slog.NewTextHandler(pxLog, nil))), startProxy("px-2", mastertest.Log(t))
	hc := &http.Client{Timeout: 90 * time.Second}
	t.Cleanup(hc.CloseIdleConnections)
	upload := func(id, path string, body io.Reader) (int, string) {
		req, _ := http.NewRequest("POST", "http://"+px.Addr+"/files?username=root&path="+url.QueryEscape(path), body)
		req.Header.Set(proxy.HeaderSandboxID, id)
		req.Header.Set(proxy.HeaderSandboxPort, strconv.Itoa(agentproto.Port))
		req.Header.Set("Content-Type", "application/octet-stream")
		resp, err := hc.Do(req)
		if err != nil {
			return 0, err.Error()
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, strings.TrimSpace(string(b))
	}
	// slowBody sends first, then (after d, or when stop closes) second.
	slowBody := func(first, second string, d time.Duration, stop <-chan struct{}) (io.Reader, <-chan struct{}) {
		pr, pw := io.Pipe()
		sent := make(chan struct{})
		go func() {
			if _, err := pw.Write([]byte(first)); err != nil {
				close(sent)
				return
			}
			close(sent)
			select {
			case <-time.After(d):
			case <-stop:
			}
			_, _ = pw.Write([]byte(second))
			pw.Close()
		}()
		return pr, sent
	}
	// sandbox creates a running sandbox on node home and routes a request
	// to it through px (its route is cached there).
	sandbox := func(t *testing.T, home string) string {
		t.Helper()
		if _, err := svc.SetSchedulable(ctx, other(home), false); err != nil {
			t.Fatal(err)
		}
		sb, err := svc.Create(ctx, master.CreateRequest{Template: "busybox", Timeout: 10 * time.Minute})
		if _, uerr := svc.SetSchedulable(ctx, other(home), true); uerr != nil {
			t.Fatal(uerr)
		}
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = svc.Kill(context.Background(), sb.ID) })
		if sb.NodeID != home {
			t.Fatalf("created on %s, want %s", sb.NodeID, home)
		}
		mastertest.WaitFor(t, 10*time.Second, "an upload through the proxy", func() bool {
			code, _ := upload(sb.ID, "/data/ready", strings.NewReader("ready\n"))
			return code == http.StatusOK
		})
		if !px.Routes.Cached(sb.ID) {
			t.Fatal("the proxy did not cache the route")
		}
		return sb.ID
	}
	type drained struct {
		took time.Duration
		err  error
	}
	// drain moves home's sandboxes to the other node (then makes home
	// schedulable again) and reports the move's time; moved (when not
	// nil) closes once the drain reports id moved (frozen and started
	// elsewhere).
	drain := func(home, id string, wait time.Duration, moved chan<- struct{}) <-chan drained {
		out := make(chan drained, 1)
		go func() {
			var took time.Duration
			err := svc.Drain(ctx, home, master.DrainOptions{RequestWait: wait}, func(ev master.DrainEvent) {
				if ev.Phase == master.DrainMoved && ev.SandboxID == id {
					took = ev.Took
					if moved != nil {
						close(moved)
						moved = nil
					}
				}
			})
			if moved != nil {
				close(moved)
			}
			_, _ = svc.SetSchedulable(ctx, home, true)
			out <- drained{took, err}
		}()
		return out
	}
	fileOn := func(node, id, path string) string {
		b, err := os.ReadFile(filepath.Join(nodes[node].Env.Config.SandboxRunDir(id), "rootfs", path))
		if err != nil {
			return err.Error()
		}
		return string(b)
	}
	waitedRE := func(id string) *regexp.Regexp {
		return regexp.MustCompile(`quiesce: no request in flight; the sandbox freezes.*sandbox_id=` + id + ` waited=(\S+)`)
	}

	// Idle: the hold costs one round trip to each proxy.
	id := sandbox(t, n1.ID)
	d := <-drain(n1.ID, id, 0, nil)
	if d.err != nil {
		t.Fatalf("drain (idle): %v", d.err)
	}
	idleMove := d.took
	mt := waitedRE(id).FindStringSubmatch(m.Logs())
	if mt == nil {
		t.Fatalf("no quiesce line for the idle sandbox in the master's log")
	}
	held, err := time.ParseDuration(mt[1])
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("idle sandbox: hold before the freeze %s (two proxies), move %s", held, idleMove.Round(time.Millisecond))
	if bound := hostload.Scale(500 * time.Millisecond); held > bound {
		t.Errorf("the hold of an idle sandbox took %s (bound %s at this load); want one round trip to the proxies", held, bound)
	}
	_ = svc.Kill(ctx, id) // later drains move only their own sandbox

	// inFlight starts an upload, starts a drain of home with the wait
	// given once the upload is on its way, and returns the upload's
	// answer and the drain. The body's second part is sent only once the
	// move has reached the point the case is about, not on a timer (on
	// a loaded host the drain may take any time to get there): with a
	// wait, once the hold began (the proxy dropped the route), so the
	// upload is in flight through the hold; without one, once the drain
	// reported the sandbox moved, so the upload was in flight when it
	// froze.
	type answer struct {
		code int
		body string
		at   time.Time
		node string // where the catalog says the sandbox is right after
	}
	inFlight := func(t *testing.T, id, home string, wait time.Duration, during func()) (answer, drained) {
		t.Helper()
		release := make(chan struct{})
		body, sent := slowBody("first\n", "second\n", 2*time.Minute, release)
		res := make(chan answer, 1)
		began := time.Now()
		go func() {
			code, b := upload(id, "/data/inflight", body)
			at := time.Now()
			row, _ := svc.Get(ctx, id)
			res <- answer{code, b, at, row.NodeID}
		}()
		<-sent
		time.Sleep(300 * time.Millisecond) // through the proxy to the agent
		moved := make(chan struct{})
		dc := drain(home, id, wait, moved)
		if wait < 0 {
			go func() { <-moved; close(release) }()
		} else {
			mastertest.WaitFor(t, 30*time.Second, "the proxy drops the route (the hold began)", func() bool { return !px.Routes.Cached(id) })
			close(release)
		}
		if during != nil {
			during()
		}
		a := <-res
		d := <-dc
		t.Logf("POST in flight at the move (wait %s): %d %q after %s (the catalog then named %s); move %s, err %v",
			wait, a.code, a.body, a.at.Sub(began).Round(time.Millisecond), a.node, d.took.Round(time.Millisecond), d.err)
		return a, d
	}

	t.Run("in flight and held", func(t *testing.T) {
		id := sandbox(t, n2.ID)
		var second answer
		secondDone := make(chan struct{})
		a, d := inFlight(t, id, n2.ID, 0, func() {
			// Once the hold began (the proxy's cached route dropped), a
			// POST waits for the move and goes to the new node.
			mastertest.WaitFor(t, 10*time.Second, "the proxy drops the route", func() bool { return !px.Routes.Cached(id) })
			go func() {
				defer close(secondDone)
				sent := time.Now()
				code, b := upload(id, "/data/held", strings.NewReader("held\n"))
				row, _ := svc.Get(ctx, id)
				second = answer{code, b, time.Now(), row.NodeID}
				t.Logf("POST sent during the hold: %d %q after %s (the catalog then named %s)", code, b, second.at.Sub(sent).Round(time.Millisecond), row.NodeID)
			}()
		})
		<-secondDone
		if d.err != nil {
			t.Fatalf("drain: %v", d.err)
		}
		if a.code != http.StatusOK || a.node != n2.ID {
			t.Errorf("the POST in flight: %d %q, answered while the catalog named %s; want 200 from the original on %s", a.code, a.body, a.node, n2.ID)
		}
		if got := fileOn(n1.ID, id, "data/inflight"); got != "first\nsecond\n" {
			t.Errorf("the in-flight upload's file on the new node: %q, want it whole", got)
		}
		if second.code != http.StatusOK || second.node != n1.ID || second.at.Before(a.at) {
			t.Errorf("the POST sent during the hold: %d %q, answered while the catalog named %s; want 200 after the move, from %s",
				second.code, second.body, second.node, n1.ID)
		}
		if got := fileOn(n1.ID, id, "data/held"); got != "held\n" {
			t.Errorf("the held upload's file on the new node: %q", got)
		}
		// Neither was sent twice: the first answered where it was, the
		// second sent only once the route named the new node.
		if regexp.MustCompile(`request retried where the sandbox is now.*sandbox_id=` + id).MatchString(pxLog.String()) {
			t.Errorf("the proxy sent a request to %s again:\n%s", id, pxLog.String())
		}
	})

	t.Run("control: wait off", func(t *testing.T) {
		id := sandbox(t, n1.ID)
		a, d := inFlight(t, id, n1.ID, -1, nil)
		if d.err != nil {
			t.Fatalf("drain: %v", d.err)
		}
		if a.code != http.StatusBadGateway {
			t.Errorf("control: the POST in flight with the wait off: %d %q, want 502 (cut by the freeze)", a.code, a.body)
		}
	})

	t.Run("stream past the bound", func(t *testing.T) {
		const bound = 1500 * time.Millisecond
		id := sandbox(t, n2.ID)
		// A long command's output stream (envd's Process/Start, a Connect
		// server stream over a POST), open across the move.
		req := connect.NewRequest(&envdpb.StartRequest{Process: &envdpb.ProcessConfig{Cmd: "/bin/sh", Args: []string{"-c", "echo started; sleep 120"}}})
		req.Header().Set("Authorization", "Basic cm9vdDo=") // root:
		req.Header().Set(proxy.HeaderSandboxID, id)
		req.Header().Set(proxy.HeaderSandboxPort, strconv.Itoa(agentproto.Port))
		sctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
		defer cancel()
		stream, err := processconnect.NewProcessClient(hc, "http://"+px.Addr).Start(sctx, req)
		if err != nil {
			t.Fatal(err)
		}
		defer stream.Close()
		started := make(chan struct{})
		ended := make(chan error, 1)
		go func() {
			once := false
			for stream.Receive() {
				if !once && strings.Contains(string(stream.Msg().GetEvent().GetData().GetStdout()), "started") {
					once = true
					close(started)
				}
			}
			ended <- stream.Err()
		}()
		select {
		case <-started:
		case <-time.After(20 * time.Second):
			t.Fatal("the command's stream did not start")
		}
		d := <-drain(n2.ID, id, bound, nil)
		if d.err != nil {
			t.Fatalf("drain: %v", d.err)
		}
		var serr error
		select {
		case serr = <-ended:
		case <-time.After(30 * time.Second):
			t.Fatal("the stream was not cut after the move")
		}
		t.Logf("stream past the bound (%s): move %s (idle move %s); the stream ended: %v", bound, d.took.Round(time.Millisecond),
			idleMove.Round(time.Millisecond), serr)
		if d.took < bound {
			t.Errorf("the move took %s: it did not wait for the stream up to the bound %s", d.took, bound)
		}
		if limit := bound + idleMove + 3*time.Second; d.took > limit {
			t.Errorf("the move took %s, more than the bound and an idle move (%s)", d.took, limit)
		}
		if serr == nil {
			t.Errorf("the command's stream ended without an error")
		}
		if !regexp.MustCompile(`quiesce: requests still in flight at the bound.*sandbox_id=` + id).MatchString(m.Logs()) {
			t.Errorf("no log of the freeze with requests in flight")
		}
	})
}

// syncBuffer is a log destination tests read while it is written.
type syncBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

// TestDrainRequestWaitConfig: [drain] request_wait is 5 s by default, 0
// turns the wait off, and a negative one is refused.
func TestDrainRequestWaitConfig(t *testing.T) {
	cfg, err := master.ParseConfig(nil)
	if err != nil || cfg.Drain.RequestWait.Duration != 5*time.Second {
		t.Fatalf("default drain.request_wait: %v %v, want 5s", cfg.Drain.RequestWait, err)
	}
	if cfg, err := master.ParseConfig([]byte("[drain]\nrequest_wait = \"0s\"\n")); err != nil || cfg.Drain.RequestWait.Duration != 0 {
		t.Errorf("drain.request_wait 0s: %v", err)
	}
	_, err = master.ParseConfig([]byte("[drain]\nrequest_wait = \"-1s\"\n"))
	t.Logf("drain.request_wait -1s: %v", err)
	if !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), "drain.request_wait") {
		t.Errorf("a negative drain.request_wait: %v, want InvalidArgument naming it", err)
	}
	// Bounded by MaxRequestWait (how long the other replicas keep their
	// answers to a quiesce): the bound itself is accepted, past it not.
	atMax := fmt.Sprintf("[drain]\nrequest_wait = %q\n", master.MaxRequestWait)
	if cfg, err := master.ParseConfig([]byte(atMax)); err != nil || cfg.Drain.RequestWait.Duration != master.MaxRequestWait {
		t.Errorf("drain.request_wait at the bound %s: %v", master.MaxRequestWait, err)
	}
	_, err = master.ParseConfig([]byte(fmt.Sprintf("[drain]\nrequest_wait = %q\n", master.MaxRequestWait+time.Second)))
	t.Logf("drain.request_wait past the bound: %v", err)
	if !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), "drain.request_wait") {
		t.Errorf("drain.request_wait past %s: %v, want InvalidArgument naming it", master.MaxRequestWait, err)
	}
}
