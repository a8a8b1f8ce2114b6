package launcher_test

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
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"

	cubeletpb "github.com/cubesandbox/cube/api/cubelet/v1"
	"github.com/cubesandbox/cube/api/envd/process/processconnect"
	masterpb "github.com/cubesandbox/cube/api/master/v1"
	"github.com/cubesandbox/cube/internal/agentproto"
	"github.com/cubesandbox/cube/internal/cubeletclient"
	"github.com/cubesandbox/cube/internal/cubeproxy"
	"github.com/cubesandbox/cube/internal/envdtest"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/master/mastertest"
	"github.com/cubesandbox/cube/internal/network/nettest"
	"github.com/cubesandbox/cube/internal/nodejoin"
	"github.com/cubesandbox/cube/internal/nodetunnel"
	"github.com/cubesandbox/cube/internal/nsdial"
	"github.com/cubesandbox/cube/internal/pki"
	"github.com/cubesandbox/cube/internal/proxy"
	"github.com/cubesandbox/cube/internal/serve"
	"github.com/cubesandbox/cube/internal/storage"
)

// dpNode is a cubelet and its network-agent run as processes in a network
// namespace of their own (a host of the cluster), with an address on a
// bridge in the test's namespace.
type dpNode struct {
	id, ns, ip, dir string
	socket          string
	logs            *syncBuffer
	client          cubeletpb.CubeletServiceClient
}

// TestNodeDataPlane runs two nodes, each a cubelet with network-agent in
// its own network namespace with its own address on a bridge, both with
// the SAME node_cidr (slot addresses overlap), and the master and a
// standalone cubeproxy in the test's namespace, where no slot address of
// either node is routed. Through the route: a web server in a sandbox on
// each node at once (each answers with its node's name), a WebSocket
// echo, a 2 s Connect stream arriving incrementally, the auto-resume of a
// paused sandbox; and on a node listener: a node's certificate refused,
// the proxy's (the control) served. It logs the cost of the extra hop.
func TestNodeDataPlane(t *testing.T) {
	nettest.RequireRoot(t)
	bin := binaries(t)
	netAgent := nettest.ReleaseBinary(t)
	id := randomHex(3)
	b := []byte(id)
	subnet := fmt.Sprintf("10.%d.%d", 150+int(b[0])%40, b[1])
	brIP := subnet + ".1"
	br := "cdpbr" + id
	run := func(args ...string) {
		t.Helper()
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			t.Fatalf("ip %v: %v\n%s", args, err, out)
		}
	}
	run("link", "add", br, "type", "bridge")
	t.Cleanup(func() { _ = exec.Command("ip", "link", "del", br).Run() })
	run("addr", "add", brIP+"/24", "dev", br)
	run("link", "set", br, "up")

	dir, err := os.MkdirTemp("", "cube-dp-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o711); err != nil {
		t.Fatal(err)
	}
	caDir := filepath.Join(dir, "ca")
	ca, err := pki.LoadOrCreateCA(caDir, "data plane test")
	if err != nil {
		t.Fatal(err)
	}
	pkiDir := filepath.Join(dir, "pki")
	issue := func(base, name string, role pki.Role, hosts ...string) serve.TLSFiles {
		f, err := ca.Issue(pkiDir, base, name, role, hosts...)
		if err != nil {
			t.Fatal(err)
		}
		return f
	}
	client := func(f serve.TLSFiles) *tls.Config {
		tc, err := f.Client("tls")
		if err != nil {
			t.Fatal(err)
		}
		return tc
	}
	masterFiles := issue("master", "cubemaster", pki.RoleMaster, brIP, "127.0.0.1")
	proxyTLS := client(issue("proxy", "proxy-1", pki.RoleProxy))

	masterNode, masterJoin := net.JoinHostPort(brIP, "7101"), net.JoinHostPort(brIP, "7102")
	m := mastertest.StartMaster(t, fmt.Sprintf("[api]\nnode = %q\n[tls]\ncert = %q\nkey = %q\nca = %q\n[join]\nlisten = %q\nca_dir = %q\n",
		masterNode, masterFiles.Cert, masterFiles.Key, masterFiles.CA, masterJoin, caDir))
	// Node 1 gets its certificate from the CA; node 2 joins with a
	// one-time token, as a compute-only node without the CA key does.
	certFor := func(i int, id, ip, tlsDir string) serve.TLSFiles {
		if i == 1 {
			return issue("n1", id, pki.RoleNode, ip)
		}
		tok, err := m.Admin.CreateJoinToken(context.Background(), &masterpb.CreateJoinTokenRequest{})
		if err != nil {
			t.Fatal(err)
		}
		cert, key, caFile, err := nodejoin.Join(context.Background(), masterJoin, tok.Token, id, []string{ip}, tlsDir)
		if err != nil {
			t.Fatalf("%s: join: %v", id, err)
		}
		t.Logf("%s joined with a token: certificate %s", id, cert)
		return serve.TLSFiles{Cert: cert, Key: key, CA: caFile}
	}

	// The same node CIDR on both nodes: their slot addresses overlap.
	nodeCIDR := fmt.Sprintf("10.%d.%d.0/24", 192+int(b[2])%60, b[0])
	var nodes []*dpNode
	for i := 1; i <= 2; i++ {
		n := startDPNode(t, bin, netAgent, dir, id, i, subnet, br, brIP, nodeCIDR, masterNode, certFor)
		nodes = append(nodes, n)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	for _, n := range nodes {
		mastertest.WaitFor(t, 2*time.Minute, "node "+n.id+" healthy with a data listener", func() bool {
			resp, err := m.Admin.ListNodes(ctx, &masterpb.ListNodesRequest{})
			if err != nil {
				return false
			}
			for _, v := range resp.Nodes {
				if v.Report.NodeId == n.id && v.Healthy && v.Report.DataAddress != "" {
					t.Logf("node %s: api %s, data listener %s", n.id, v.Report.Address, v.Report.DataAddress)
					return true
				}
			}
			return false
		})
	}

	conn, err := cubeproxy.DialMaster(m.Socket, "", nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	p, err := cubeproxy.Start(context.Background(), cubeproxy.Config{Listen: "127.0.0.1:0", MetricsListen: "127.0.0.1:0", Domain: "cube.test", ID: "dp-replica", NodeTLS: proxyTLS},
		masterpb.NewRouteServiceClient(conn), mastertest.Log(t).With("component", "cubeproxy"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := p.Stop(); err != nil {
			t.Errorf("stop cubeproxy: %v", err)
		}
	})
	mastertest.WaitFor(t, 10*time.Second, "replica watching", func() bool { return p.Routes.Watching() })
	routeAddr, inproc := p.Addr, m.Server.ProxyAddr

	c := m.API(m.APIKey(t))
	routes := masterpb.NewRouteServiceClient(conn)
	// One sandbox on each node: the other node cordoned while creating.
	type sbox struct {
		SandboxID       string `json:"sandboxID"`
		EnvdAccessToken string `json:"envdAccessToken"`
		node            *dpNode
		hostIP          string
	}
	sbs := make([]*sbox, len(nodes))
	for i, n := range nodes {
		for j, o := range nodes {
			if _, err := m.Admin.SetNodeSchedulable(ctx, &masterpb.SetNodeSchedulableRequest{NodeId: o.id, Schedulable: i == j}); err != nil {
				t.Fatal(err)
			}
		}
		sb := &sbox{node: n}
		if r := c.Do(t, "POST", "/v2/sandboxes", map[string]any{"templateID": "busybox", "timeout": 300, "autoPause": true,
			"autoResume": map[string]any{"enabled": true}}, sb); r.StatusCode != http.StatusCreated {
			t.Fatalf("create on %s: %d %s\n%s", n.id, r.StatusCode, r.Body, n.logs.String())
		}
		t.Cleanup(func() { c.Do(t, "DELETE", "/sandboxes/"+sb.SandboxID, nil, nil) })
		ri, err := routes.ResolveRoute(ctx, &masterpb.ResolveRouteRequest{SandboxId: sb.SandboxID})
		if err != nil {
			t.Fatal(err)
		}
		if ri.NodeId != n.id || ri.NodeDataAddress == "" {
			t.Fatalf("sandbox %s: route %v, want node %s with a data address", sb.SandboxID, ri, n.id)
		}
		sb.hostIP = ri.HostIp
		t.Logf("sandbox %s on %s: slot host IP %s (node-local), node data listener %s", sb.SandboxID, n.id, ri.HostIp, ri.NodeDataAddress)
		sbs[i] = sb
	}
	// The first slot of the same plan on each node: the same address, for
	// two different sandboxes. The route must tell them apart by node.
	if sbs[0].hostIP != sbs[1].hostIP {
		t.Fatalf("slot host IPs %s and %s differ: the nodes' plans do not overlap, the test would not show they may", sbs[0].hostIP, sbs[1].hostIP)
	}
	t.Logf("both sandboxes have slot host IP %s, each on its own node", sbs[0].hostIP)
	// Neither slot address is reachable from here: only the node listener
	// leads to the sandboxes.
	if c, err := net.DialTimeout("tcp", net.JoinHostPort(sbs[0].hostIP, "49983"), time.Second); err == nil {
		c.Close()
		t.Fatalf("slot address %s reachable from the master's namespace: the test would not show the data plane", sbs[0].hostIP)
	}

	web := func(name string) string {
		return "cat > /tmp/web.sh <<'EOF'\ncr=$(printf '\\r')\nwhile IFS= read -r l; do case \"$l\" in \"$cr\"|\"\") break;; esac; done\n" +
			"printf 'HTTP/1.1 200 OK\\r\\nContent-Type: text/plain\\r\\nContent-Length: " + fmt.Sprint(len(name)+1) + "\\r\\nConnection: close\\r\\n\\r\\n" + name + "\\n'\nEOF\n" +
			"cat > /tmp/ws.sh <<'EOF'\ncr=$(printf '\\r')\nwhile IFS= read -r l; do case \"$l\" in \"$cr\"|\"\") break;; esac; done\n" +
			"printf 'HTTP/1.1 101 Switching Protocols\\r\\nUpgrade: websocket\\r\\nConnection: Upgrade\\r\\n\\r\\n'\nexec cat\nEOF\n" +
			"printf 'head -c 67108864 /dev/zero\\n' > /tmp/big.sh\n" +
			"nc -ll -p 8002 -e /bin/sh /tmp/big.sh & nc -ll -p 8001 -e /bin/sh /tmp/ws.sh & exec nc -ll -p 8000 -e /bin/sh /tmp/web.sh"
	}
	for _, sb := range sbs {
		dpServe(t, routeAddr, sb.SandboxID, sb.EnvdAccessToken, web(sb.node.id))
	}

	t.Run("web servers on both nodes through the route at once", func(t *testing.T) {
		for _, addr := range []string{routeAddr, inproc} {
			var wg sync.WaitGroup
			errs := make(chan error, 2*20)
			for _, sb := range sbs {
				for range 20 {
					wg.Add(1)
					go func() {
						defer wg.Done()
						var code int
						var body string
						deadline := time.Now().Add(15 * time.Second)
						for time.Now().Before(deadline) {
							code, body = dpGet(addr, "8000-"+sb.SandboxID+".cube.test", nil)
							if code == 200 {
								break
							}
							time.Sleep(100 * time.Millisecond)
						}
						if code != 200 || body != sb.node.id+"\n" {
							errs <- fmt.Errorf("%s via %s: %d %q, want %s", sb.SandboxID, addr, code, body, sb.node.id)
						}
					}()
				}
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				t.Error(err)
			}
			// The header form too.
			code, body := dpGet(addr, addr, map[string]string{proxy.HeaderSandboxID: sbs[1].SandboxID, proxy.HeaderSandboxPort: "8000"})
			if code != 200 || body != sbs[1].node.id+"\n" {
				t.Fatalf("by headers via %s: %d %q", addr, code, body)
			}
			t.Logf("via %s: 20 concurrent requests to each node's sandbox answered by that node's web server", addr)
		}
	})

	t.Run("WebSocket echo across hosts", func(t *testing.T) {
		conn, err := net.Dial("tcp", routeAddr)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
		fmt.Fprintf(conn, "GET /ws HTTP/1.1\r\nHost: 8001-%s.cube.test\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"+
			"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n", sbs[1].SandboxID)
		br := bufio.NewReader(conn)
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatalf("upgrade: %v", err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusSwitchingProtocols {
			t.Fatalf("upgrade: %v", resp.Status)
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
		t.Logf("WebSocket to %s on %s: upgraded, two messages echoed", sbs[1].SandboxID, sbs[1].node.id)
	})

	t.Run("Connect stream arrives incrementally", func(t *testing.T) {
		firstAt, endAt := envdtest.Unbuffered(t, dpProcess(routeAddr, sbs[0].SandboxID, sbs[0].EnvdAccessToken))
		t.Logf("Connect stream from %s: first event after %s, end after %s", sbs[0].node.id, firstAt, endAt)
	})

	t.Run("h2c end to end across hosts", func(t *testing.T) {
		p := new(http.Protocols)
		p.SetUnencryptedHTTP2(true)
		h2c := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{Protocols: p}}
		req, _ := http.NewRequest(http.MethodGet, "http://"+routeAddr+"/health", nil)
		req.Host = fmt.Sprintf("%d-%s.cube.test", agentproto.Port, sbs[1].SandboxID)
		resp, err := h2c.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.ProtoMajor != 2 || resp.StatusCode != http.StatusNoContent {
			t.Fatalf("h2c: %s %s", resp.Proto, resp.Status)
		}
		// A Connect server stream over h2c, its events as they come.
		pc := processconnect.NewProcessClient(&http.Client{Transport: dpHeadersOver{dpHeaders{sbs[1].SandboxID, sbs[1].EnvdAccessToken}, h2c.Transport}},
			"http://"+routeAddr, connect.WithGRPC())
		start := time.Now()
		st, err := pc.Start(ctx, envdtest.Sh("echo one; sleep 1; echo two"))
		if err != nil {
			t.Fatal(err)
		}
		defer st.Close()
		var firstAt, endAt time.Duration
		for st.Receive() {
			ev := st.Msg().GetEvent()
			if d := ev.GetData(); d != nil && strings.Contains(string(d.GetStdout()), "one") && firstAt == 0 {
				firstAt = time.Since(start)
			}
			if ev.GetEnd() != nil {
				endAt = time.Since(start)
			}
		}
		if st.Err() != nil || firstAt == 0 || firstAt > 800*time.Millisecond || endAt < time.Second {
			t.Fatalf("gRPC stream over h2c: first %s end %s err %v", firstAt, endAt, st.Err())
		}
		t.Logf("h2c: GET /health %s %d; gRPC server stream over h2c: first event after %s, end after %s", resp.Proto, resp.StatusCode, firstAt, endAt)
	})

	t.Run("auto-resume of a paused sandbox on another host", func(t *testing.T) {
		sb := sbs[1]
		if r := c.Do(t, "POST", "/sandboxes/"+sb.SandboxID+"/pause", nil, nil); r.StatusCode != http.StatusNoContent {
			t.Fatalf("pause: %d %s", r.StatusCode, r.Body)
		}
		start := time.Now()
		code, body := dpGet(routeAddr, "8000-"+sb.SandboxID+".cube.test", nil)
		took := time.Since(start)
		if code != 200 || body != sb.node.id+"\n" {
			t.Fatalf("after auto-resume: %d %q", code, body)
		}
		var d struct {
			State string `json:"state"`
		}
		c.Do(t, "GET", "/sandboxes/"+sb.SandboxID, nil, &d)
		if d.State != "running" {
			t.Fatalf("state %s", d.State)
		}
		t.Logf("paused sandbox on %s resumed by the first request through the route: answered in %s", sb.node.id, took)
	})

	t.Run("node listener admits proxy and master certificates only", func(t *testing.T) {
		sb := sbs[0]
		ri, err := routes.ResolveRoute(ctx, &masterpb.ResolveRouteRequest{SandboxId: sb.SandboxID})
		if err != nil {
			t.Fatal(err)
		}
		health := func(tc *tls.Config) (string, error) {
			conn, err := (&nodetunnel.Dialer{TLS: tc}).Dial(ctx, ri.NodeDataAddress, sb.node.id, sb.SandboxID, agentproto.Port)
			if err != nil {
				return "", err
			}
			defer conn.Close()
			_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
			fmt.Fprint(conn, "GET /health HTTP/1.1\r\nHost: sandbox\r\nConnection: close\r\n\r\n")
			line, err := bufio.NewReader(conn).ReadString('\n')
			return strings.TrimSpace(line), err
		}
		// Another node's certificate (n2 calling n1), signed by the same CA.
		other := client(serve.TLSFiles{Cert: filepath.Join(nodes[1].dir, "tls", "node.crt"), Key: filepath.Join(nodes[1].dir, "tls", "node.key"), CA: masterFiles.CA})
		got, err := health(other)
		if !errdefs.IsPermissionDenied(err) {
			t.Fatalf("%s's certificate on %s's listener: %q %v, want PermissionDenied", nodes[1].id, sb.node.id, got, err)
		}
		t.Logf("%s's certificate on %s's listener: %v", nodes[1].id, sb.node.id, err)
		for name, tc := range map[string]*tls.Config{"proxy": proxyTLS, "master": client(masterFiles)} {
			got, err := health(tc)
			if err != nil || !strings.HasPrefix(got, "HTTP/1.1 204") {
				t.Fatalf("control, %s certificate: %q %v", name, got, err)
			}
			t.Logf("control, %s certificate: the agent of %s answered %q", name, sb.SandboxID, got)
		}
	})

	t.Run("create latency across hosts", func(t *testing.T) {
		// The master's calls to a new sandbox's agent (its info, /init
		// with the environment) go through the node listener: one new
		// tunnel each.
		for _, o := range nodes {
			if _, err := m.Admin.SetNodeSchedulable(ctx, &masterpb.SetNodeSchedulableRequest{NodeId: o.id, Schedulable: o == nodes[0]}); err != nil {
				t.Fatal(err)
			}
		}
		var ds []time.Duration
		for range 8 {
			var sb struct {
				SandboxID string `json:"sandboxID"`
			}
			start := time.Now()
			if r := c.Do(t, "POST", "/v2/sandboxes", map[string]any{"templateID": "busybox", "timeout": 60, "envVars": map[string]string{"A": "1"}}, &sb); r.StatusCode != http.StatusCreated {
				t.Fatalf("create: %d %s", r.StatusCode, r.Body)
			}
			ds = append(ds, time.Since(start))
			c.Do(t, "DELETE", "/sandboxes/"+sb.SandboxID, nil, nil)
		}
		slices.Sort(ds)
		t.Logf("LATENCY create on %s through the E2B API (agent calls through the node listener), median of 8: %s (min %s, max %s)",
			nodes[0].id, ds[len(ds)/2], ds[0], ds[len(ds)-1])
	})

	t.Run("cost of the extra hop", func(t *testing.T) {
		sb := sbs[0]
		ri, err := routes.ResolveRoute(ctx, &masterpb.ResolveRouteRequest{SandboxId: sb.SandboxID})
		if err != nil {
			t.Fatal(err)
		}
		nsPath := "/run/netns/" + sb.node.ns
		direct := func(ctx context.Context, _, _ string) (net.Conn, error) {
			// What a route on the node's own host would do: the slot address.
			return nsdial.DialContext(ctx, nsPath, "tcp", net.JoinHostPort(ri.HostIp, "49983"))
		}
		tunnel := func(ctx context.Context, _, _ string) (net.Conn, error) {
			return (&nodetunnel.Dialer{TLS: proxyTLS}).Dial(ctx, ri.NodeDataAddress, sb.node.id, sb.SandboxID, agentproto.Port)
		}
		median := func(dial func(context.Context, string, string) (net.Conn, error), keepAlive bool) time.Duration {
			tr := &http.Transport{DialContext: dial, DisableKeepAlives: !keepAlive}
			defer tr.CloseIdleConnections()
			hc := &http.Client{Transport: tr, Timeout: 10 * time.Second}
			ds := make([]time.Duration, 0, 300)
			for range 300 {
				s := time.Now()
				resp, err := hc.Get("http://sandbox/health")
				if err != nil {
					t.Fatal(err)
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode != http.StatusNoContent {
					t.Fatalf("health: %d", resp.StatusCode)
				}
				ds = append(ds, time.Since(s))
			}
			slices.Sort(ds)
			return ds[len(ds)/2]
		}
		dn, tn := median(direct, false), median(tunnel, false)
		dk, tk := median(direct, true), median(tunnel, true)
		t.Logf("LATENCY node hop, median of 300 GET /health: new connection each: direct (slot address in the node's namespace) %s, "+
			"through the node listener (TLS 1.3 + CONNECT) %s, added %s; one kept-alive connection: direct %s, node listener %s, added %s",
			dn, tn, tn-dn, dk, tk, tk-dk)

		// Throughput: 64 MiB from a server in the sandbox, read to the end.
		pull := func(dial func(context.Context) (net.Conn, error)) time.Duration {
			best := time.Duration(1 << 62)
			for range 3 {
				start := time.Now()
				conn, err := dial(ctx)
				if err != nil {
					t.Fatal(err)
				}
				n, err := io.Copy(io.Discard, conn)
				conn.Close()
				if err != nil || n != 64<<20 {
					t.Fatalf("pulled %d bytes: %v", n, err)
				}
				best = min(best, time.Since(start))
			}
			return best
		}
		dt := pull(func(ctx context.Context) (net.Conn, error) {
			return nsdial.DialContext(ctx, nsPath, "tcp", net.JoinHostPort(ri.HostIp, "8002"))
		})
		tt := pull(func(ctx context.Context) (net.Conn, error) {
			return (&nodetunnel.Dialer{TLS: proxyTLS}).Dial(ctx, ri.NodeDataAddress, sb.node.id, sb.SandboxID, 8002)
		})
		mibs := func(d time.Duration) float64 { return 64 / d.Seconds() }
		t.Logf("THROUGHPUT node hop, 64 MiB from the sandbox, best of 3: direct %s (%.0f MiB/s), through the node listener %s (%.0f MiB/s)",
			dt, mibs(dt), tt, mibs(tt))
	})
}

func startDPNode(t *testing.T, bin, netAgent, dir, id string, i int, subnet, br, brIP, nodeCIDR, masterNode string,
	certFor func(i int, id, ip, tlsDir string) serve.TLSFiles) *dpNode {
	t.Helper()
	n := &dpNode{id: fmt.Sprintf("dp%s-n%d", id, i), ns: fmt.Sprintf("cube-dp-%s-%d", id, i), ip: fmt.Sprintf("%s.%d", subnet, 10+i),
		dir: filepath.Join(dir, fmt.Sprintf("n%d", i)), logs: &syncBuffer{}}
	host := fmt.Sprintf("cdp%s%d", id, i)
	for _, args := range [][]string{
		{"netns", "add", n.ns},
		{"-n", n.ns, "link", "set", "lo", "up"},
		{"link", "add", host, "type", "veth", "peer", "name", "eth0", "netns", n.ns},
		{"link", "set", host, "master", br},
		{"link", "set", host, "up"},
		{"-n", n.ns, "addr", "add", n.ip + "/24", "dev", "eth0"},
		{"-n", n.ns, "link", "set", "eth0", "up"},
		{"-n", n.ns, "route", "add", "default", "via", brIP},
	} {
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			t.Fatalf("ip %v: %v\n%s", args, err, out)
		}
		if args[0] == "netns" {
			t.Cleanup(func() { _ = exec.Command("ip", "netns", "del", n.ns).Run() })
		}
		if args[0] == "link" && args[1] == "add" {
			t.Cleanup(func() { _ = exec.Command("ip", "link", "del", host).Run() })
		}
	}
	if err := os.MkdirAll(n.dir, 0o711); err != nil {
		t.Fatal(err)
	}
	// The node keeps its own copy, as a separate host would.
	tlsDir := filepath.Join(n.dir, "tls")
	nodeFiles := certFor(i, n.id, n.ip, tlsDir)
	if err := os.MkdirAll(tlsDir, 0o700); err != nil {
		t.Fatal(err)
	}
	for src, dst := range map[string]string{nodeFiles.Cert: "node.crt", nodeFiles.Key: "node.key", nodeFiles.CA: "ca.crt"} {
		if filepath.Join(tlsDir, dst) == src {
			continue
		}
		data, err := os.ReadFile(src)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(tlsDir, dst), data, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	run := filepath.Join(n.dir, "run")
	netSock := filepath.Join(run, "network-agent.sock")
	netCfg := filepath.Join(n.dir, "network-agent.toml")
	if err := os.WriteFile(netCfg, []byte(fmt.Sprintf("run_dir = %q\ndata_dir = %q\nnode_cidr = %q\nprefix = %q\n[api]\nsocket = %q\nhttp = \"\"\n[pool]\nsize = 0\nvm_size = 0\n[dns]\nupstreams = [%q]\n",
		filepath.Join(run, "network"), filepath.Join(n.dir, "network"), nodeCIDR, fmt.Sprintf("dp%s%d", id[:4], i), netSock, nettest.OfflineDNS)), 0o600); err != nil {
		t.Fatal(err)
	}
	n.socket = filepath.Join(run, "cubelet.sock")
	cgroup := "cube-test-dp" + id + fmt.Sprint(i)
	cubeletCfg := filepath.Join(n.dir, "cubelet.toml")
	if err := os.WriteFile(cubeletCfg, []byte(fmt.Sprintf(`[node]
id = %q
data_dir = %q
run_dir = %q
cgroup_parent = %q
[api]
socket = %q
tcp = %q
metrics = ""
data = %q
[tls]
cert = %q
key = %q
ca = %q
[master]
addr = %q
heartbeat_interval = "200ms"
[network]
agent_socket = %q
[storage]
pool_image_size_mib = 4096
template_headroom_mib = 32
agent_binary = %q
[gc]
interval = "200ms"
`, n.id, filepath.Join(n.dir, "data"), run, cgroup, n.socket, net.JoinHostPort(n.ip, "7201"), net.JoinHostPort(n.ip, "7202"),
		filepath.Join(tlsDir, "node.crt"), filepath.Join(tlsDir, "node.key"), filepath.Join(tlsDir, "ca.crt"),
		masterNode, netSock, filepath.Join(bin, "cube-agent"))), 0o600); err != nil {
		t.Fatal(err)
	}
	// Only the network namespace is the node's: nsenter leaves the mount
	// namespace (and so /sys/fs/cgroup) as it is, which `ip netns exec`
	// would not.
	start := func(name string, args ...string) {
		cmd := exec.Command("nsenter", append([]string{"--net=/run/netns/" + n.ns, "--"}, args...)...)
		cmd.Stdout, cmd.Stderr = n.logs, &prefixed{w: n.logs, p: "[" + n.id + " " + name + "] "}
		cmd.Stdout = cmd.Stderr
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		done := make(chan struct{})
		go func() { _ = cmd.Wait(); close(done) }()
		t.Cleanup(func() {
			_ = cmd.Process.Signal(syscall.SIGTERM)
			select {
			case <-done:
			case <-time.After(30 * time.Second):
				_ = cmd.Process.Kill()
				<-done
			}
		})
	}
	// Cleanups run last first: cubelet stops, then network-agent, then
	// its slots are purged, the pool torn down and the cgroups removed.
	t.Cleanup(func() {
		if out, err := exec.Command("nsenter", "--net=/run/netns/"+n.ns, "--", netAgent, "--config", netCfg, "--purge").CombinedOutput(); err != nil {
			t.Errorf("network-agent --purge: %v\n%s", err, out)
		}
		if p, err := storage.OpenPool(context.Background(), storage.PoolConfig{Dir: filepath.Join(n.dir, "data", "pool"), ImageSizeBytes: 1 << 30}); err == nil {
			_ = p.Teardown(context.Background())
		}
		dirs, _ := filepath.Glob("/sys/fs/cgroup/*/" + cgroup)
		if d := "/sys/fs/cgroup/" + cgroup; dirExists(d) {
			dirs = append(dirs, d)
		}
		for _, d := range dirs {
			_ = os.Remove(d)
		}
		if t.Failed() {
			t.Logf("%s logs:\n%s", n.id, n.logs.String())
		}
	})
	start("network-agent", netAgent, "--config", netCfg)
	mastertest.WaitFor(t, time.Minute, n.id+" network-agent socket", func() bool { return serve.Accepting(netSock) })
	start("cubelet", filepath.Join(bin, "cubelet"), "--config", cubeletCfg)
	mastertest.WaitFor(t, 2*time.Minute, n.id+" cubelet socket", func() bool { return serve.Accepting(n.socket) })
	conn, err := cubeletclient.Dial(n.socket)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	n.client = cubeletclient.New(conn)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	stream, err := n.client.ImportTemplate(ctx, &cubeletpb.ImportTemplateRequest{TemplateId: "busybox", Source: busyboxLayout(t)})
	if err != nil {
		t.Fatal(err)
	}
	for {
		if _, err := stream.Recv(); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatalf("%s: import busybox: %v\n%s", n.id, err, n.logs.String())
		}
	}
	return n
}

type prefixed struct {
	w *syncBuffer
	p string
}

func (p *prefixed) Write(b []byte) (int, error) {
	for _, l := range strings.SplitAfter(string(b), "\n") {
		if l != "" {
			_, _ = p.w.Write([]byte(p.p + l))
		}
	}
	return len(b), nil
}

type dpHeaders struct{ id, token string }

func (h dpHeaders) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set(proxy.HeaderSandboxID, h.id)
	r.Header.Set(proxy.HeaderSandboxPort, fmt.Sprint(agentproto.Port))
	r.Header.Set("X-Access-Token", h.token)
	return http.DefaultTransport.RoundTrip(r)
}

// dpHeadersOver is dpHeaders over another transport (h2c).
type dpHeadersOver struct {
	h  dpHeaders
	rt http.RoundTripper
}

func (h dpHeadersOver) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set(proxy.HeaderSandboxID, h.h.id)
	r.Header.Set(proxy.HeaderSandboxPort, fmt.Sprint(agentproto.Port))
	r.Header.Set("X-Access-Token", h.h.token)
	return h.rt.RoundTrip(r)
}

func dpProcess(addr, id, token string) processconnect.ProcessClient {
	return processconnect.NewProcessClient(&http.Client{Transport: dpHeaders{id, token}}, "http://"+addr)
}

// dpServe starts a long-running command in a sandbox through the route
// and keeps its stream open until the test ends.
func dpServe(t *testing.T, addr, id, token, script string) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	s, err := dpProcess(addr, id, token).Start(ctx, envdtest.Sh(script))
	if err != nil {
		cancel()
		t.Fatalf("start server in %s: %v", id, err)
	}
	if !s.Receive() {
		cancel()
		t.Fatalf("start server in %s: %v", id, s.Err())
	}
	go func() {
		for s.Receive() {
		}
	}()
	t.Cleanup(func() { cancel(); s.Close() })
}

func dpGet(addr, host string, hdr map[string]string) (int, string) {
	req, _ := http.NewRequest("GET", "http://"+addr+"/", nil)
	req.Host = host
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	resp, err := (&http.Client{Timeout: 30 * time.Second}).Do(req)
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}
