package master_test

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-sql-driver/mysql"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	cubeletpb "github.com/cubesandbox/cube/api/cubelet/v1"
	masterpb "github.com/cubesandbox/cube/api/master/v1"
	"github.com/cubesandbox/cube/internal/agentproto"
	"github.com/cubesandbox/cube/internal/cubeproxy"
	"github.com/cubesandbox/cube/internal/master/catalog"
	"github.com/cubesandbox/cube/internal/master/catalog/catalogtest"
	"github.com/cubesandbox/cube/internal/master/mastertest"
	"github.com/cubesandbox/cube/internal/proxy"
)

// TestReplicas: two real cubemaster processes (replicas a and b) on one
// MariaDB catalog and one cubelet that reports to the first of them that
// answers.
//
//   - any replica serves the API: a sandbox created through one is read,
//     paused, connected to and killed through the other, and b places
//     sandboxes on the node that reports only to a;
//   - only the lease's holder runs the loops: sandboxes created through
//     both replicas with a 1 s deadline are each killed exactly once, by
//     the holder (counted in both replicas' logs);
//   - SIGKILL of the holder under a create load: b takes the lease (new
//     fencing token) within a few seconds, measured from the kill to the
//     lease row naming b; creates through b never fail; the node moves
//     to b; a deadline passed after the kill is enforced by b;
//   - a holder cut off from the catalog (b, behind a TCP relay the test
//     cuts) stops its loops before another replica (a, restarted) takes
//     the lease, and stays a follower when the relay heals.
func TestReplicas(t *testing.T) {
	db := catalogtest.StartMariaDB(t)
	dsn := db.NewDatabase(t)
	relay := newRelay(t, dsnAddr(t, dsn))
	conf := func(id string) string {
		d := dsn
		if id == "b" {
			d = withAddr(t, dsn, relay.addr)
		}
		return fmt.Sprintf("[catalog]\ndriver = \"mysql\"\ndsn = %q\n[ha]\nreplica_id = %q\nlease_ttl = \"2s\"\n[sandbox]\nmilli_cpu = 100\n", d, id)
	}
	ctx := context.Background()
	cat, err := catalog.Open(ctx, catalog.MySQL, dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cat.Close() })
	lease := func() catalog.Lease {
		l, err := cat.GetLease(ctx, "master-loops")
		if err != nil {
			return catalog.Lease{}
		}
		return l
	}

	a := mastertest.StartMasterProcess(t, conf("a"))
	mastertest.WaitFor(t, 10*time.Second, "a holds the lease", func() bool { return lease().Replica == "a" && lease().Holder != "" })
	b := mastertest.StartMasterProcess(t, conf("b"))
	n := mastertest.StartNodeReplicas(t, []*mastertest.Master{a, b}, "", "busybox")
	a.WaitHealthy(t, n)
	b.WaitHealthy(t, n) // b hears of the node through the catalog only
	first := lease()
	t.Logf("lease: holder %s token %d", first.Holder, first.Token)

	key := a.APIKey(t) // made through a, verified by b from the catalog
	ca, cb := a.API(key), b.API(key)
	create := func(t *testing.T, c *mastertest.Client, timeout int) string {
		t.Helper()
		var sb e2bSandbox
		if r := c.Do(t, "POST", "/v2/sandboxes", map[string]any{"templateID": "busybox", "timeout": timeout}, &sb); r.StatusCode != http.StatusCreated {
			t.Fatalf("create: %d %s", r.StatusCode, r.Body)
		}
		return sb.SandboxID
	}
	state := func(t *testing.T, c *mastertest.Client, id string) string {
		t.Helper()
		var sb e2bSandbox
		r := c.Do(t, "GET", "/sandboxes/"+id, nil, &sb)
		if r.StatusCode == http.StatusNotFound {
			return ""
		}
		if r.StatusCode != http.StatusOK {
			t.Fatalf("get %s: %d %s", id, r.StatusCode, r.Body)
		}
		return sb.State
	}

	t.Run("verbs across replicas", func(t *testing.T) {
		id := create(t, ca, 300)
		if st := state(t, cb, id); st != "running" {
			t.Fatalf("through b: %q, want running", st)
		}
		if r := cb.Do(t, "POST", "/sandboxes/"+id+"/pause", nil, nil); r.StatusCode != http.StatusNoContent {
			t.Fatalf("pause through b: %d %s", r.StatusCode, r.Body)
		}
		if st := state(t, ca, id); st != "paused" {
			t.Fatalf("through a after pause: %q", st)
		}
		if r := ca.Do(t, "POST", "/v2/sandboxes/"+id+"/connect", map[string]any{"timeout": 300}, nil); r.StatusCode != http.StatusCreated {
			t.Fatalf("connect (resume) through a: %d %s", r.StatusCode, r.Body)
		}
		if r := cb.Do(t, "DELETE", "/sandboxes/"+id, nil, nil); r.StatusCode != http.StatusNoContent {
			t.Fatalf("kill through b: %d %s", r.StatusCode, r.Body)
		}
		if st := state(t, ca, id); st != "" {
			t.Fatalf("through a after kill: %q, want gone", st)
		}
		if _, err := n.Svc.Get(ctx, id); err == nil {
			t.Fatalf("%s still on its node after a kill through b", id)
		}
		// b places on the node that reports to a.
		id = create(t, cb, 300)
		if st := state(t, ca, id); st != "running" {
			t.Fatalf("created through b, read through a: %q", st)
		}
		if r := ca.Do(t, "DELETE", "/sandboxes/"+id, nil, nil); r.StatusCode != http.StatusNoContent {
			t.Fatalf("kill through a: %d %s", r.StatusCode, r.Body)
		}
	})

	t.Run("deadlines enforced once", func(t *testing.T) {
		var ids []string
		for i := range 8 {
			c := ca
			if i%2 == 1 {
				c = cb
			}
			ids = append(ids, create(t, c, 1))
		}
		mastertest.WaitFor(t, 20*time.Second, "every sandbox past its deadline killed", func() bool {
			for _, id := range ids {
				if state(t, cb, id) != "" {
					return false
				}
			}
			return true
		})
		time.Sleep(time.Second) // a second kill would come within an expiry interval
		holder := lease().Replica
		for _, id := range ids {
			re := regexp.MustCompile(`sandbox killed at its deadline.*sandbox_id=` + id)
			na, nb := len(re.FindAllString(a.Logs(), -1)), len(re.FindAllString(b.Logs(), -1))
			if na+nb != 1 || (holder == "a") != (na == 1) {
				t.Errorf("%s killed at its deadline %d times by a, %d by b (lease holder %s); want once, by the holder", id, na, nb, holder)
			}
		}
		if strings.Contains(b.Logs(), "lease: acquired") {
			t.Errorf("b acquired the lease while a held it")
		}
		t.Logf("%d sandboxes killed at their deadline, each once, by %s (token %d)", len(ids), holder, lease().Token)
	})

	t.Run("route changes reach every replica's watchers", func(t *testing.T) {
		// A proxy watching b hears of a pause and a kill made through a.
		conn, err := grpc.NewClient("unix://"+b.Socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		wctx, cancel := context.WithCancel(ctx)
		defer cancel()
		stream, err := masterpb.NewRouteServiceClient(conn).WatchRoutes(wctx, &masterpb.WatchRoutesRequest{})
		if err != nil {
			t.Fatal(err)
		}
		events := make(chan string, 64)
		go func() {
			for {
				ev, err := stream.Recv()
				if err != nil {
					close(events)
					return
				}
				if !ev.Reset_ {
					events <- ev.SandboxId
				}
			}
		}()
		time.Sleep(300 * time.Millisecond) // the stream is open
		id := create(t, ca, 300)
		var begin time.Time
		expect := func(what string) {
			t.Helper()
			deadline := time.After(3 * time.Second)
			for {
				select {
				case got, ok := <-events:
					if !ok {
						t.Fatalf("watch on b ended")
					}
					if got == id {
						t.Logf("%s through a: b's watcher told in %s", what, time.Since(begin).Round(time.Millisecond))
						return
					}
				case <-deadline:
					t.Fatalf("%s through a: b's watcher not told within 3s", what)
				}
			}
		}
		begin = time.Now()
		if r := ca.Do(t, "POST", "/sandboxes/"+id+"/pause", nil, nil); r.StatusCode != http.StatusNoContent {
			t.Fatalf("pause through a: %d %s", r.StatusCode, r.Body)
		}
		expect("pause")
		begin = time.Now()
		if r := ca.Do(t, "DELETE", "/sandboxes/"+id, nil, nil); r.StatusCode != http.StatusNoContent {
			t.Fatalf("kill through a: %d %s", r.StatusCode, r.Body)
		}
		expect("kill")
	})

	t.Run("idle policy counts traffic seen by any replica", func(t *testing.T) {
		// The holder (a) pauses idle sandboxes; the traffic of this one is
		// reported to b only (a proxy connected to b). It must stay
		// running while b's proxy holds a request open, and be paused
		// once the traffic stops (the control: the same sandbox, the same
		// holder, without traffic).
		conn, err := grpc.NewClient("unix://"+b.Socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		rc := masterpb.NewRouteServiceClient(conn)
		var sb e2bSandbox
		if r := ca.Do(t, "POST", "/v2/sandboxes", map[string]any{"templateID": "busybox", "timeout": 300, "idleTimeout": 2}, &sb); r.StatusCode != http.StatusCreated {
			t.Fatalf("create: %d %s", r.StatusCode, r.Body)
		}
		id := sb.SandboxID
		report := func(open int32) {
			t.Helper()
			if _, err := rc.ReportActivity(ctx, &masterpb.ReportActivityRequest{ProxyId: "proxy-on-b",
				Sandboxes: []*masterpb.SandboxActivity{{SandboxId: id, InFlight: open, Requests: 1}}}); err != nil {
				t.Fatal(err)
			}
		}
		busyFor := 5 * time.Second
		for end := time.Now().Add(busyFor); time.Now().Before(end); time.Sleep(500 * time.Millisecond) {
			report(1)
			if st := state(t, cb, id); st != "running" {
				t.Fatalf("paused by the holder while b's proxy had a request open (%s)", st)
			}
		}
		report(0)
		quiet := time.Now()
		mastertest.WaitFor(t, 10*time.Second, "paused once idle", func() bool { return state(t, cb, id) == "paused" })
		t.Logf("kept running %s (idle timeout 2 s) while a request was open through b; paused %s after the traffic stopped",
			busyFor, time.Since(quiet).Round(100*time.Millisecond))
		if r := cb.Do(t, "DELETE", "/sandboxes/"+id, nil, nil); r.StatusCode != http.StatusNoContent {
			t.Fatalf("kill: %d", r.StatusCode)
		}
	})

	t.Run("leader killed under load", func(t *testing.T) {
		// Creates alternate between the replicas; a client whose replica
		// does not answer tries the other, as a client with both
		// addresses (or a load balancer) would.
		var (
			mu                    sync.Mutex
			ok, failed, failedOnB int
			retried               int // sent to a after it died, then to b
			failures              []string
			created               []string
		)
		stop := make(chan struct{})
		var wg sync.WaitGroup
		for w := range 3 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := 0; ; i++ {
					select {
					case <-stop:
						return
					default:
					}
					order := []*mastertest.Client{ca, cb}
					if (w+i)%2 == 1 {
						order = []*mastertest.Client{cb, ca}
					}
					var id, why string
					onB := false
					for _, c := range order {
						req, _ := http.NewRequest("POST", c.Base+"/v2/sandboxes", strings.NewReader(`{"templateID":"busybox","timeout":300}`))
						req.Header.Set("Content-Type", "application/json")
						var sb e2bSandbox
						r, err := c.Try(req, &sb)
						if err != nil {
							why = err.Error()
							mu.Lock()
							retried++
							mu.Unlock()
							continue // that replica is gone: the other
						}
						onB = c == cb
						if r.StatusCode == http.StatusCreated {
							id = sb.SandboxID
						} else {
							why = fmt.Sprintf("%d %s", r.StatusCode, r.Body)
						}
						break
					}
					// Most are killed at once (through whichever replica
					// answers) to keep the node's load flat; every fourth is
					// kept and checked at the end.
					if id != "" && i%4 != 0 {
						for _, c := range order {
							req, _ := http.NewRequest("DELETE", c.Base+"/sandboxes/"+id, nil)
							if _, err := c.Try(req, nil); err == nil {
								break
							}
						}
					}
					mu.Lock()
					if id != "" {
						ok++
						if i%4 == 0 {
							created = append(created, id)
						}
					} else {
						failed++
						if onB {
							failedOnB++
						}
						failures = append(failures, why)
					}
					mu.Unlock()
				}
			}()
		}
		// A cubeproxy that knows both replicas, a first.
		pconn, err := cubeproxy.DialMaster("unix://"+a.Socket+",unix://"+b.Socket, "", nil)
		if err != nil {
			t.Fatal(err)
		}
		defer pconn.Close()
		px, err := cubeproxy.Start(ctx, cubeproxy.Config{Listen: "127.0.0.1:0", Domain: "cube.test", ID: "px"}, masterpb.NewRouteServiceClient(pconn), mastertest.Log(t))
		if err != nil {
			t.Fatal(err)
		}
		defer func() {
			if err := px.Stop(); err != nil {
				t.Error(err)
			}
		}()
		proxied := func(id string) int {
			req, _ := http.NewRequest("GET", "http://"+px.Addr+"/health", nil)
			req.Header.Set(proxy.HeaderSandboxID, id)
			req.Header.Set(proxy.HeaderSandboxPort, strconv.Itoa(agentproto.Port))
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				return 0
			}
			resp.Body.Close()
			return resp.StatusCode
		}
		routed := create(t, cb, 300)
		mastertest.WaitFor(t, 10*time.Second, "envd through the proxy (via a)", func() bool { return proxied(routed)/100 == 2 })

		time.Sleep(2 * time.Second)
		before := lease()
		killed := time.Now()
		a.Kill()
		var took time.Duration
		var after catalog.Lease
		mastertest.WaitFor(t, 15*time.Second, "b takes the lease", func() bool {
			after = lease()
			took = time.Since(killed)
			return after.Replica == "b" && after.Holder != ""
		})
		// A deadline that passes after the kill is b's to enforce.
		late := create(t, cb, 1)
		time.Sleep(2 * time.Second)
		close(stop)
		wg.Wait()
		t.Logf("HANDOVER %s from SIGKILL of a (token %d) to b holding the lease (token %d); creates during the run: %d ok, %d failed (%d answered by b), %d sent to the dead a and retried on b",
			took.Round(time.Millisecond), before.Token, after.Token, ok, failed, failedOnB, retried)
		for _, f := range failures {
			t.Logf("failed create: %s", f)
		}
		if after.Token <= before.Token {
			t.Errorf("fencing token %d after the handover, want more than %d", after.Token, before.Token)
		}
		if took > 2*time.Second+2*time.Second/3+time.Second {
			t.Errorf("handover took %s; the lease is 2 s, renewed every 667 ms", took)
		}
		if failedOnB > 0 {
			t.Errorf("%d creates answered by b failed", failedOnB)
		}
		mastertest.WaitFor(t, 10*time.Second, "the late sandbox killed at its deadline by b", func() bool { return state(t, cb, late) == "" })
		// The row goes before the kill is logged: wait for b's log line.
		killedByB := regexp.MustCompile(`sandbox killed at its deadline.*sandbox_id=` + late)
		mastertest.WaitFor(t, 5*time.Second, "b's log of the late sandbox's kill", func() bool { return killedByB.MatchString(b.Logs()) })
		// The node reports to b now: its heartbeats move on.
		mastertest.WaitFor(t, 10*time.Second, "the node's heartbeats reach b", func() bool {
			v := b.Node(t, n.ID)
			return v != nil && v.Healthy && v.LastHeartbeat.AsTime().After(killed.Add(time.Second))
		})
		// The proxy follows b: a sandbox it never resolved is reached.
		fresh := create(t, cb, 300)
		begin := time.Now()
		mastertest.WaitFor(t, 10*time.Second, "envd through the proxy after a died", func() bool { return proxied(fresh)/100 == 2 })
		t.Logf("proxy: a new sandbox reached through b %s after asking", time.Since(begin).Round(time.Millisecond))
		for _, id := range []string{routed, fresh} {
			if code := proxied(id); code/100 != 2 {
				t.Errorf("proxied %s after the handover: %d", id, code)
			}
			cb.Do(t, "DELETE", "/sandboxes/"+id, nil, nil)
		}
		// Every create acknowledged runs, and is known to b.
		sort.Strings(created)
		for _, id := range created {
			if st := state(t, cb, id); st != "running" {
				t.Errorf("acknowledged create %s: %q through b, want running", id, st)
			}
			if r := cb.Do(t, "DELETE", "/sandboxes/"+id, nil, nil); r.StatusCode != http.StatusNoContent {
				t.Errorf("kill %s: %d", id, r.StatusCode)
			}
		}
		// A create in flight on a when it died can have finished on the
		// node without an answer (b adopts or destroys it at the node's
		// next reconcile, which this test does not wait for): what the
		// node still holds and b does not know goes now, through b if it
		// adopted it meanwhile, else on the node.
		held, err := n.Client.ListSandboxes(ctx, &cubeletpb.ListSandboxesRequest{})
		if err != nil {
			t.Fatal(err)
		}
		for _, sb := range held.Sandboxes {
			if st := state(t, cb, sb.Id); st != "" {
				cb.Do(t, "DELETE", "/sandboxes/"+sb.Id, nil, nil)
				continue
			}
			t.Logf("sandbox %s on the node, unknown to b (a create a died in): deleted on the node", sb.Id)
			if _, err := n.Client.DeleteSandbox(ctx, &cubeletpb.DeleteSandboxRequest{RequestId: sb.Id, SandboxId: sb.Id}); err != nil {
				t.Errorf("delete %s on the node: %v", sb.Id, err)
			}
		}
	})

	t.Run("holder cut off from the catalog stops first", func(t *testing.T) {
		a.Start() // a follower again; b holds the lease
		mastertest.WaitFor(t, 10*time.Second, "a replica again", func() bool { return strings.Count(a.Logs(), "cubemaster catalog open") >= 2 })
		if l := lease(); l.Replica != "b" {
			t.Fatalf("lease %+v, want b's", l)
		}
		cut := time.Now()
		relay.cut(true)
		mastertest.WaitFor(t, 15*time.Second, "a takes the lease", func() bool { return lease().Replica == "a" })
		taken := time.Now()
		mastertest.WaitFor(t, 5*time.Second, "a's log of it", func() bool { return strings.Count(a.Logs(), "lease: acquired") >= 2 })
		aAcq := lastLogTime(t, a.Logs(), "lease: acquired")
		bStop := lastLogTime(t, b.Logs(), "lease: lifecycle loops stopped")
		t.Logf("relay cut; b's loops stopped %s later, a acquired %s later (lease seen taken %s later); b stopped %s before a took over",
			bStop.Sub(cut).Round(time.Millisecond), aAcq.Sub(cut).Round(time.Millisecond), taken.Sub(cut).Round(time.Millisecond), aAcq.Sub(bStop).Round(time.Millisecond))
		if bStop.Before(cut) || !bStop.Before(aAcq) {
			t.Fatalf("b's loops stopped at %s, a acquired at %s (cut at %s): b must stop first", bStop, aAcq, cut)
		}
		relay.cut(false)
		acquiredBefore := strings.Count(b.Logs(), "lease: acquired")
		time.Sleep(2 * time.Second)
		if n := strings.Count(b.Logs(), "lease: acquired"); n != acquiredBefore || lease().Replica != "a" {
			t.Fatalf("after the relay healed: b acquired %d more times, lease %+v", n-acquiredBefore, lease())
		}
	})
}

// lastLogTime is the time of the last log line containing msg.
func lastLogTime(t *testing.T, logs, msg string) time.Time {
	t.Helper()
	var at time.Time
	for _, line := range strings.Split(logs, "\n") {
		i := strings.Index(line, "time=")
		if !strings.Contains(line, msg) || i < 0 {
			continue
		}
		f := strings.Fields(line[i:])
		ts, err := time.Parse(time.RFC3339Nano, strings.TrimPrefix(f[0], "time="))
		if err != nil {
			t.Fatalf("log time in %q: %v", line, err)
		}
		at = ts
	}
	if at.IsZero() {
		t.Fatalf("no log line %q", msg)
	}
	return at
}

func dsnAddr(t *testing.T, dsn string) string {
	cfg, err := mysql.ParseDSN(dsn)
	if err != nil {
		t.Fatal(err)
	}
	return cfg.Addr
}

func withAddr(t *testing.T, dsn, addr string) string {
	cfg, err := mysql.ParseDSN(dsn)
	if err != nil {
		t.Fatal(err)
	}
	cfg.Addr = addr
	return cfg.FormatDSN()
}

// relay forwards TCP to a server until cut: then it drops every
// connection and holds new ones open without an answer (a partition).
type relay struct {
	addr string
	mu   sync.Mutex
	off  bool
	open map[net.Conn]bool
}

func newRelay(t *testing.T, to string) *relay {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	r := &relay{addr: ln.Addr().String(), open: map[net.Conn]bool{}}
	t.Cleanup(func() { ln.Close(); r.cut(true) })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			r.mu.Lock()
			r.open[c] = true
			off := r.off
			r.mu.Unlock()
			if off {
				continue // held open, never answered
			}
			go func() {
				up, err := net.Dial("tcp", to)
				if err != nil {
					c.Close()
					return
				}
				r.mu.Lock()
				r.open[up] = true
				r.mu.Unlock()
				go func() { _, _ = io.Copy(up, c); up.Close() }()
				_, _ = io.Copy(c, up)
				c.Close()
			}()
		}
	}()
	return r
}

func (r *relay) cut(off bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.off = off
	if off {
		for c := range r.open {
			c.Close()
		}
		r.open = map[net.Conn]bool{}
	}
}
