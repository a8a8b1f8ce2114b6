package master_test

import (
	"context"
	"errors"
	"fmt"
	"io"
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

	masterpb "github.com/cubesandbox/cube/api/master/v1"
	"github.com/cubesandbox/cube/internal/agentproto"
	"github.com/cubesandbox/cube/internal/cubeproxy"
	"github.com/cubesandbox/cube/internal/master/catalog"
	"github.com/cubesandbox/cube/internal/master/catalog/catalogtest"
	"github.com/cubesandbox/cube/internal/master/mastertest"
	"github.com/cubesandbox/cube/internal/objstore/objstoretest"
	"github.com/cubesandbox/cube/internal/proxy"
)

// TestMoveSeenByAnotherReplica: two cubemaster processes (a and b) on one
// MariaDB catalog, two nodes with an object store. Replica a moves a
// sandbox to the other node; requests for it through b during the move
// wait for it and are served on the new node:
//
//   - connect: a paused sandbox whose node is cordoned is connected to
//     through a (a moves it); a connect through b sent while a's move
//     holds the sandbox's move lease answers 200 once the move is done,
//     the sandbox running on the new node with its file, moved once (by
//     a; b waited and logged it). Control: the same connect through b
//     without a move resumes it where it is (201);
//   - the route: clients read envd through a cubeproxy that asks b only
//     while a drains the sandbox's node (an autoResume sandbox, as the
//     cluster's). With the wait before the freeze off (request_wait_ms
//     -1): every answer is 200 (no 409 from b, no 502 from the route),
//     and the sandbox ends on the other node; controls: the same reads
//     before the drain, all 200; through a second cubeproxy without the
//     retry, reads fail (502), and a POST in flight through b's proxy
//     (an upload whose body takes 1 s) is 502. With the wait (the
//     default request_wait), a drain back: a quiesces the sandbox through
//     b (its proxies answer b, b answers a in its traffic row), so every
//     read through both proxies is 200, even without the retry, and the
//     same POST in flight is answered 200 by the original, its file whole
//     on the new node. A third drain, of the sandbox idle but read through
//     b seconds before: a's hold ends on b's answer, well before the 5 s
//     bound.
func TestMoveSeenByAnotherReplica(t *testing.T) {
	db := catalogtest.StartMariaDB(t)
	dsn := db.NewDatabase(t)
	srv := objstoretest.Start(t)
	store := fmt.Sprintf("[store]\nendpoint = %q\nbucket = %q\naccess_key_file = %q\nsecret_key_file = %q\n",
		srv.Endpoint, srv.Bucket, srv.AccessKeyFile, srv.SecretKeyFile)
	conf := func(id string) string {
		return fmt.Sprintf("[catalog]\ndriver = \"mysql\"\ndsn = %q\n[ha]\nreplica_id = %q\nlease_ttl = \"2s\"\n[sandbox]\nmilli_cpu = 100\n", dsn, id)
	}
	ctx := context.Background()
	cat, err := catalog.Open(ctx, catalog.MySQL, dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cat.Close() })

	a := mastertest.StartMasterProcess(t, conf("a"))
	b := mastertest.StartMasterProcess(t, conf("b"))
	ms := []*mastertest.Master{a, b}
	n1 := mastertest.StartNodeReplicas(t, ms, noVM+store, "busybox")
	n2 := mastertest.StartNodeReplicas(t, ms, noVM+store, "busybox")
	a.WaitHealthy(t, n1, n2)
	b.WaitHealthy(t, n1, n2)
	nodes := map[string]*mastertest.Node{n1.ID: n1, n2.ID: n2}
	key := a.APIKey(t)
	ca, cb := a.API(key), b.API(key)
	cordon := func(t *testing.T, id string, off bool) {
		t.Helper()
		if _, err := a.Admin.SetNodeSchedulable(ctx, &masterpb.SetNodeSchedulableRequest{NodeId: id, Schedulable: !off}); err != nil {
			t.Fatal(err)
		}
		// b reads the node rows from the catalog.
		mastertest.WaitFor(t, 10*time.Second, "b sees the node's schedulable flag", func() bool {
			v := b.Node(t, id)
			return v != nil && v.Schedulable == !off
		})
	}
	t.Cleanup(func() {
		for id := range nodes {
			_, _ = a.Admin.SetNodeSchedulable(context.Background(), &masterpb.SetNodeSchedulableRequest{NodeId: id, Schedulable: true})
		}
	})
	create := func(t *testing.T, body map[string]any) (id string, home *mastertest.Node) {
		t.Helper()
		var sb e2bSandbox
		if r := ca.Do(t, "POST", "/v2/sandboxes", body, &sb); r.StatusCode != http.StatusCreated {
			t.Fatalf("create: %d %s", r.StatusCode, r.Body)
		}
		t.Cleanup(func() { ca.Do(t, "DELETE", "/sandboxes/"+sb.SandboxID, nil, nil) })
		row, err := cat.GetSandbox(ctx, sb.SandboxID)
		if err != nil {
			t.Fatal(err)
		}
		return sb.SandboxID, nodes[row.NodeID]
	}
	where := func(t *testing.T, id string) *catalog.Sandbox {
		t.Helper()
		row, err := cat.GetSandbox(ctx, id)
		if err != nil {
			t.Fatal(err)
		}
		return row
	}
	// moveToken is the token of the sandbox's move lease now (0: none).
	// b answers a's quiesce with it in its traffic row, so each move must
	// raise it: b's answer to an earlier move (kept up to a minute) must
	// not count for a later one before b's proxies dropped the route.
	moveToken := func(t *testing.T, id string) int64 {
		t.Helper()
		l, _, err := cat.LeaseHeld(ctx, "move/"+id)
		if err != nil {
			t.Fatal(err)
		}
		return l.Token
	}
	raised := func(t *testing.T, id string, before int64) {
		t.Helper()
		after := moveToken(t, id)
		t.Logf("the move lease's token: %d before the drain, %d after", before, after)
		if after <= before {
			t.Errorf("the move lease's token went from %d to %d: b's answer to the earlier move would count for this one", before, after)
		}
	}
	connect := func(c *mastertest.Client, id string) (*mastertest.Response, error) {
		req, _ := http.NewRequest("POST", c.Base+"/v2/sandboxes/"+id+"/connect", strings.NewReader(`{"timeout":300}`))
		req.Header.Set("Content-Type", "application/json")
		return c.Try(req, nil)
	}
	moves := func(logs, id string) int {
		return len(regexp.MustCompile(`sandbox resumed on another node.*sandbox_id=`+id).FindAllString(logs, -1))
	}

	t.Run("connect through b during a's move", func(t *testing.T) {
		id, home := create(t, map[string]any{"templateID": "busybox", "timeout": 300})
		want := []byte("kept across the move\n")
		p := filepath.Join(home.Env.Config.SandboxRunDir(id), "rootfs", "data", "note")
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, want, 0o644); err != nil {
			t.Fatal(err)
		}
		pause := func() {
			if r := ca.Do(t, "POST", "/sandboxes/"+id+"/pause", nil, nil); r.StatusCode != http.StatusNoContent {
				t.Fatalf("pause: %d %s", r.StatusCode, r.Body)
			}
		}
		// Control: no move, the connect through b resumes it in place.
		pause()
		r, err := connect(cb, id)
		if err != nil || r.StatusCode != http.StatusCreated || where(t, id).NodeID != home.ID {
			t.Fatalf("control, connect through b without a move: %v %v, on %s", r, err, where(t, id).NodeID)
		}
		t.Logf("control: connect through b without a move: %d, on %s", r.StatusCode, home.ID)
		pause()

		cordon(t, home.ID, true)
		type res struct {
			r   *mastertest.Response
			err error
			at  time.Time
		}
		viaA := make(chan res, 1)
		began := time.Now()
		go func() {
			r, err := connect(ca, id)
			viaA <- res{r, err, time.Now()}
		}()
		mastertest.WaitFor(t, 20*time.Second, "a's move holds the sandbox's move lease", func() bool {
			_, held, err := cat.LeaseHeld(ctx, "move/"+id)
			return err == nil && held
		})
		sent := time.Now()
		rb, err := connect(cb, id)
		answered := time.Now()
		if err != nil {
			t.Fatalf("connect through b during the move: %v", err)
		}
		ra := <-viaA
		if ra.err != nil || ra.r.StatusCode != http.StatusCreated {
			t.Fatalf("connect through a (the move): %v %v", ra.r, ra.err)
		}
		t.Logf("connect through a (moving it): %d after %s; through b, sent %s into the move: %d after %s (%s)",
			ra.r.StatusCode, ra.at.Sub(began).Round(time.Millisecond), sent.Sub(began).Round(time.Millisecond),
			rb.StatusCode, answered.Sub(sent).Round(time.Millisecond), strings.TrimSpace(string(rb.Body)))
		if rb.StatusCode != http.StatusOK {
			t.Fatalf("connect through b during a's move: %d %s, want 200 (running, on its new node)", rb.StatusCode, rb.Body)
		}
		row := where(t, id)
		if row.State != catalog.StateRunning || row.NodeID == home.ID {
			t.Fatalf("after the move: %s on %s, want running off %s", row.State, row.NodeID, home.ID)
		}
		got, err := os.ReadFile(filepath.Join(nodes[row.NodeID].Env.Config.SandboxRunDir(id), "rootfs", "data", "note"))
		if err != nil || string(got) != string(want) {
			t.Errorf("file on the new node: %q %v", got, err)
		}
		if na, nb := moves(a.Logs(), id), moves(b.Logs(), id); na != 1 || nb != 0 {
			t.Errorf("moved %d times by a, %d by b; want once, by a", na, nb)
		}
		if !regexp.MustCompile(`waited for another replica's move of the sandbox.*sandbox_id=` + id).MatchString(b.Logs()) {
			t.Errorf("b did not log waiting for the move")
		}
		cordon(t, home.ID, false)
	})

	t.Run("route through b during a's drain", func(t *testing.T) {
		id, home := create(t, map[string]any{"templateID": "busybox", "timeout": 300, "autoPause": true, "autoResume": map[string]any{"enabled": true}})
		startProxy := func(name string, noRetry bool) *cubeproxy.Server {
			pconn, err := cubeproxy.DialMaster("unix://"+b.Socket, "", nil)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { pconn.Close() })
			px, err := cubeproxy.Start(ctx, cubeproxy.Config{Listen: "127.0.0.1:0", Domain: "cube.test", ID: name, NoRetry: noRetry},
				masterpb.NewRouteServiceClient(pconn), mastertest.Log(t))
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
		// The proxy under test, and the control: the same proxy without
		// the retry, under the same traffic through the same move.
		px, bare := startProxy("px-b", false), startProxy("px-b-noretry", true)
		hc := &http.Client{Timeout: 90 * time.Second}
		readVia := func(px *cubeproxy.Server) (int, string) {
			req, _ := http.NewRequest("GET", "http://"+px.Addr+"/health", nil)
			req.Header.Set(proxy.HeaderSandboxID, id)
			req.Header.Set(proxy.HeaderSandboxPort, strconv.Itoa(agentproto.Port))
			resp, err := hc.Do(req)
			if err != nil {
				return 0, err.Error()
			}
			defer resp.Body.Close()
			body, _ := io.ReadAll(resp.Body)
			return resp.StatusCode, strings.TrimSpace(string(body))
		}
		read := func() (int, string) { return readVia(px) }
		mastertest.WaitFor(t, 10*time.Second, "envd through the proxy on b", func() bool { c, _ := read(); return c/100 == 2 })

		type tally struct {
			wg    sync.WaitGroup
			mu    sync.Mutex
			codes map[int]int
			bad   []string
			gap   time.Duration
		}
		traffic := func(px *cubeproxy.Server, stop <-chan struct{}) *tally {
			tl := &tally{codes: map[int]int{}}
			for range 4 {
				tl.wg.Add(1)
				go func() {
					defer tl.wg.Done()
					for {
						select {
						case <-stop:
							return
						default:
						}
						began := time.Now()
						code, body := readVia(px)
						took := time.Since(began)
						tl.mu.Lock()
						tl.codes[code]++
						if code/100 != 2 {
							tl.bad = append(tl.bad, fmt.Sprintf("%d %s", code, body))
						}
						tl.gap = max(tl.gap, took)
						tl.mu.Unlock()
					}
				}()
			}
			return tl
		}
		check := func(what string, tl *tally) int {
			t.Helper()
			tl.wg.Wait() // every client stopped
			tl.mu.Lock()
			defer tl.mu.Unlock()
			t.Logf("%s: answers %v, longest %s", what, tl.codes, tl.gap.Round(time.Millisecond))
			for _, b := range tl.bad {
				t.Logf("  %s: %s", what, b)
			}
			return len(tl.bad)
		}

		// Control: the same reads without a move.
		stop := make(chan struct{})
		tl, tlBare := traffic(px, stop), traffic(bare, stop)
		time.Sleep(time.Second)
		close(stop)
		if check("reads through b's proxy, no move", tl)+check("reads through b's proxy without the retry, no move", tlBare) > 0 {
			t.Fatal("reads failed without a move")
		}

		// slowPost uploads through b's proxy a file whose body's second
		// part is sent once release closes; it is on its way (through the
		// proxy to envd) when the returned channel first is closed.
		type answer struct {
			code int
			body string
		}
		envdToken := where(t, id).EnvdAccessToken
		slowPost := func(path string, release <-chan struct{}) (first <-chan struct{}, res <-chan answer) {
			pr, pw := io.Pipe()
			sent, out := make(chan struct{}), make(chan answer, 1)
			go func() {
				_, _ = pw.Write([]byte("first\n"))
				time.Sleep(300 * time.Millisecond)
				close(sent)
				select {
				case <-release:
				case <-time.After(2 * time.Minute):
				}
				_, _ = pw.Write([]byte("second\n"))
				pw.Close()
			}()
			go func() {
				req, _ := http.NewRequest("POST", "http://"+px.Addr+"/files?username=root&path="+url.QueryEscape(path), pr)
				req.Header.Set(proxy.HeaderSandboxID, id)
				req.Header.Set(proxy.HeaderSandboxPort, strconv.Itoa(agentproto.Port))
				req.Header.Set("Content-Type", "application/octet-stream")
				req.Header.Set("X-Access-Token", envdToken)
				resp, err := hc.Do(req)
				if err != nil {
					out <- answer{0, err.Error()}
					return
				}
				defer resp.Body.Close()
				b, _ := io.ReadAll(resp.Body)
				out <- answer{resp.StatusCode, strings.TrimSpace(string(b))}
			}()
			return sent, out
		}
		// drain drains from through a; moved (when not nil) closes once
		// the drain reports the sandbox moved (frozen, started elsewhere).
		drain := func(from string, requestWaitMs int64, moved chan<- struct{}) time.Duration {
			t.Helper()
			began := time.Now()
			stream, err := a.Admin.DrainNode(ctx, &masterpb.DrainNodeRequest{NodeId: from, RequestWaitMs: requestWaitMs})
			if err != nil {
				t.Fatal(err)
			}
			for {
				ev, err := stream.Recv()
				if errors.Is(err, io.EOF) {
					break
				}
				if err != nil {
					t.Fatalf("drain: %v", err)
				}
				t.Logf("  drain: %s %s %s -> %s %s", ev.SandboxId, ev.State, ev.Phase, ev.ToNode, ev.Error)
				if moved != nil && ev.SandboxId == id && ev.Phase == "moved" {
					close(moved)
					moved = nil
				}
			}
			if moved != nil {
				close(moved)
			}
			return time.Since(began)
		}

		// With the wait before the freeze off: the retry carries the
		// reads across; without it (the control) reads in flight when
		// the sandbox froze fail, and so does a POST in flight.
		stop = make(chan struct{})
		tl, tlBare = traffic(px, stop), traffic(bare, stop)
		time.Sleep(300 * time.Millisecond)
		// The POST's second part goes once the sandbox froze and moved,
		// however long the drain takes to get there.
		release := make(chan struct{})
		first, res := slowPost("/data/control", release)
		<-first
		drained := drain(home.ID, -1, release)
		time.Sleep(time.Second) // reads go on where it is now
		close(stop)
		if n := check(fmt.Sprintf("reads through b's proxy while a drained %s, no wait (%s)", home.ID, drained.Round(time.Millisecond)), tl); n > 0 {
			t.Errorf("%d reads failed through the route during the move", n)
		}
		// The control: without the retry, reads in flight when the
		// sandbox froze fail (502) once its original is destroyed.
		if n := check("control: the same reads through b's proxy without the retry", tlBare); n == 0 {
			t.Errorf("control: no read failed without the retry; the probe shows nothing")
		}
		ctl := <-res
		t.Logf("control: a POST through b's proxy in flight when a froze the sandbox without a wait: %d %s", ctl.code, ctl.body)
		if ctl.code != http.StatusBadGateway {
			t.Errorf("control: the POST in flight without the wait: %d, want 502", ctl.code)
		}
		row := where(t, id)
		if row.NodeID == home.ID || row.State != catalog.StateRunning {
			t.Fatalf("after the drain: %s on %s, want running off %s", row.State, row.NodeID, home.ID)
		}
		if code, body := read(); code/100 != 2 {
			t.Fatalf("read after the drain: %d %s", code, body)
		}
		cordon(t, home.ID, false)

		// With the wait (the default [drain] request_wait): a quiesces
		// the sandbox through b, whose proxies answer; reads and the POST
		// in flight finish at the original, new ones wait for the move.
		from := row.NodeID
		stop = make(chan struct{})
		tl, tlBare = traffic(px, stop), traffic(bare, stop)
		time.Sleep(300 * time.Millisecond)
		// The POST's second part goes once the hold began (b's proxy
		// dropped the route): it is in flight through the hold, however
		// long the drain takes to get there.
		release = make(chan struct{})
		first, res = slowPost("/data/inflight", release)
		<-first
		go func() {
			defer close(release)
			for end := time.Now().Add(time.Minute); time.Now().Before(end) && px.Routes.Cached(id); {
				time.Sleep(5 * time.Millisecond)
			}
		}()
		tokenBefore := moveToken(t, id)
		drained = drain(from, 0, nil)
		raised(t, id, tokenBefore)
		time.Sleep(time.Second)
		close(stop)
		if n := check(fmt.Sprintf("reads through b's proxy while a drained %s with the wait (%s)", from, drained.Round(time.Millisecond)), tl); n > 0 {
			t.Errorf("%d reads failed through the route during the move", n)
		}
		if n := check("reads through b's proxy without the retry, with the wait", tlBare); n > 0 {
			t.Errorf("%d reads failed without the retry: the wait did not let them finish", n)
		}
		got := <-res
		t.Logf("a POST through b's proxy in flight when a's move began: %d %s", got.code, got.body)
		if got.code != http.StatusOK {
			t.Errorf("the POST in flight with the wait: %d, want 200 from the original", got.code)
		}
		row = where(t, id)
		if row.NodeID == from || row.State != catalog.StateRunning {
			t.Fatalf("after the drain: %s on %s, want running off %s", row.State, row.NodeID, from)
		}
		if b, err := os.ReadFile(filepath.Join(nodes[row.NodeID].Env.Config.SandboxRunDir(id), "rootfs", "data", "inflight")); err != nil || string(b) != "first\nsecond\n" {
			t.Errorf("the in-flight upload's file on the new node: %q %v, want it whole", b, err)
		}
		if !regexp.MustCompile(`quiesce: no request in flight; the sandbox freezes.*sandbox_id=` + id).MatchString(a.Logs()) {
			t.Errorf("a did not log the end of the quiesce")
		}
		cordon(t, from, false)

		// Idle now, but served through b within the last seconds: a's
		// hold waits for b's answer (its route poll, its proxies'
		// answers, its traffic row with the move's token), not for the
		// bound (5 s).
		from = row.NodeID
		quiesced := regexp.MustCompile(`quiesce: no request in flight; the sandbox freezes.*sandbox_id=` + id + ` waited=(\S+)`)
		before := len(quiesced.FindAllString(a.Logs(), -1))
		tokenBefore = moveToken(t, id)
		drained = drain(from, 0, nil)
		raised(t, id, tokenBefore)
		all := quiesced.FindAllStringSubmatch(a.Logs(), -1)
		if len(all) != before+1 {
			t.Fatalf("a logged %d quiesces of the idle sandbox, want 1", len(all)-before)
		}
		held, err := time.ParseDuration(all[len(all)-1][1])
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("idle sandbox served through b recently: a's hold %s (b's answer), the drain %s", held, drained.Round(time.Millisecond))
		if held > 2*time.Second {
			t.Errorf("a's hold of an idle sandbox took %s: b did not answer", held)
		}
		cordon(t, from, false)
	})
}
