package cluster_test

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"

	pb "github.com/cubesandbox/cube/api/envd/process"
	"github.com/cubesandbox/cube/api/envd/process/processconnect"
	masterpb "github.com/cubesandbox/cube/api/master/v1"
	"github.com/cubesandbox/cube/internal/envdtest"
	"github.com/cubesandbox/cube/internal/master/mastertest"
	"github.com/cubesandbox/cube/internal/proxy"
	"github.com/cubesandbox/cube/internal/testbin"
	"github.com/cubesandbox/cube/internal/testenv"
	cluster "github.com/cubesandbox/cube/test/cluster/clusterenv"
)

type created struct {
	SandboxID string `json:"sandboxID"`
}

// create makes a sandbox through the E2B API of one replica.
func create(c *mastertest.Client) (string, *mastertest.Response, error) {
	req, err := http.NewRequest(http.MethodPost, c.Base+"/sandboxes", strings.NewReader(`{"templateID":"`+cluster.Template+`","timeout":600}`))
	if err != nil {
		return "", nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	var out created
	r, err := c.Try(req, &out)
	if err != nil {
		return "", nil, err
	}
	if r.StatusCode/100 != 2 {
		return "", r, errors.New(r.Status + ": " + string(r.Body))
	}
	return out.SandboxID, r, nil
}

func kill(t *testing.T, c *mastertest.Client, id string) {
	t.Helper()
	r := c.Do(t, http.MethodDelete, "/sandboxes/"+id, nil, nil)
	if r.StatusCode/100 != 2 && r.StatusCode != http.StatusNotFound {
		t.Errorf("kill %s: %s %s", id, r.Status, r.Body)
	}
}

// TestCluster builds a cluster of three node hosts, a MariaDB host, two
// cubemaster hosts and two cubeproxy hosts on a bridge, and runs the
// cluster cases on it in order (one cluster: building it is most of the
// time).
func TestCluster(t *testing.T) {
	start := time.Now()
	// Pauses export their snapshot, so a paused sandbox outlives its node
	// (case node-loss).
	// gVisor with memory snapshots: a gVisor sandbox moves with its
	// memory (case drain).
	// The vm runtime too (where QEMU is installed): a VM sandbox moves
	// with its memory (case drain).
	c := cluster.Start(t, cluster.Options{ObjectStore: true, MasterTOML: "[store]\nexport_on_pause = true\n",
		NodeTOML: "[gvisor]\ncheckpoint = true\n", VM: true})
	t.Logf("cluster %s up in %s: bridge %s, db %s, masters %s, proxies %d, nodes %d",
		c.ID, time.Since(start).Round(time.Millisecond), c.Bridge, c.DB.Host.IP, c.MasterAddrs(), len(c.Proxies), len(c.Nodes))
	key := c.APIKey(t)
	apis := []*mastertest.Client{c.Masters[0].API(key), c.Masters[1].API(key)}

	t.Run("register", func(t *testing.T) {
		// Every replica knows every node over TCP with mTLS, whichever
		// replica the node reports to.
		for _, m := range c.Masters {
			resp, err := m.Admin.ListNodes(context.Background(), &masterpb.ListNodesRequest{})
			if err != nil {
				t.Fatal(err)
			}
			have := map[string]string{}
			for _, n := range resp.Nodes {
				if n.Healthy {
					have[n.Report.NodeId] = n.Report.Address
				}
			}
			for _, n := range c.Nodes {
				addr, ok := have[n.ID]
				if !ok || !strings.HasPrefix(addr, n.Host.IP+":") {
					t.Errorf("replica %s: node %s healthy at %q, want at %s", m.Replica, n.ID, addr, n.Host.IP)
				}
			}
			t.Logf("replica %s: nodes %v", m.Replica, have)
		}
	})

	t.Run("spread", func(t *testing.T) {
		// Creates through either replica's E2B API land on every node.
		const n = 6
		var ids []string
		t.Cleanup(func() {
			for _, id := range ids {
				kill(t, apis[0], id)
			}
		})
		began := time.Now()
		for i := 0; i < n; i++ {
			id, _, err := create(apis[i%2])
			if err != nil {
				t.Fatalf("create %d through %s: %v", i, c.Masters[i%2].Replica, err)
			}
			ids = append(ids, id)
		}
		t.Logf("%d creates in %s", n, time.Since(began).Round(time.Millisecond))
		per := map[string]int{}
		for _, sb := range c.Sandboxes(t, "running") {
			for _, id := range ids {
				if sb.SandboxId == id {
					per[sb.NodeId]++
				}
			}
		}
		t.Logf("placement: %v", per)
		for _, node := range c.Nodes {
			if per[node.ID] == 0 {
				t.Errorf("no sandbox on node %s (placement %v)", node.ID, per)
			}
		}
		// Each replica answers for every sandbox, whichever made it.
		for _, id := range ids {
			for i, api := range apis {
				if r := api.Do(t, http.MethodGet, "/sandboxes/"+id, nil, nil); r.StatusCode != http.StatusOK {
					t.Errorf("GET %s through %s: %s", id, c.Masters[i].Replica, r.Status)
				}
			}
		}
	})

	t.Run("cross-host", func(t *testing.T) {
		crossHost(t, c, apis)
	})

	t.Run("e2b-sdk", func(t *testing.T) {
		sdkSuites(t, c, apis, key)
	})

	t.Run("templates", func(t *testing.T) {
		templates(t, c, apis)
	})

	t.Run("drain", func(t *testing.T) {
		drain(t, c, apis)
	})

	t.Run("e2b-sdk-drain", func(t *testing.T) {
		sdkDrain(t, c, apis, key)
	})

	t.Run("leader-kill", func(t *testing.T) {
		leaderKill(t, c, apis)
	})

	t.Run("host-loss", func(t *testing.T) {
		hostLoss(t, c, apis)
	})

	t.Run("node-loss", func(t *testing.T) {
		nodeLoss(t, c, apis)
	})
}

// leaderKill SIGKILLs the replica holding the loops' lease while three
// clients create sandboxes, alternating replicas and trying the other
// when theirs does not answer (as an SDK behind a load balancer would).
// No create the survivor answered may fail; the lease must move within
// about lease_ttl × 4/3; the window (kill to the first create the
// survivor acknowledged, and kill to the lease taken) is logged.
func leaderKill(t *testing.T, c *cluster.Cluster, apis []*mastertest.Client) {
	holder := ""
	mastertest.WaitFor(t, 10*time.Second, "a lease holder", func() bool { holder = c.LeaseHolder(t); return holder != "" })
	li := 0
	if c.Masters[1].Replica == holder {
		li = 1
	}
	leader, survivor := c.Masters[li], c.Masters[1-li]
	t.Logf("lease held by %s", holder)

	var (
		mu       sync.Mutex
		ids      []string
		failures []string
		acked    atomic.Int64
		retried  atomic.Int64
		firstOK  atomic.Int64 // unix nanos of the first survivor ack after the kill
		killedAt atomic.Int64
	)
	t.Cleanup(func() {
		for _, id := range ids {
			kill(t, apis[1-li], id)
		}
	})
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for w := 0; w < 3; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			for i := w; ctx.Err() == nil; i++ {
				for try := 0; try < 2; try++ {
					k := (i + try) % 2
					id, r, err := create(apis[k])
					var ne net.Error
					if err != nil && r == nil && (errors.As(err, &ne) || strings.Contains(err.Error(), "connection") || errors.Is(err, context.DeadlineExceeded)) {
						retried.Add(1)
						continue // that replica is gone: the other
					}
					mu.Lock()
					if err != nil {
						failures = append(failures, c.Masters[k].Replica+": "+err.Error())
					} else {
						ids = append(ids, id)
						acked.Add(1)
						if k == 1-li && killedAt.Load() != 0 && firstOK.Load() == 0 {
							firstOK.Store(time.Now().UnixNano())
						}
					}
					mu.Unlock()
					break
				}
			}
		}(w)
	}
	time.Sleep(2 * time.Second)
	before := acked.Load()
	kill := time.Now()
	killedAt.Store(kill.UnixNano())
	leader.Proc.Kill()
	var handover time.Duration
	mastertest.WaitFor(t, 15*time.Second, "the survivor to take the lease", func() bool {
		if c.LeaseHolder(t) == survivor.Replica {
			handover = time.Since(kill)
			return true
		}
		return false
	})
	time.Sleep(3 * time.Second)
	cancel()
	wg.Wait()
	firstAck := time.Duration(0)
	if f := firstOK.Load(); f != 0 {
		firstAck = time.Duration(f - kill.UnixNano())
	}
	t.Logf("SIGKILL of leader %s: lease taken by %s after %s; first create acknowledged by the survivor %s after the kill; creates acknowledged %d (%d before the kill), sent to the dead replica and retried %d, failed %d",
		leader.Replica, survivor.Replica, handover.Round(time.Millisecond), firstAck.Round(time.Millisecond), acked.Load(), before, retried.Load(), len(failures))
	for _, f := range failures {
		t.Errorf("create failed: %s", f)
	}
	if handover > 3*time.Second {
		t.Errorf("handover took %s, want within lease_ttl × 4/3 plus a renewal (< 3s)", handover)
	}
	if acked.Load() == before {
		t.Errorf("no create acknowledged after the kill")
	}
	// The dead replica comes back (for the cases after this one).
	leader.Start(t)
}

// hostLoss takes a node host away (its daemons SIGKILLed, its link
// gone) and checks that the catalog stops calling its sandboxes running
// within the masters' unhealthy window, while the other nodes' stay.
func hostLoss(t *testing.T, c *cluster.Cluster, apis []*mastertest.Client) {
	victim := c.Nodes[2]
	var ids []string
	t.Cleanup(func() {
		for _, id := range ids {
			kill(t, apis[0], id)
		}
	})
	on := map[string]string{}
	mastertest.WaitFor(t, 60*time.Second, "a sandbox on "+victim.ID+" and one elsewhere", func() bool {
		id, _, err := create(apis[len(ids)%2])
		if err != nil {
			t.Fatalf("create: %v", err)
		}
		ids = append(ids, id)
		for _, sb := range c.Sandboxes(t, "running") {
			on[sb.SandboxId] = sb.NodeId
		}
		var victims, others int
		for _, id := range ids {
			if on[id] == victim.ID {
				victims++
			} else {
				others++
			}
		}
		return victims >= 1 && others >= 1
	})
	lost := time.Now()
	victim.Lose(t)
	states := func() map[string]string {
		out := map[string]string{}
		for _, sb := range c.Sandboxes(t) {
			out[sb.SandboxId] = sb.State
		}
		return out
	}
	var after time.Duration
	mastertest.WaitFor(t, 30*time.Second, "the lost node's sandboxes to leave running", func() bool {
		st := states()
		for _, id := range ids {
			if on[id] == victim.ID && st[id] == "running" {
				return false
			}
		}
		after = time.Since(lost)
		return true
	})
	st := states()
	var report []string
	for _, id := range ids {
		report = append(report, on[id]+"/"+id+"="+st[id])
		if on[id] != victim.ID && st[id] != "running" {
			t.Errorf("sandbox %s on healthy node %s is %q", id, on[id], st[id])
		}
	}
	sort.Strings(report)
	t.Logf("host %s lost: its sandboxes left running %s later; states: %v", victim.ID, after.Round(time.Millisecond), report)
	// The E2B API says so too.
	for _, id := range ids {
		if on[id] != victim.ID {
			continue
		}
		var got struct {
			State string `json:"state"`
		}
		r := apis[1].Do(t, http.MethodGet, "/sandboxes/"+id, nil, &got)
		if r.StatusCode == http.StatusOK && got.State == "running" {
			t.Errorf("E2B GET %s: still running", id)
		}
		t.Logf("E2B GET %s (lost host): %s %s", id, r.Status, got.State)
	}
	// The host comes back (a partition that heals): its registration's
	// reconcile finds the sandboxes still running there.
	back := time.Now()
	victim.Return(t)
	mastertest.WaitFor(t, 30*time.Second, "the returned node's sandboxes to be running again", func() bool {
		st := states()
		for _, id := range ids {
			if on[id] == victim.ID && st[id] != "running" {
				return false
			}
		}
		return true
	})
	t.Logf("host %s back: its sandboxes running again %s after it was plugged in", victim.ID, time.Since(back).Round(time.Millisecond))
}

// webScript answers every connection with a small HTTP response.
const webScript = `cr=$(printf '\r')
while IFS= read -r l; do case "$l" in "$cr"|"") break;; esac; done
printf 'HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 9\r\nConnection: close\r\n\r\nfrom-n3\r\n'`

// wsScript accepts a WebSocket upgrade and then echoes every byte.
const wsScript = `cr=$(printf '\r')
while IFS= read -r l; do case "$l" in "$cr"|"") break;; esac; done
printf 'HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n'
exec cat`

// headerTransport names the sandbox and port the way the SDKs do with
// E2B_SANDBOX_URL.
type headerTransport struct {
	id, port, token string
	rt              http.RoundTripper
}

func (h headerTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set(proxy.HeaderSandboxID, h.id)
	r.Header.Set(proxy.HeaderSandboxPort, h.port)
	if h.token != "" {
		r.Header.Set("X-Access-Token", h.token)
	}
	return h.rt.RoundTrip(r)
}

// onNode creates a sandbox on node n: the other nodes are cordoned for
// the create.
func onNode(t *testing.T, c *cluster.Cluster, api *mastertest.Client, n *cluster.Node, extra string) (id, token string) {
	t.Helper()
	return onNodeFrom(t, c, api, n, cluster.Template, extra)
}

// onNodeFrom is onNode with a template.
func onNodeFrom(t *testing.T, c *cluster.Cluster, api *mastertest.Client, n *cluster.Node, tmpl, extra string) (id, token string) {
	t.Helper()
	ids, tokens := onNodeN(t, c, api, n, tmpl, extra, 1)
	return ids[0], tokens[0]
}

// onNodeN creates count sandboxes on node n (the other nodes cordoned
// for the creates).
func onNodeN(t *testing.T, c *cluster.Cluster, api *mastertest.Client, n *cluster.Node, tmpl, extra string, count int) (ids, tokens []string) {
	t.Helper()
	ctx := context.Background()
	admin := c.AdminOf(t)
	for _, o := range c.Nodes {
		if o != n {
			if _, err := admin.SetNodeSchedulable(ctx, &masterpb.SetNodeSchedulableRequest{NodeId: o.ID, Schedulable: false}); err != nil {
				t.Fatal(err)
			}
		}
	}
	defer func() {
		for _, o := range c.Nodes {
			if _, err := admin.SetNodeSchedulable(ctx, &masterpb.SetNodeSchedulableRequest{NodeId: o.ID, Schedulable: true}); err != nil {
				t.Error(err)
			}
		}
	}()
	// Every replica re-reads the node rows every half heartbeat.
	mastertest.WaitFor(t, 10*time.Second, "every replica to see the cordons", func() bool {
		for _, m := range c.Masters {
			resp, err := m.Admin.ListNodes(ctx, &masterpb.ListNodesRequest{})
			if err != nil {
				return false
			}
			for _, v := range resp.Nodes {
				if (v.Report.NodeId == n.ID) != v.Schedulable {
					return false
				}
			}
		}
		return true
	})
	for range count {
		var out struct {
			SandboxID       string `json:"sandboxID"`
			EnvdAccessToken string `json:"envdAccessToken"`
		}
		r := api.Do(t, http.MethodPost, "/sandboxes", `{"templateID":"`+tmpl+`","timeout":600,"secure":true,"envVars":{"CUBE_E2E":"1"}`+extra+`}`, &out)
		if r.StatusCode/100 != 2 {
			t.Fatalf("create on %s: %s %s", n.ID, r.Status, r.Body)
		}
		ids, tokens = append(ids, out.SandboxID), append(tokens, out.EnvdAccessToken)
	}
	for _, sb := range c.Sandboxes(t) {
		for _, id := range ids {
			if sb.SandboxId == id && sb.NodeId != n.ID {
				t.Fatalf("sandbox %s landed on %s, want %s", id, sb.NodeId, n.ID)
			}
		}
	}
	return ids, tokens
}

// crossHost makes a sandbox on node 3 (auto-pause and auto-resume on)
// and reaches it from other hosts: a web server started through envd on
// proxy p1 and answered through p2 at its port URL; a WebSocket echo
// through p1; a 2 s Connect stream through p2, unbuffered; and, once the
// sandbox is paused through replica m1, a request through p2 that resumes
// it.
func crossHost(t *testing.T, c *cluster.Cluster, apis []*mastertest.Client) {
	n3 := c.Nodes[2]
	id, token := onNode(t, c, apis[1], n3, `,"autoPause":true,"autoResume":{"enabled":true}`)
	t.Cleanup(func() { kill(t, apis[0], id) })
	tlsc := c.ServerTLS()
	p1, p2 := c.Proxies[0], c.Proxies[1]
	envd := func(p *cluster.Proxy) processconnect.ProcessClient {
		hc := &http.Client{Transport: headerTransport{id: id, port: "49983", token: token, rt: &http.Transport{TLSClientConfig: tlsc}}}
		return processconnect.NewProcessClient(hc, p.URL)
	}
	sh := func(script string) *connect.Request[pb.StartRequest] {
		return connect.NewRequest(&pb.StartRequest{Process: &pb.ProcessConfig{Cmd: "/bin/sh", Args: []string{"-c", script}}})
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	s, err := envd(p1).Start(ctx, sh("cat > /tmp/web.sh <<'EOF'\n"+webScript+"\nEOF\ncat > /tmp/ws.sh <<'EOF'\n"+wsScript+
		"\nEOF\nnc -ll -p 8001 -e /bin/sh /tmp/ws.sh & exec nc -ll -p 8000 -e /bin/sh /tmp/web.sh"))
	if err != nil {
		t.Fatalf("start the servers through %s: %v", p1.Host.Name, err)
	}
	if !s.Receive() {
		t.Fatalf("start the servers through %s: %v", p1.Host.Name, s.Err())
	}
	go func() {
		for s.Receive() {
		}
	}()
	defer s.Close()
	plain := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{TLSClientConfig: tlsc}}
	get := func(p *cluster.Proxy) (int, string, error) {
		req, _ := http.NewRequest(http.MethodGet, p.URL+"/", nil)
		req.Host = "8000-" + id + "." + cluster.Domain
		resp, err := plain.Do(req)
		if err != nil {
			return 0, "", err
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b), nil
	}

	t.Run("web", func(t *testing.T) {
		var body string
		var took time.Duration
		mastertest.WaitFor(t, 15*time.Second, "the web server through "+p2.Host.Name, func() bool {
			began := time.Now()
			code, b, err := get(p2)
			body, took = b, time.Since(began)
			return err == nil && code == http.StatusOK
		})
		if strings.TrimSpace(body) != "from-n3" {
			t.Fatalf("body %q", body)
		}
		t.Logf("sandbox %s on %s (%s): web server started through %s (%s), answered through %s (%s) at its port URL in %s",
			id, n3.ID, n3.Host.IP, p1.Host.Name, p1.Host.IP, p2.Host.Name, p2.Host.IP, took.Round(time.Microsecond))
	})

	t.Run("websocket", func(t *testing.T) {
		conn, err := tls.Dial("tcp", strings.TrimPrefix(p1.URL, "https://"), tlsc)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
		fmt.Fprintf(conn, "GET /ws HTTP/1.1\r\nHost: 8001-%s.%s\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"+
			"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n", id, cluster.Domain)
		br := bufio.NewReader(conn)
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatalf("upgrade: %v", err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusSwitchingProtocols {
			t.Fatalf("upgrade: %s", resp.Status)
		}
		for _, msg := range []string{"ping 1\n", "ping 2\n"} {
			began := time.Now()
			if _, err := io.WriteString(conn, msg); err != nil {
				t.Fatal(err)
			}
			line, err := br.ReadString('\n')
			if err != nil || line != msg {
				t.Fatalf("echo: %q %v", line, err)
			}
			t.Logf("WebSocket echo of %q through %s to %s: %s", strings.TrimSpace(msg), p1.Host.Name, n3.Host.Name, time.Since(began).Round(time.Microsecond))
		}
	})

	t.Run("connect-stream", func(t *testing.T) {
		firstAt, endAt := envdtest.Unbuffered(t, envd(p2))
		t.Logf("Connect stream through %s from %s: first event after %s, end after %s", p2.Host.Name, n3.Host.Name, firstAt.Round(time.Millisecond), endAt.Round(time.Millisecond))
	})

	t.Run("auto-resume", func(t *testing.T) {
		if r := apis[0].Do(t, http.MethodPost, "/sandboxes/"+id+"/pause", nil, nil); r.StatusCode/100 != 2 {
			t.Fatalf("pause through %s: %s %s", c.Masters[0].Replica, r.Status, r.Body)
		}
		var info struct {
			State string `json:"state"`
		}
		apis[1].Do(t, http.MethodGet, "/sandboxes/"+id, nil, &info)
		if info.State != "paused" {
			t.Fatalf("after pause: state %q", info.State)
		}
		began := time.Now()
		code, body, err := get(p2)
		if err != nil || code != http.StatusOK || strings.TrimSpace(body) != "from-n3" {
			t.Fatalf("GET through %s of the paused sandbox: %d %q %v", p2.Host.Name, code, body, err)
		}
		took := time.Since(began)
		apis[1].Do(t, http.MethodGet, "/sandboxes/"+id, nil, &info)
		if info.State != "running" {
			t.Errorf("after the request: state %q", info.State)
		}
		t.Logf("paused through %s; a request through %s resumed it on %s and was answered in %s", c.Masters[0].Replica, p2.Host.Name, n3.Host.Name, took.Round(time.Millisecond))
	})
}

// sdkSuites runs the unmodified E2B JS SDK suites (test/e2e/node) against
// the cluster: sdk.test.mjs on a sandbox made through one replica's E2B
// API on node 3, reached through a proxy host; the control-plane suite
// through the other replica.
func sdkSuites(t *testing.T, c *cluster.Cluster, apis []*mastertest.Client, key string) {
	node, dir := nodeSDK(t)
	id, token := onNode(t, c, apis[0], c.Nodes[2], "")
	t.Cleanup(func() { kill(t, apis[0], id) })
	if token == "" {
		t.Fatalf("secure create of %s: no envdAccessToken", id)
	}
	// The tenancy suite's teams and keys.
	teams := teamKeys(t, c)
	run := func(t *testing.T, api int, proxy *cluster.Proxy, sandboxURL string, env []string, files ...string) {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		defer cancel()
		cmd := exec.CommandContext(ctx, node, append([]string{"--test", "--test-concurrency=1", "--test-reporter=spec"}, files...)...)
		cmd.Dir = dir
		cmd.Env = append(os.Environ(), append(env,
			"E2B_API_URL="+apis[api].Base, "E2B_SANDBOX_URL="+sandboxURL, "E2B_API_KEY="+key, "E2B_DOMAIN="+cluster.Domain,
			"NODE_EXTRA_CA_CERTS="+c.CAFile(), "NODE_OPTIONS=--import="+c.NodeResolver(t, proxy))...)
		began := time.Now()
		out, err := cmd.CombinedOutput()
		t.Logf("%v against %s and %s (proxy host %s) in %s:\n%s", files, apis[api].Base, sandboxURL, proxy.Host.IP, time.Since(began).Round(time.Millisecond), out)
		if err != nil {
			t.Fatalf("%v: %v", files, err)
		}
	}
	t.Run("sdk", func(t *testing.T) {
		// The sandbox's envd by name, as E2B's domain scheme has it (the
		// signed URLs the SDK makes carry no header naming the sandbox).
		run(t, 0, c.Proxies[0], fmt.Sprintf("https://49983-%s.%s:%d", id, cluster.Domain, cluster.ProxyPort),
			[]string{"CUBE_SANDBOX_ID=" + id}, "sdk.test.mjs")
	})
	t.Run("controlplane", func(t *testing.T) {
		// Where the suite's sandboxes land, read from the catalog while
		// it runs (it kills them as it goes).
		placed := map[string]string{}
		stop := make(chan struct{})
		watched := make(chan struct{})
		go func() {
			defer close(watched)
			for {
				if resp, err := c.Masters[0].Admin.ListSandboxes(context.Background(), &masterpb.ListSandboxesRequest{}); err == nil {
					for _, sb := range resp.Sandboxes {
						if sb.SandboxId != id && sb.NodeId != "" {
							placed[sb.SandboxId] = sb.NodeId
						}
					}
				}
				select {
				case <-stop:
					return
				case <-time.After(50 * time.Millisecond):
				}
			}
		}()
		defer func() {
			close(stop)
			<-watched
			per := map[string]int{}
			for _, n := range placed {
				per[n]++
			}
			t.Logf("the suite's sandboxes seen in the catalog: %d, per node %v", len(placed), per)
			for _, n := range c.Nodes {
				if per[n.ID] == 0 {
					t.Errorf("no sandbox of the suite on node %s (per node %v)", n.ID, per)
				}
			}
		}()
		run(t, 1, c.Proxies[1], c.Proxies[1].URL, append(teams, "CUBE_E2E_TEMPLATE="+cluster.Template), "controlplane.test.mjs", "tenancy.test.mjs")
	})
}

// nodeSDK returns node and the directory of the E2B JS SDK suites
// (test/e2e/node), installing the pinned SDK there if it is not.
func nodeSDK(t *testing.T) (node, dir string) {
	t.Helper()
	if os.Getenv("CUBE_TEST_NODE") == "0" {
		t.Skip("CUBE_TEST_NODE=0: the Node suites are off (as in hack/test.sh)")
	}
	node = testenv.RequireBinary(t, "node", "nodejs")
	dir = filepath.Join(testbin.Root(), "test", "e2e", "node")
	if _, err := os.Stat(filepath.Join(dir, "node_modules", "e2b")); err != nil {
		// The pinned SDK, as hack/test.sh installs it (which runs the Go
		// tests first).
		npm := testenv.RequireBinary(t, "npm", "npm")
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		defer cancel()
		if out, err := exec.CommandContext(ctx, npm, "ci", "--prefix", dir, "--no-audit", "--no-fund", "--loglevel=error").CombinedOutput(); err != nil {
			testenv.Missing(t, "the E2B SDK is not installed and npm ci --prefix test/e2e/node failed: %v\n%s", err, out)
		}
	}
	return node, dir
}

// teamKeys makes the teams of the tenancy suite (as test/e2e/node/system
// does) and returns their keys as environment entries.
func teamKeys(t *testing.T, c *cluster.Cluster) []string {
	t.Helper()
	ctx := context.Background()
	a := c.AdminOf(t)
	var env []string
	for _, tm := range []struct {
		env, team string
		quota     *masterpb.TeamQuota
	}{
		{"CUBE_E2E_TEAM_A_KEY", "e2e-a", nil},
		{"CUBE_E2E_TEAM_B_KEY", "e2e-b", nil},
		{"CUBE_E2E_QUOTA_KEY", "e2e-quota", &masterpb.TeamQuota{MaxSandboxes: 1}},
	} {
		if _, err := a.CreateTeam(ctx, &masterpb.CreateTeamRequest{Name: tm.team, Quota: tm.quota}); err != nil {
			t.Fatalf("create team %s: %v", tm.team, err)
		}
		k, err := a.CreateAPIKey(ctx, &masterpb.CreateAPIKeyRequest{Name: tm.team + "-key", Team: tm.team})
		if err != nil {
			t.Fatalf("create a key of team %s: %v", tm.team, err)
		}
		env = append(env, tm.env+"="+k.Secret)
	}
	return env
}

// templates imports a template once through one replica (its store) and
// waits for every node to hold it, creates a sandbox from it on each
// node, then adds a fourth node host and waits for it to get the
// template too.
func templates(t *testing.T, c *cluster.Cluster, apis []*mastertest.Client) {
	const id = "dist"
	ctx := context.Background()
	m := c.Masters[0]
	began := time.Now()
	resp, err := m.Admin.ImportTemplate(ctx, &masterpb.ImportTemplateRequest{TemplateId: id, Source: c.Image()})
	if err != nil {
		t.Fatalf("import %s through %s: %v", id, m.Replica, err)
	}
	stored := time.Since(began)
	for _, n := range c.Nodes {
		n.WaitTemplate(t, id, 60*time.Second)
	}
	all := time.Since(began)
	t.Logf("template %s (%s, %d bytes) imported through %s: stored in %s, on all %d nodes after %s",
		id, resp.Template.Digest, resp.Template.SizeBytes, m.Replica, stored.Round(time.Millisecond), len(c.Nodes), all.Round(time.Millisecond))
	for _, n := range c.Nodes {
		sb, _ := onNodeFrom(t, c, apis[1], n, id, "")
		kill(t, apis[0], sb)
	}
	began = time.Now()
	n4 := c.AddNode(t)
	up := time.Since(began)
	n4.WaitTemplate(t, id, 60*time.Second)
	t.Logf("node %s joined later (%s, daemons up in %s): held %s %s after its start", n4.ID, n4.Host.IP, up.Round(time.Millisecond), id, time.Since(began).Round(time.Millisecond))
	sb, _ := onNodeFrom(t, c, apis[0], n4, id, "")
	kill(t, apis[0], sb)
}
