package launcher_test

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"sort"
	"strings"
	"syscall"
	"testing"
	"text/tabwriter"
	"time"

	"github.com/miekg/dns"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/dynamicpb"

	cubeletpb "github.com/cubesandbox/cube/api/cubelet/v1"
	_ "github.com/cubesandbox/cube/api/envd/filesystem"
	_ "github.com/cubesandbox/cube/api/envd/process"
	masterpb "github.com/cubesandbox/cube/api/master/v1"
	networkpb "github.com/cubesandbox/cube/api/network/v1"
	"github.com/cubesandbox/cube/internal/agentproto"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/launcher"
	"github.com/cubesandbox/cube/internal/leakcheck"
	"github.com/cubesandbox/cube/internal/master/e2bapi"
	"github.com/cubesandbox/cube/internal/master/mastertest"
	"github.com/cubesandbox/cube/internal/network/netnsdir"
	"github.com/cubesandbox/cube/internal/network/nettest"
	"github.com/cubesandbox/cube/internal/nodejoin"
	"github.com/cubesandbox/cube/internal/nodetunnel"
	"github.com/cubesandbox/cube/internal/pki"
	"github.com/cubesandbox/cube/internal/serve"
	"github.com/cubesandbox/cube/internal/storage"
	"github.com/cubesandbox/cube/internal/testimage"
)

// matrixRow is one probe: a call on a listener with a credential, what
// came back, and whether that is what the design says.
type matrixRow struct {
	listener, call, cred, want, got string
	ok                              bool
}

type matrix struct {
	t    *testing.T
	rows []matrixRow
}

func (m *matrix) add(listener, call, cred, want, got string, ok bool) {
	m.rows = append(m.rows, matrixRow{listener, call, cred, want, got, ok})
	if !ok {
		m.t.Errorf("%s %s with %s: %s, want %s", listener, call, cred, got, want)
	}
}

// print logs the table: listener × call × credential → result.
func (m *matrix) print() {
	var b bytes.Buffer
	w := tabwriter.NewWriter(&b, 2, 4, 2, ' ', 0)
	fmt.Fprintln(w, "LISTENER\tCALL\tCREDENTIAL\tWANT\tGOT\t")
	for _, r := range m.rows {
		v := "ok"
		if !r.ok {
			v = "FAIL"
		}
		got := r.got
		if len(got) > 90 {
			got = got[:90] + "…"
		}
		fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\t%s\n", r.listener, r.call, r.cred, r.want, got, v)
	}
	w.Flush()
	m.t.Logf("listener matrix (%d probes):\n%s", len(m.rows), b.String())
}

// TestListenerMatrix runs `cube up` (with network-agent, every TCP
// listener enabled and an admin token) and, for every socket its daemons
// listen on (read from the kernel, an unknown one fails), calls every
// route or RPC of that listener with no credential, a wrong one and,
// where tenancy applies, another team's, and asserts the refusal the
// design gives; a control call with the right credential gets past the
// check (so a refusal cannot be for another reason). The routes of the
// E2B API come from its route table and the RPCs from the services'
// descriptors, so a new one is probed without a change here.
func TestListenerMatrix(t *testing.T) {
	nettest.RequireRoot(t)
	bin := binaries(t)
	if err := copyFile(nettest.ReleaseBinary(t), filepath.Join(bin, "network-agent")); err != nil {
		t.Fatal(err)
	}
	root, err := os.MkdirTemp("", "cube-matrix-")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(root, 0o711); err != nil {
		t.Fatal(err)
	}
	id := randomHex(4)
	nodeAPI, cubeletTCP, cubeletMetrics, proxyMetrics, netHTTP := freePort(t), freePort(t), freePort(t), freePort(t), freePort(t)
	cubeletData, joinAddr := freePort(t), freePort(t)
	adminToken := randomHex(16)
	netPrefix := "lm" + id[:6]
	out := &syncBuffer{}
	cfg := launcher.Config{
		StateDir: filepath.Join(root, "state"), RunDir: filepath.Join(root, "run"), LogDir: filepath.Join(root, "log"),
		BinDir: bin, APIAddr: freePort(t), ProxyAddr: freePort(t), Template: "busybox", TemplateSource: busyboxLayout(t),
		ExtraMasterTOML: fmt.Sprintf("[api]\nnode = %q\nadmin_token = %q\n[proxy]\nmetrics = %q\n[nodes]\nheartbeat_interval = \"200ms\"\n[join]\nlisten = %q\nca_dir = %q\n",
			nodeAPI, adminToken, proxyMetrics, joinAddr, filepath.Join(root, "state", "pki")),
		ExtraCubeletTOML: fmt.Sprintf("[node]\nid = \"lm-%[1]s\"\ncgroup_parent = \"cube-test-%[1]s\"\n[api]\ntcp = %[2]q\nmetrics = %[3]q\ndata = %[4]q\n"+
			"[storage]\npool_image_size_mib = 4096\ntemplate_headroom_mib = 32\n[gc]\ninterval = \"200ms\"\n", id, cubeletTCP, cubeletMetrics, cubeletData),
		ExtraNetworkTOML: fmt.Sprintf("%s[api]\nhttp = %q\n", networkTOML(netPrefix), netHTTP),
		Out:              out, Log: mastertest.Log(t),
	}
	scope := leakcheck.Scope{
		DataDir: cfg.StateDir, RunDir: cfg.RunDir, RuncRoot: filepath.Join(cfg.RunDir, "runc"), CgroupName: "cube-test-" + id,
		AllowMounts: []string{filepath.Join(cfg.StateDir, "pool")}, AllowLoopBacking: []string{filepath.Join(cfg.StateDir, "pool.img")},
		NetPrefix: netPrefix, NetnsDir: filepath.Join(cfg.RunDir, "network", "netns"),
	}
	t.Cleanup(func() {
		if p, err := storage.OpenPool(context.Background(), storage.PoolConfig{Dir: filepath.Join(cfg.StateDir, "pool"), ImageSizeBytes: 1 << 30}); err == nil {
			_ = p.Teardown(context.Background())
		}
		os.RemoveAll(root)
	})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- launcher.Up(ctx, cfg) }()
	stopped := false
	stop := func() {
		if stopped {
			return
		}
		stopped = true
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("cube up: %v", err)
			}
		case <-time.After(time.Minute):
			t.Error("cube up did not stop")
		}
	}
	t.Cleanup(stop)
	mastertest.WaitFor(t, 4*time.Minute, "cube up", func() bool {
		select {
		case err := <-done:
			t.Fatalf("cube up returned early: %v\n%s", err, out.String())
		default:
		}
		return strings.Contains(out.String(), "cube is up")
	})

	// Teams A and B, a key each, made over the root-only admin socket.
	adminConn, err := grpc.NewClient("unix://"+filepath.Join(cfg.RunDir, "cubemaster.sock"), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer adminConn.Close()
	admin := masterpb.NewAdminServiceClient(adminConn)
	keys := map[string]string{}
	for _, team := range []string{"team-a", "team-b"} {
		if _, err := admin.CreateTeam(ctx, &masterpb.CreateTeamRequest{Name: team}); err != nil {
			t.Fatal(err)
		}
		k, err := admin.CreateAPIKey(ctx, &masterpb.CreateAPIKeyRequest{Name: team + "-key", Team: team})
		if err != nil {
			t.Fatal(err)
		}
		keys[team] = k.Secret
	}
	// A secure sandbox with private traffic for each team: team A's is
	// the target, team B's tokens are "another team's credential" at the
	// route.
	type sandbox struct {
		SandboxID          string
		EnvdAccessToken    string
		TrafficAccessToken *string
	}
	hc := &http.Client{Timeout: time.Minute}
	sbs := map[string]sandbox{}
	for team, key := range keys {
		api := &mastertest.Client{Base: "http://" + cfg.APIAddr, Key: key, HC: hc}
		var sb sandbox
		r := api.Do(t, "POST", "/v2/sandboxes", map[string]any{"templateID": "base", "secure": true, "network": map[string]any{"allowPublicTraffic": false}}, &sb)
		if r.StatusCode != 201 || sb.EnvdAccessToken == "" || sb.TrafficAccessToken == nil || *sb.TrafficAccessToken == "" {
			t.Fatalf("create for %s: %d %s", team, r.StatusCode, r.Body)
		}
		sbs[team] = sb
	}
	// Cleanups run last first: kill the sandboxes, stop, purge
	// network-agent's slots and rules (cube up leaves them for the next
	// start, as it leaves sandboxes), check nothing leaked.
	t.Cleanup(func() {
		stop()
		out, err := exec.Command(filepath.Join(bin, "network-agent"), "--config",
			filepath.Join(cfg.StateDir, "launcher", "network-agent.toml"), "--purge").CombinedOutput()
		if err != nil {
			t.Errorf("network-agent --purge: %v\n%s", err, out)
		}
		leakcheck.AssertNone(t, context.Background(), scope)
		// cubelet leaves its (empty) cgroup parent in each hierarchy.
		dirs, _ := filepath.Glob("/sys/fs/cgroup/*/" + scope.CgroupName)
		if d := "/sys/fs/cgroup/" + scope.CgroupName; dirExists(d) {
			dirs = append(dirs, d)
		}
		for _, d := range dirs {
			_ = os.Remove(d)
		}
	})
	t.Cleanup(func() {
		for _, key := range keys {
			api := &mastertest.Client{Base: "http://" + cfg.APIAddr, Key: key, HC: hc}
			var list []struct{ SandboxID string }
			api.Do(t, "GET", "/v2/sandboxes", nil, &list)
			for _, s := range list {
				api.Do(t, "DELETE", "/sandboxes/"+s.SandboxID, nil, nil)
			}
			var snaps []struct{ SnapshotID string }
			api.Do(t, "GET", "/snapshots", nil, &snaps)
			for _, s := range snaps {
				api.Do(t, "DELETE", "/templates/"+s.SnapshotID, nil, nil)
			}
		}
	})

	pkiDir := filepath.Join(cfg.StateDir, "pki")
	certs := map[string]*tls.Config{}
	for _, c := range []string{"admin", "master", "node"} {
		tc, err := (serve.TLSFiles{Cert: filepath.Join(pkiDir, c+".crt"), Key: filepath.Join(pkiDir, c+".key"), CA: filepath.Join(pkiDir, "ca.crt")}).Client("tls")
		if err != nil {
			t.Fatal(err)
		}
		certs[c] = tc
	}
	// Certificates cube up does not issue, from its CA (the test reads
	// its key): a proxy's and another node's.
	clusterCA, err := pki.LoadOrCreateCA(pkiDir, "")
	if err != nil {
		t.Fatal(err)
	}
	extra := t.TempDir()
	for _, c := range []struct {
		base, name string
		role       pki.Role
	}{{"proxy", "proxy-1", pki.RoleProxy}, {"other-node", "other-node", pki.RoleNode}} {
		f, err := clusterCA.Issue(extra, c.base, c.name, c.role)
		if err != nil {
			t.Fatal(err)
		}
		if certs[c.base], err = f.Client("tls"); err != nil {
			t.Fatal(err)
		}
	}
	// A certificate from another CA, of the admin role: self-made, not
	// the cluster's.
	rogueCA, err := pki.NewCA("rogue CA")
	if err != nil {
		t.Fatal(err)
	}
	rogueFiles, err := rogueCA.Issue(t.TempDir(), "admin", "admin", pki.RoleAdmin)
	if err != nil {
		t.Fatal(err)
	}
	rogue, err := rogueFiles.Client("tls")
	if err != nil {
		t.Fatal(err)
	}
	rogue.RootCAs = certs["admin"].RootCAs // it trusts the cluster: only its own certificate is wrong
	// Present it whatever CAs the server asks for (Go's client would
	// otherwise send none, and the probe would be "no certificate").
	rogueCert := rogue.Certificates[0]
	rogue.Certificates = nil
	rogue.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return &rogueCert, nil }
	noCert := certs["admin"].Clone()
	noCert.Certificates = nil
	nodeID := "lm-" + id

	m := &matrix{t: t}
	defer m.print()

	// Which listener is which: every one the daemons hold must be here.
	type spec struct {
		daemon string
		probe  func(name string)
	}
	specs := map[string]spec{
		"tcp " + cfg.APIAddr: {"cubemaster", func(n string) {
			e2bMatrix(t, m, n, "http://"+cfg.APIAddr, keys["team-a"], keys["team-b"], sbs["team-a"].SandboxID)
		}},
		"tcp " + cfg.ProxyAddr: {"cubemaster", func(n string) {
			routeMatrix(m, n, "http://"+cfg.ProxyAddr, sbs["team-a"].SandboxID, sbs["team-a"].EnvdAccessToken, *sbs["team-a"].TrafficAccessToken,
				sbs["team-b"].EnvdAccessToken, *sbs["team-b"].TrafficAccessToken)
		}},
		"tcp " + proxyMetrics: {"cubemaster", func(n string) {
			openHTTP(m, n, "http://"+proxyMetrics, []string{"/metrics", "/health"}, "loopback only, no credential by design (proxy.metrics)")
		}},
		"tcp " + nodeAPI: {"cubemaster", func(n string) {
			grpcMatrix(t, m, n, nodeAPI, certs, rogue, noCert, nodeID, adminToken)
		}},
		"unix " + filepath.Join(cfg.RunDir, "cubemaster.sock"): {"cubemaster", func(n string) {
			unixMatrix(t, m, n, filepath.Join(cfg.RunDir, "cubemaster.sock"), func(c *grpc.ClientConn) error {
				_, err := masterpb.NewAdminServiceClient(c).ListNodes(ctx, &masterpb.ListNodesRequest{})
				return err
			})
		}},
		"tcp " + cubeletTCP: {"cubelet", func(n string) {
			grpcMatrix(t, m, n, cubeletTCP, certs, rogue, noCert, nodeID, "")
		}},
		"tcp " + joinAddr: {"cubemaster", func(n string) {
			joinMatrix(t, m, n, joinAddr, clusterCA, admin)
		}},
		"tcp " + cubeletData: {"cubelet", func(n string) {
			dataMatrix(m, n, cubeletData, nodeID, sbs["team-a"].SandboxID, certs, rogue, noCert)
		}},
		"tcp " + cubeletMetrics: {"cubelet", func(n string) {
			mtlsHTTP(m, n, "https://"+cubeletMetrics, []string{"/metrics", "/healthz"}, certs, rogue, noCert)
		}},
		"unix " + filepath.Join(cfg.RunDir, "cubelet.sock"): {"cubelet", func(n string) {
			unixMatrix(t, m, n, filepath.Join(cfg.RunDir, "cubelet.sock"), func(c *grpc.ClientConn) error {
				_, err := cubeletpb.NewCubeletServiceClient(c).Health(ctx, &cubeletpb.HealthRequest{})
				return err
			})
		}},
		"tcp " + netHTTP: {"network-agent", func(n string) {
			openHTTP(m, n, "http://"+netHTTP, []string{"/healthz", "/readyz", "/metrics"}, "loopback only, no credential by design (api.http without [tls])")
		}},
		// The DNS forwarder, inside every assigned slot's namespace (the
		// inventory names them "... (slot)"): for that slot's sandbox only.
		"tcp " + slotResolver + " (slot)": {"network-agent", func(n string) { dnsMatrix(m, n, "tcp") }},
		"udp " + slotResolver + " (slot)": {"network-agent", func(n string) { dnsMatrix(m, n, "udp") }},
		// The egress proxy, inside every assigned slot's namespace: only
		// connections the slot redirects reach it (TestEgressProxy in
		// internal/network/agent has the redirected control).
		"tcp " + slotProxy + " (slot)": {"network-agent", func(n string) { egressMatrix(m, n) }},
		"unix " + filepath.Join(cfg.RunDir, "network-agent.sock"): {"network-agent", func(n string) {
			unixMatrix(t, m, n, filepath.Join(cfg.RunDir, "network-agent.sock"), func(c *grpc.ClientConn) error {
				_, err := networkpb.NewNetworkAgentClient(c).Health(ctx, &networkpb.HealthRequest{})
				return err
			})
		}},
	}
	// The agent of team A's sandbox at its slot address, from the host:
	// not a socket of the host's network namespace, so not in the
	// inventory below.
	route, err := masterpb.NewRouteServiceClient(adminConn).ResolveRoute(ctx, &masterpb.ResolveRouteRequest{SandboxId: sbs["team-a"].SandboxID})
	if err != nil || route.HostIp == "" {
		t.Fatalf("resolve team A's sandbox: %v, %v", route, err)
	}
	agentMatrix(t, m, "cube-agent (sandbox A) "+net.JoinHostPort(route.HostIp, "49983"), "http://"+net.JoinHostPort(route.HostIp, "49983"),
		sbs["team-a"].EnvdAccessToken, sbs["team-b"].EnvdAccessToken)

	found := inventory(t, len(specs))
	seen := map[string]bool{}
	// The E2B API last: its controls kill team A's sandbox, which the
	// route's probes need.
	last := "tcp " + cfg.APIAddr
	sort.Slice(found, func(i, j int) bool {
		if (found[i].addr == last) != (found[j].addr == last) {
			return found[j].addr == last
		}
		return found[i].name+found[i].addr < found[j].name+found[j].addr
	})
	for _, l := range found {
		key, pin, inSlot := strings.Cut(l.addr, " in ")
		if inSlot {
			key += " (slot)"
		}
		s, ok := specs[key]
		if !ok || s.daemon != l.name {
			m.add(l.name+" "+l.addr, "(listen)", "-", "a listener the matrix knows", "unknown listener", false)
			continue
		}
		seen[key] = true
		kind, addr, _ := strings.Cut(l.addr, " ")
		name := l.name + " " + addr
		switch {
		case inSlot:
			// Only in a slot's own namespace, where only its sandbox
			// reaches it; the probe takes the namespace from the name.
			m.add(name, "(listen)", "-", "a slot namespace", pin, fileExists(pin))
		case kind == "tcp" || kind == "udp":
			ap, err := netAddrPort(addr)
			m.add(name, "(listen)", "-", "loopback", ap, err == nil && isLoopback(ap))
		case kind == "unix":
			fi, err := os.Stat(addr)
			mode := fmt.Sprint(err)
			if err == nil {
				mode = fmt.Sprintf("%#o", fi.Mode().Perm())
			}
			m.add(name, "(socket mode)", "-", "0600", mode, mode == "0600")
		}
		s.probe(name)
	}
	for a, s := range specs {
		if !seen[a] {
			m.add(s.daemon+" "+a, "(listen)", "-", "listening", "not found", false)
		}
	}
}

func busyboxLayout(t *testing.T) string {
	layout, err := testimage.Busybox(context.Background(), filepath.Join(os.TempDir(), "cube-test-busybox"))
	if err != nil {
		t.Fatal(err)
	}
	return layout
}

func dirExists(p string) bool {
	fi, err := os.Stat(p)
	return err == nil && fi.IsDir()
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

func copyFile(src, dst string) error {
	b, err := os.ReadFile(src)
	if err != nil {
		return err
	}
	return os.WriteFile(dst, b, 0o755)
}

// networkTOML: a private node CIDR and device prefix, no slot pool.
// slotResolver is where network-agent's DNS forwarder listens inside
// every slot namespace.
const slotResolver = "169.254.0.22:53"

// dnsMatrix probes a slot's DNS forwarder (name: "network-agent udp
// 169.254.0.22:53 in <slot pin>"): the slot's own sandbox is answered (the
// control), and the host, which reaches a slot only through its host
// address (DNATed to the sandbox), never reaches the forwarder.
func dnsMatrix(m *matrix, name, network string) {
	_, pin, _ := strings.Cut(name, " in ")
	q := new(dns.Msg)
	q.SetQuestion("matrix.cube.test.", dns.TypeA)
	c := &dns.Client{Net: network, Timeout: 2 * time.Second}
	ask := func(ns, addr string) (string, bool) {
		var r *dns.Msg
		err := netnsdir.Do(ns, func() (err error) {
			r, _, err = c.Exchange(q, addr)
			return err
		})
		if err != nil {
			return "no answer: " + err.Error(), false
		}
		return "answered " + dns.RcodeToString[r.Rcode], true
	}
	if fileExists(pin + "-sb") { // a container slot: its sandbox's namespace
		got, ok := ask(pin+"-sb", slotResolver)
		m.add(name, "DNS query "+network, "its sandbox", "answered", got, ok)
	}
	var hostIP string
	_ = netnsdir.Do(pin, func() error {
		ifc, err := net.InterfaceByName("up0")
		if err != nil {
			return err
		}
		addrs, err := ifc.Addrs()
		if err == nil && len(addrs) > 0 {
			if ipn, ok := addrs[0].(*net.IPNet); ok {
				hostIP = ipn.IP.String()
			}
		}
		return err
	})
	if hostIP == "" {
		m.add(name, "DNS query "+network, "the host", "the slot's host address", "not found", false)
		return
	}
	c.Timeout = 500 * time.Millisecond
	got := "no answer"
	r, _, err := c.Exchange(q, net.JoinHostPort(hostIP, "53"))
	if err == nil {
		got = "answered " + dns.RcodeToString[r.Rcode]
	}
	m.add(name, "DNS query "+network+" to "+hostIP+":53", "the host", "no answer", got, err != nil)
}

// slotProxy is where network-agent's egress proxy listens inside every
// slot namespace ([egress] port).
const slotProxy = "169.254.0.22:15001"

// egressMatrix probes a slot's egress proxy listener: neither the slot's
// sandbox dialling it directly (not redirected: dropped by the slot's
// input chain) nor the host at the slot's host address (DNATed to the
// sandbox, where nothing listens) gets a connection.
func egressMatrix(m *matrix, name string) {
	_, pin, _ := strings.Cut(name, " in ")
	dialIn := func(ns, addr string) (string, bool) {
		var c net.Conn
		err := netnsdir.Do(ns, func() (err error) {
			c, err = net.DialTimeout("tcp4", addr, 500*time.Millisecond)
			return err
		})
		if err != nil {
			return "no connection: " + err.Error(), true
		}
		c.Close()
		return "connected", false
	}
	if fileExists(pin + "-sb") {
		got, ok := dialIn(pin+"-sb", slotProxy)
		m.add(name, "direct TCP connect", "its sandbox", "no connection", got, ok)
	}
	var hostIP string
	_ = netnsdir.Do(pin, func() error {
		ifc, err := net.InterfaceByName("up0")
		if err != nil {
			return err
		}
		addrs, err := ifc.Addrs()
		if err == nil && len(addrs) > 0 {
			if ipn, ok := addrs[0].(*net.IPNet); ok {
				hostIP = ipn.IP.String()
			}
		}
		return err
	})
	_, port, _ := net.SplitHostPort(slotProxy)
	c, err := net.DialTimeout("tcp4", net.JoinHostPort(hostIP, port), 500*time.Millisecond)
	got := "no connection"
	if err == nil {
		got = "connected"
		c.Close()
	}
	m.add(name, "TCP connect to "+hostIP+":"+port, "the host", "no connection", got, err != nil && hostIP != "")
}

func fileExists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}

func networkTOML(prefix string) string {
	b := make([]byte, 2)
	_, _ = rand.Read(b)
	return fmt.Sprintf("node_cidr = \"10.%d.%d.0/24\"\nprefix = %q\n[pool]\nsize = 0\nvm_size = 0\n[dns]\nupstreams = [%q]\n",
		192+int(b[0])%64, b[1], prefix, nettest.OfflineDNS)
}

// inventory is every listening socket of the daemons cube up started,
// waiting (a while) for at least n.
func inventory(t *testing.T, n int) []listener {
	var found []listener
	deadline := time.Now().Add(10 * time.Second)
	for {
		socks := listening(t)
		maps.Copy(socks, pinnedListening(t))
		found = found[:0]
		for pid, name := range daemons(t) {
			for ino := range socketInodes(t, pid) {
				if a, ok := socks[ino]; ok {
					found = append(found, listener{pid: pid, name: name, addr: a})
				}
			}
		}
		if len(found) >= n || time.Now().After(deadline) {
			return found
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func netAddrPort(a string) (string, error) {
	host, _, err := net.SplitHostPort(a)
	return host, err
}

func isLoopback(host string) bool {
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// e2bMatrix calls every route of the E2B API (its route table) on team
// A's sandbox: without a key and with a made-up key (401), with team B's
// key (404 on team A's sandbox; lists leave it out); then, the controls,
// with team A's key, which gets past both checks (not 401, not 404).
// Routes that change the sandbox are controlled last, the kill at the end.
func e2bMatrix(t *testing.T, m *matrix, name, base, keyA, keyB, sandboxA string) {
	routes := e2bapi.New(nil, e2bapi.Config{}, nil).Routes()
	if len(routes) < 20 {
		t.Fatalf("the E2B route table has %d routes", len(routes))
	}
	var volumeA string // made below, before the first call that names it
	call := func(route, key string) (int, string) {
		method, path, _ := strings.Cut(route, " ")
		path = strings.NewReplacer("{sandboxID}", sandboxA, "{templateID}", "busybox", "{alias}", "base", "{name}", "matrix", "{volumeID}", volumeA).Replace(path)
		if path == "/sandboxes/metrics" {
			path += "?sandbox_ids=" + sandboxA // the list names team A's sandbox
		}
		var body io.Reader
		if method == "POST" || method == "PUT" {
			// A body every verb accepts, so that a refusal is not a 400
			// for the body before the sandbox is looked up.
			body = strings.NewReader(`{"timeout": 30}`)
		}
		req, _ := http.NewRequest(method, base+path, body)
		if body != nil {
			req.Header.Set("Content-Type", "application/json")
		}
		if key != "" {
			req.Header.Set("X-API-Key", key)
		}
		resp, err := (&http.Client{Timeout: time.Minute}).Do(req)
		if err != nil {
			return 0, err.Error()
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	// Team A's secret "matrix", which {name} routes name.
	if r := (&mastertest.Client{Base: base, Key: keyA, HC: &http.Client{Timeout: time.Minute}}).Do(t, "POST", "/secrets",
		map[string]string{"name": "matrix", "value": "v"}, nil); r.StatusCode != http.StatusCreated {
		t.Fatalf("team A's secret: %d %s", r.StatusCode, r.Body)
	}
	// Team A's volume, which {volumeID} routes name.
	var vol struct{ VolumeID string }
	if r := (&mastertest.Client{Base: base, Key: keyA, HC: &http.Client{Timeout: time.Minute}}).Do(t, "POST", "/volumes",
		map[string]string{"name": "matrix"}, &vol); r.StatusCode != http.StatusCreated {
		t.Fatalf("team A's volume: %d %s", r.StatusCode, r.Body)
	}
	volumeA = vol.VolumeID
	wrongKey := "e2b_" + randomHex(20)
	for _, r := range routes {
		if r == "GET /health" {
			code, _ := call(r, "")
			m.add(name, r, "none", "200 (liveness only, open by design)", fmt.Sprint(code), code == 200)
			continue
		}
		for _, c := range []struct{ cred, key string }{{"none", ""}, {"wrong API key", wrongKey}} {
			code, body := call(r, c.key)
			m.add(name, r, c.cred, "401", fmt.Sprintf("%d %s", code, strings.TrimSpace(body)), code == http.StatusUnauthorized)
		}
		switch {
		case strings.Contains(r, "{sandboxID}"), strings.Contains(r, "{name}"), strings.Contains(r, "{volumeID}"):
			code, body := call(r, keyB)
			m.add(name, r, "team B's key", "404", fmt.Sprintf("%d %s", code, strings.TrimSpace(body)), code == http.StatusNotFound)
		case strings.HasPrefix(r, "GET "):
			// A list: team B's leaves out what team A's shows.
			codeA, bodyA := call(r, keyA)
			if codeA != 200 || !strings.Contains(bodyA, sandboxA) {
				m.add(name, r, "team B's key", "n/a (team A's answer names no sandbox of A's)", fmt.Sprint(codeA), true)
				break
			}
			code, body := call(r, keyB)
			m.add(name, r, "team B's key", "200 without team A's sandbox (team A's lists it)", fmt.Sprintf("%d, lists A's: %v", code, strings.Contains(body, sandboxA)),
				code == 200 && !strings.Contains(body, sandboxA))
		default:
			m.add(name, r, "team B's key", "n/a (creates its own, or a template every team shares)", "-", true)
		}
	}
	// Controls, the read-only ones first, the kill last.
	rank := func(r string) int {
		switch {
		case strings.HasPrefix(r, "DELETE /sandboxes/"):
			return 3
		case strings.HasPrefix(r, "GET "):
			return 0
		case strings.Contains(r, "/pause"), strings.HasPrefix(r, "DELETE /secrets/"):
			return 2
		}
		return 1
	}
	ctl := slices.Clone(routes)
	sort.SliceStable(ctl, func(i, j int) bool { return rank(ctl[i]) < rank(ctl[j]) })
	for _, r := range ctl {
		if r == "GET /health" {
			continue
		}
		code, body := call(r, keyA)
		m.add(name, r, "control: team A's key", "past the key and team checks (not 401/404)", fmt.Sprintf("%d %s", code, strings.TrimSpace(body)),
			code != 0 && code != http.StatusUnauthorized && code != http.StatusNotFound)
	}
	// DELETE /templates/{templateID} naming a snapshot (the control above
	// made one of team A's sandbox; the other template routes serve
	// templates only): a snapshot is its team's.
	var snaps []struct{ SnapshotID string }
	(&mastertest.Client{Base: base, Key: keyA, HC: &http.Client{Timeout: time.Minute}}).Do(t, "GET", "/snapshots", nil, &snaps)
	if len(snaps) == 0 {
		t.Fatal("team A has no snapshot after the snapshot control")
	}
	{
		code, body := call("GET /snapshots", keyB)
		m.add(name, "GET /snapshots (team A has one)", "team B's key", "200 without team A's snapshot", fmt.Sprintf("%d, lists A's: %v", code, strings.Contains(body, snaps[0].SnapshotID)),
			code == 200 && !strings.Contains(body, snaps[0].SnapshotID))
	}
	for _, r := range routes {
		if !strings.HasPrefix(r, "DELETE ") || !strings.Contains(r, "{templateID}") {
			continue
		}
		snap := func(key string) (int, string) {
			method, path, _ := strings.Cut(r, " ")
			return call(method+" "+strings.Replace(path, "{templateID}", snaps[0].SnapshotID, 1), key)
		}
		call := r + " (team A's snapshot)"
		for _, c := range []struct{ cred, key, want string }{
			{"none", "", "401"}, {"wrong API key", wrongKey, "401"}, {"team B's key", keyB, "404"},
		} {
			code, body := snap(c.key)
			m.add(name, call, c.cred, c.want, fmt.Sprintf("%d %s", code, strings.TrimSpace(body)), fmt.Sprint(code) == c.want)
		}
		code, body := snap(keyA)
		m.add(name, call, "control: team A's key", "2xx", fmt.Sprintf("%d %s", code, strings.TrimSpace(body)), code >= 200 && code < 300)
	}
}

// routeMatrix: the sandbox route. envd's port needs the sandbox's envd
// token (checked by its agent), other ports its traffic token (checked by
// the route); /metrics is not served there.
func routeMatrix(m *matrix, name, base, sandboxA, envdA, trafficA, envdB, trafficB string) {
	get := func(port int, path, header, token string) (int, string) {
		req, _ := http.NewRequest("GET", base+path, nil)
		req.Header.Set("E2b-Sandbox-Id", sandboxA)
		req.Header.Set("E2b-Sandbox-Port", fmt.Sprint(port))
		if token != "" {
			req.Header.Set(header, token)
		}
		resp, err := (&http.Client{Timeout: 30 * time.Second}).Do(req)
		if err != nil {
			return 0, err.Error()
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, strings.TrimSpace(string(b))
	}
	refused := func(c int) bool { return c == http.StatusUnauthorized || c == http.StatusForbidden }
	for _, c := range []struct {
		port                int
		path, header        string
		wrong, other, right string
	}{
		{49983, "/envs", "X-Access-Token", randomHex(24), envdB, envdA},
		{8000, "/", "E2b-Traffic-Access-Token", randomHex(24), trafficB, trafficA},
	} {
		call := fmt.Sprintf("GET %s (sandbox A, port %d)", c.path, c.port)
		for _, cr := range []struct{ cred, tok string }{{"none", ""}, {"wrong token", c.wrong}, {"team B's sandbox's token", c.other}} {
			code, body := get(c.port, c.path, c.header, cr.tok)
			m.add(name, call, cr.cred, "401/403", fmt.Sprintf("%d %s", code, body), refused(code))
		}
		code, body := get(c.port, c.path, c.header, c.right)
		want := "200"
		ok := code == 200
		if c.port != 49983 {
			// Nothing listens on that port in the sandbox: admitted means
			// the route dialled it (502), not 401.
			want, ok = "admitted (502: nothing listens there)", code == http.StatusBadGateway
		}
		m.add(name, call, "control: sandbox A's token", want, fmt.Sprintf("%d %s", code, body), ok)
	}
	for _, p := range []string{"/metrics", "/health"} {
		req, _ := http.NewRequest("GET", base+p, nil)
		resp, err := (&http.Client{Timeout: 10 * time.Second}).Do(req)
		var got string
		code := 0
		if err != nil {
			got = err.Error()
		} else {
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			code = resp.StatusCode
			got = fmt.Sprintf("%d %s", code, strings.TrimSpace(string(b)))
		}
		if p == "/metrics" {
			m.add(name, "GET /metrics (no sandbox)", "none", "not served (400)", got, code == http.StatusBadRequest)
		} else {
			m.add(name, "GET /health (no sandbox)", "none", "2xx (liveness only, open by design)", got, code >= 200 && code < 300)
		}
	}
}

// agentMatrix: the sandbox's agent, reached from the host at its slot
// address. Every route (its HTTP routes, and every method of the envd
// Connect services, from their descriptors) refuses a request without
// the sandbox's access token, with a made-up one and with team B's
// sandbox's (401); the controls, with the token, are the read-only calls
// (others would change the sandbox).
func agentMatrix(t *testing.T, m *matrix, name, base, right, other string) {
	type call struct {
		method, path string
		control      bool
	}
	calls := []call{
		{"GET", "/envs", true}, {"POST", "/init", false}, {"GET", "/metrics", true},
		{"GET", "/files?path=/etc/hostname", true}, {"POST", "/files?path=/tmp/x", false},
		{"GET", agentproto.PathInfo, true}, {"POST", agentproto.PathFreeze, false}, {"POST", agentproto.PathThaw, false},
		{"POST", agentproto.PathClock, false}, {"POST", agentproto.PathQuiesce, false}, {"POST", agentproto.PathReinit, false},
		{"POST", agentproto.PathPrepare, false},
	}
	for _, svc := range []string{"process.Process", "filesystem.Filesystem"} {
		d, err := protoregistry.GlobalFiles.FindDescriptorByName(protoreflect.FullName(svc))
		if err != nil {
			t.Fatal(err)
		}
		ms := d.(protoreflect.ServiceDescriptor).Methods()
		for i := range ms.Len() {
			md := ms.Get(i)
			// Unary read-only methods as controls: List, Stat, ListDir.
			ro := !md.IsStreamingServer() && !md.IsStreamingClient() && (md.Name() == "List" || md.Name() == "Stat" || md.Name() == "ListDir")
			calls = append(calls, call{"POST", "/" + svc + "/" + string(md.Name()), ro})
		}
	}
	do := func(c call, token string) (int, string) {
		var body io.Reader
		if c.method == "POST" {
			body = strings.NewReader("{}")
		}
		req, _ := http.NewRequest(c.method, base+c.path, body)
		if body != nil {
			req.Header.Set("Content-Type", "application/json")
		}
		if token != "" {
			req.Header.Set("X-Access-Token", token)
		}
		resp, err := (&http.Client{Timeout: 10 * time.Second}).Do(req)
		if err != nil {
			return 0, err.Error()
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 200))
		return resp.StatusCode, strings.TrimSpace(string(b))
	}
	for _, c := range calls {
		cl := c.method + " " + c.path
		for _, cr := range []struct{ cred, tok string }{{"none", ""}, {"wrong token", randomHex(24)}, {"team B's sandbox's token", other}} {
			code, body := do(c, cr.tok)
			m.add(name, cl, cr.cred, "401", fmt.Sprintf("%d %s", code, body), code == http.StatusUnauthorized)
		}
		if c.control {
			code, body := do(c, right)
			m.add(name, cl, "control: sandbox A's token", "past the token check", fmt.Sprintf("%d %s", code, body),
				code != 0 && code != http.StatusUnauthorized)
		} else {
			m.add(name, cl, "control: sandbox A's token", "n/a (changes the sandbox; internal/agent TestTokenFromTheFirstRequest)", "-", true)
		}
	}
	code, _ := do(call{"GET", "/health", false}, "")
	m.add(name, "GET /health", "none", "204 (liveness only, open by design)", fmt.Sprint(code), code == http.StatusNoContent)
}

// openHTTP: a loopback listener the design leaves open to local accounts
// (health and aggregate metrics); the row records it.
func openHTTP(m *matrix, name, base string, paths []string, why string) {
	for _, p := range paths {
		resp, err := (&http.Client{Timeout: 10 * time.Second}).Get(base + p)
		if err != nil {
			m.add(name, "GET "+p, "none", why, err.Error(), false)
			continue
		}
		resp.Body.Close()
		m.add(name, "GET "+p, "none", why, fmt.Sprint(resp.StatusCode), resp.StatusCode < 500)
	}
}

// mtlsHTTP: an HTTP listener behind mutual TLS with the cluster CA.
func mtlsHTTP(m *matrix, name, base string, paths []string, certs map[string]*tls.Config, rogue, noCert *tls.Config) {
	do := func(url string, tc *tls.Config) (int, error) {
		c := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{TLSClientConfig: tc}}
		resp, err := c.Get(url)
		if err != nil {
			return 0, err
		}
		resp.Body.Close()
		return resp.StatusCode, nil
	}
	for _, p := range paths {
		call := "GET " + p
		// Plaintext to a TLS listener: Go's server answers 400.
		code, err := do(strings.Replace(base, "https://", "http://", 1)+p, nil)
		m.add(name, call, "none (plaintext)", "refused", fmt.Sprint(code, err), code != 200)
		for _, c := range []struct {
			cred string
			tc   *tls.Config
		}{{"none (TLS, no certificate)", noCert}, {"wrong (another CA's certificate)", rogue}} {
			code, err := do(base+p, c.tc)
			m.add(name, call, c.cred, "TLS handshake refused", fmt.Sprint(code, err), err != nil)
		}
		// A cluster certificate of a role that may not read it.
		code, err = do(base+p, certs["node"])
		m.add(name, call, "wrong role (node certificate)", "403", fmt.Sprint(code, err), err == nil && code == http.StatusForbidden)
		code, err = do(base+p, certs["admin"])
		m.add(name, call, "control: admin certificate", "200/204", fmt.Sprint(code, err), err == nil && code < 300)
	}
}

// joinMatrix: the join listener. It takes no client certificate; the
// token is the credential. Plaintext, no token, a made-up one and a spent
// one are refused; the control, a fresh token, gets a node certificate.
func joinMatrix(t *testing.T, m *matrix, name, addr string, ca *pki.CA, admin masterpb.AdminServiceClient) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	call := "POST " + nodejoin.Path
	sum := sha256.Sum256(ca.Cert.Raw)
	post := func(scheme, body string) (int, error) {
		hc := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{TLSClientConfig: nodejoin.PinnedConfig(sum[:])}}
		resp, err := hc.Post(scheme+"://"+addr+nodejoin.Path, "application/json", strings.NewReader(body))
		if err != nil {
			return 0, err
		}
		resp.Body.Close()
		return resp.StatusCode, nil
	}
	code, err := post("http", `{"nodeId":"matrix-node"}`)
	m.add(name, call, "none (plaintext)", "refused", fmt.Sprint(code, err), code != http.StatusOK)
	code, err = post("https", `{"nodeId":"matrix-node","publicKey":"x"}`)
	m.add(name, call, "none (no token)", "400/401", fmt.Sprint(code, err), err == nil && (code == http.StatusBadRequest || code == http.StatusUnauthorized))
	tok, err := admin.CreateJoinToken(ctx, &masterpb.CreateJoinTokenRequest{})
	if err != nil {
		t.Fatal(err)
	}
	parts := strings.Split(tok.Token, ".")
	madeUp := strings.Join([]string{parts[0], parts[1], strings.Repeat("0", len(parts[2])), parts[3]}, ".")
	_, _, _, err = nodejoin.Join(ctx, addr, madeUp, "matrix-node", []string{"127.0.0.1"}, t.TempDir())
	m.add(name, call, "wrong (a made-up secret)", "401", fmt.Sprint(err), errdefs.IsUnauthenticated(err))
	_, _, _, err = nodejoin.Join(ctx, addr, tok.Token, "matrix-node", []string{"127.0.0.1"}, t.TempDir())
	m.add(name, call, "control: a fresh token", "a node certificate", fmt.Sprint(err), err == nil)
	_, _, _, err = nodejoin.Join(ctx, addr, tok.Token, "matrix-node-2", []string{"127.0.0.1"}, t.TempDir())
	m.add(name, call, "wrong (the same token again)", "401", fmt.Sprint(err), errdefs.IsUnauthenticated(err))
}

// dataMatrix: the node data listener. Only the route's (proxy) and the
// master's certificates open a tunnel to a sandbox port; a node's, an
// operator's, another CA's, none, or plaintext do not. The controls reach
// the sandbox's agent through the tunnel, and a sandbox that is not the
// node's is refused with a proxy certificate (the lookup, not the
// certificate, refuses it).
func dataMatrix(m *matrix, name, addr, nodeID, sandboxID string, certs map[string]*tls.Config, rogue, noCert *tls.Config) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	call := "CONNECT " + sandboxID + ":49983"
	probe := func(tc *tls.Config, id string) (string, error) {
		c, err := (&nodetunnel.Dialer{TLS: tc}).Dial(ctx, addr, nodeID, id, agentproto.Port)
		if err != nil {
			return "", err
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(10 * time.Second))
		if _, err := io.WriteString(c, "GET /health HTTP/1.1\r\nHost: sandbox\r\nConnection: close\r\n\r\n"); err != nil {
			return "", err
		}
		line, err := bufio.NewReader(c).ReadString('\n')
		return strings.TrimSpace(line), err
	}
	// Plaintext CONNECT to the TLS listener.
	pc, err := net.DialTimeout("tcp", addr, 5*time.Second)
	got := fmt.Sprint(err)
	if err == nil {
		_ = pc.SetDeadline(time.Now().Add(5 * time.Second))
		fmt.Fprintf(pc, "CONNECT %s:%d HTTP/1.1\r\nHost: x\r\n\r\n", sandboxID, agentproto.Port)
		line, rerr := bufio.NewReader(pc).ReadString('\n')
		got = fmt.Sprintf("%q %v", strings.TrimSpace(line), rerr)
		pc.Close()
	}
	m.add(name, call, "none (plaintext)", "refused", got, !strings.Contains(got, " 200 "))
	for _, c := range []struct {
		cred string
		tc   *tls.Config
	}{{"none (TLS, no certificate)", noCert}, {"wrong (another CA's certificate)", rogue}} {
		got, err := probe(c.tc, sandboxID)
		m.add(name, call, c.cred, "TLS handshake refused", fmt.Sprint(got, err), err != nil && !errdefs.IsPermissionDenied(err))
	}
	for _, c := range []string{"node", "other-node", "admin"} {
		got, err := probe(certs[c], sandboxID)
		m.add(name, call, "wrong role ("+c+" certificate)", "403", fmt.Sprint(got, err), errdefs.IsPermissionDenied(err))
	}
	for _, c := range []string{"proxy", "master"} {
		got, err := probe(certs[c], sandboxID)
		m.add(name, call, "control: "+c+" certificate", "the sandbox's agent answers", fmt.Sprint(got, err), err == nil && strings.HasPrefix(got, "HTTP/1.1 "))
	}
	got, err = probe(certs["proxy"], "not-on-this-node")
	m.add(name, "CONNECT not-on-this-node:49983", "proxy certificate", "404", fmt.Sprint(got, err), errdefs.IsNotFound(err))
}

// unixMatrix: a root-only socket. uid 65534 cannot connect (the mode);
// the controls: root connects and is served, and uid 65534 connects to a
// 0666 socket in the same directory (the refusal is the mode's, not the
// path's).
func unixMatrix(t *testing.T, m *matrix, name, path string, call func(*grpc.ClientConn) error) {
	err := connectAs(path, 65534)
	m.add(name, "connect", "uid 65534", "EACCES", fmt.Sprint(err), errors.Is(err, syscall.EACCES))
	conn, err := grpc.NewClient("unix://"+path, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	err = call(conn)
	m.add(name, "an RPC", "control: root", "served", fmt.Sprint(err), err == nil)
	open := filepath.Join(filepath.Dir(path), "matrix-open-"+randomHex(3)+".sock")
	l, err := net.Listen("unix", open)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	_ = os.Chmod(open, 0o666)
	err = connectAs(open, 65534)
	m.add(name, "connect", "control: uid 65534 to a 0666 socket beside it", "connects", fmt.Sprint(err), err == nil)
}

// connectAs connects to a unix socket with the file-system uid uid (the
// kernel checks the socket's mode against it) on a locked thread, which
// is given back only once restored.
func connectAs(path string, uid int) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		// setfsuid answers the previous value whatever it does.
		_, _ = unix.SetfsuidRetUid(uid)
		var err error
		if cur, _ := unix.SetfsuidRetUid(uid); cur != uid {
			err = fmt.Errorf("setfsuid(%d): still %d", uid, cur)
		} else {
			var fd int
			if fd, err = unix.Socket(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0); err == nil {
				err = unix.Connect(fd, &unix.SockaddrUnix{Name: path})
				unix.Close(fd)
			}
		}
		// Back to root; the second call says whether the first did it.
		// A thread left as another uid ends with its goroutine (locked),
		// which must not happen when it can be helped: a child started
		// from that thread with a parent-death signal (cube up's
		// daemons) would get the signal.
		_, _ = unix.SetfsuidRetUid(0)
		if cur, _ := unix.SetfsuidRetUid(0); cur == 0 {
			runtime.UnlockOSThread()
		}
		errc <- err
	}()
	return <-errc
}

// grpcMatrix: every RPC of every service the gRPC listener at addr
// serves (from the generated service descriptors), with no credential
// (plaintext; TLS without a certificate), a wrong one (another CA's
// certificate; a cluster certificate of the wrong role; the wrong admin
// token), and the control: the right certificate (and token) gets past
// the checks (any answer but Unavailable, Unauthenticated,
// PermissionDenied). adminToken set means the master's api.node.
func grpcMatrix(t *testing.T, m *matrix, name, addr string, certs map[string]*tls.Config, rogue, noCert *tls.Config, nodeID, adminToken string) {
	descs := []grpc.ServiceDesc{cubeletpb.CubeletService_ServiceDesc}
	if adminToken != "" {
		descs = []grpc.ServiceDesc{masterpb.NodeService_ServiceDesc, masterpb.AdminService_ServiceDesc, masterpb.RouteService_ServiceDesc}
	}
	dial := func(tc *tls.Config) *grpc.ClientConn {
		creds := insecure.NewCredentials()
		if tc != nil {
			creds = credentials.NewTLS(tc)
		}
		c, err := grpc.NewClient(addr, grpc.WithTransportCredentials(creds))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	conns := map[string]*grpc.ClientConn{"plain": dial(nil), "nocert": dial(noCert), "rogue": dial(rogue)}
	for c, tc := range certs {
		conns[c] = dial(tc)
	}
	authCode := func(c codes.Code) bool {
		return c == codes.Unavailable || c == codes.Unauthenticated || c == codes.PermissionDenied
	}
	for _, d := range descs {
		sd, err := protoregistry.GlobalFiles.FindDescriptorByName(protoreflect.FullName(d.ServiceName))
		if err != nil {
			t.Fatal(err)
		}
		svc := sd.(protoreflect.ServiceDescriptor)
		// Who may call this service over mutual TLS, and a certificate
		// that may not.
		// ("other-node": a node certificate of another node ID.)
		rights, wrongs, token := []string{"master", "admin"}, []string{"node", "other-node", "proxy"}, ""
		switch d.ServiceName {
		case "master.v1.NodeService":
			rights, wrongs = []string{"node"}, []string{"other-node", "master", "admin", "proxy"}
		case "master.v1.AdminService":
			rights, wrongs, token = []string{"admin"}, []string{"node", "master", "proxy"}, adminToken
		case "master.v1.RouteService":
			rights, wrongs, token = []string{"admin", "proxy"}, []string{"node", "master"}, adminToken
		}
		methods := svc.Methods()
		if n := len(d.Methods) + len(d.Streams); n != methods.Len() {
			t.Fatalf("%s: %d methods in the descriptor, %d in the ServiceDesc", d.ServiceName, methods.Len(), n)
		}
		for i := range methods.Len() {
			md := methods.Get(i)
			call := string(svc.Name()) + "/" + string(md.Name())
			req := dynamicpb.NewMessage(md.Input())
			if f := md.Input().Fields().ByName("node"); f != nil && f.Message() != nil {
				// A node's report about the node the certificate names,
				// from another address: past the identity check, refused
				// as a second registrant (AlreadyExists) without touching
				// the live node.
				n := dynamicpb.NewMessage(f.Message())
				n.Set(f.Message().Fields().ByName("node_id"), protoreflect.ValueOfString(nodeID))
				n.Set(f.Message().Fields().ByName("address"), protoreflect.ValueOfString("127.0.0.1:1"))
				req.Set(f, protoreflect.ValueOfMessage(n))
			}
			if f := md.Input().Fields().ByName("node_id"); d.ServiceName == "master.v1.NodeService" && f != nil && f.Kind() == protoreflect.StringKind {
				// A call made as the node the certificate names (ReadBlob):
				// past the identity check, then refused for its empty
				// digest (InvalidArgument).
				req.Set(f, protoreflect.ValueOfString(nodeID))
			}
			probe := func(conn string, tok string) (codes.Code, string) {
				ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				defer cancel()
				if tok != "" {
					ctx = metadata.AppendToOutgoingContext(ctx, masterpb.AdminTokenHeader, tok)
				}
				err := invoke(ctx, conns[conn], svc, md, req)
				return status.Code(err), fmt.Sprint(err)
			}
			cases := []struct{ cred, conn, tok, want string }{
				{"none (plaintext)", "plain", token, "Unavailable (no handshake)"},
				{"none (TLS, no certificate)", "nocert", token, "Unavailable (handshake refused)"},
				{"wrong (another CA's certificate)", "rogue", token, "Unavailable (handshake refused)"},
			}
			for _, w := range wrongs {
				cases = append(cases, struct{ cred, conn, tok, want string }{"wrong role or node (" + w + " certificate)", w, token, "PermissionDenied"})
			}
			for _, c := range cases {
				code, msg := probe(c.conn, c.tok)
				ok := code == codes.Unavailable
				if strings.HasPrefix(c.want, "PermissionDenied") {
					ok = code == codes.PermissionDenied
				}
				m.add(name, call, c.cred, c.want, msg, ok)
			}
			if token != "" {
				code, msg := probe(rights[0], randomHex(16))
				m.add(name, call, "wrong admin token ("+rights[0]+" certificate)", "Unauthenticated", msg, code == codes.Unauthenticated)
			}
			for _, r := range rights {
				code, msg := probe(r, token)
				m.add(name, call, "control: "+r+" certificate", "past the checks", msg, !authCode(code))
			}
		}
	}
}

// invoke calls the method with req, unary or streaming, and returns the
// call's (or the stream's first message's) error.
func invoke(ctx context.Context, conn *grpc.ClientConn, svc protoreflect.ServiceDescriptor, md protoreflect.MethodDescriptor, req proto.Message) error {
	full := "/" + string(svc.FullName()) + "/" + string(md.Name())
	out := dynamicpb.NewMessage(md.Output())
	if !md.IsStreamingClient() && !md.IsStreamingServer() {
		return conn.Invoke(ctx, full, req, out)
	}
	st, err := conn.NewStream(ctx, &grpc.StreamDesc{ServerStreams: md.IsStreamingServer(), ClientStreams: md.IsStreamingClient()}, full)
	if err != nil {
		return err
	}
	if err := st.SendMsg(req); err != nil && !errors.Is(err, io.EOF) {
		return err
	}
	if err := st.CloseSend(); err != nil {
		return err
	}
	return st.RecvMsg(out)
}
