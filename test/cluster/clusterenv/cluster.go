// Package clusterenv builds a real multi-host cube cluster on one machine
// for the cluster tests (test/cluster) and cube-bench's cluster scenarios:
// every host is a network namespace with its own address on a
// bridge the harness creates (a MariaDB host, cubemaster replicas,
// cubeproxy replicas and node hosts, each node running its own
// network-agent and cubelet with private state and run dirs, cgroup
// parent, storage pool and the same default node_cidr), all speaking
// mutual TLS with certificates of one cluster CA. Everything is torn down
// when the test ends, failed or not, and checked for leaks. It drives
// everything through a testing.TB: cube-bench hands it one of its own.
package clusterenv

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/go-sql-driver/mysql"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	cubeletpb "github.com/cubesandbox/cube/api/cubelet/v1"
	masterpb "github.com/cubesandbox/cube/api/master/v1"
	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
	"github.com/cubesandbox/cube/internal/cubeletclient"
	"github.com/cubesandbox/cube/internal/leakcheck"
	"github.com/cubesandbox/cube/internal/master/mastertest"
	"github.com/cubesandbox/cube/internal/network/client"
	"github.com/cubesandbox/cube/internal/network/nettest"
	"github.com/cubesandbox/cube/internal/objstore/objstoretest"
	"github.com/cubesandbox/cube/internal/pki"
	"github.com/cubesandbox/cube/internal/serve"
	"github.com/cubesandbox/cube/internal/testbin"
	"github.com/cubesandbox/cube/internal/testenv"
	"github.com/cubesandbox/cube/internal/testimage"
	"github.com/cubesandbox/cube/internal/vmguest"
)

// Ports every host uses on its own address.
const (
	E2BPort    = 3000
	NodeAPI    = 8089 // cubemaster api.node (nodes, proxies)
	CubeletAPI = 9443 // cubelet api.tcp (the master dials it)
	DataPort   = 9444 // cubelet api.data (masters and proxies reach sandboxes' ports through it)
	ProxyPort  = 8443 // cubeproxy
	MySQLPort  = 3306
	// NodeCIDR is every node's slot address plan: the default, the same
	// on every node (plans are node-local).
	NodeCIDR = "10.200.0.0/16"
	// Template is the busybox test image's template ID on every node.
	Template = "busybox"
	// Domain is the route's sandbox host suffix.
	Domain = "cluster.test"
)

// Options shape a cluster.
type Options struct {
	Nodes, Masters, Proxies int // defaults 3, 2, 2
	// UnhealthyAfter is the masters' nodes.unhealthy_after and
	// nodes.lost_after (default 3s).
	UnhealthyAfter time.Duration
	// LeaseTTL is ha.lease_ttl (default 2s).
	LeaseTTL time.Duration
	// ObjectStore starts an S3 server (SeaweedFS) on a host of its own,
	// which every node's [store] names: snapshots travel between nodes.
	ObjectStore bool
	// MasterTOML is added to every replica's configuration.
	MasterTOML string
	// ReplicaTOML[i] is added to replica i's (m<i+1>) after MasterTOML.
	ReplicaTOML []string
	// NodeTOML is added to every node's cubelet configuration.
	NodeTOML string
	// SandboxMemoryMiB is the masters' sandbox.memory_mib, every
	// sandbox's memory limit (default 64; a VM's guest RAM, where the
	// guest kernel needs more: 256 with VM).
	SandboxMemoryMiB int64
	// VM enables the vm runtime on every node (QEMU with the guest built
	// into VMGuestDir, accelerator CUBE_VM_ACCEL, TCG by default) when
	// qemu-system-x86_64 is installed; Cluster.VM says whether it is.
	// The nodes' cubelet config then holds a [sandbox] section:
	// NodeTOML must not.
	VM bool
}

// VMGuestDir is where the cluster's nodes read the VM guest (kernel and
// initramfs), built once and kept next to the other tests' guests.
var VMGuestDir = filepath.Join(vmguest.DefaultCacheDir, "guest-cluster")

// Cluster is a running cluster.
type Cluster struct {
	ID     string
	Dir    string
	Bridge string
	net    string // the bridge's /24, first three octets
	HostIP string // the test's own address on the bridge
	CA     *pki.CA
	// AdminToken is the masters' api.admin_token (proxies send it).
	AdminToken string
	// AdminTLS is a client TLS config with an admin certificate of the
	// cluster CA (the admin API on a replica's api.node, with AdminToken).
	AdminTLS *tls.Config
	DB       *MariaDB
	// Store is the object store (Options.ObjectStore), nil without one.
	Store *ObjectStore
	// VM says whether the nodes run the vm runtime (Options.VM and QEMU
	// installed).
	VM      bool
	Masters []*Master
	Proxies []*Proxy
	Nodes   []*Node
	bins    map[string]string
	opts    Options
	image   string
	hosts   int
}

// MariaDB is the catalog's server on its own host.
type MariaDB struct {
	Host   *Host
	Proc   *Proc
	Dir    string
	Socket string
	DSN    string // the cluster's database over TCP
}

// ObjectStore is the S3 server snapshots travel through, on its own host.
type ObjectStore struct {
	Host   *Host
	Server *objstoretest.Server
}

// Master is a cubemaster replica on its own host.
type Master struct {
	Host    *Host
	Proc    *Proc
	Dir     string
	Config  string // the TOML file
	Socket  string // the admin socket (reachable: the hosts share the filesystem)
	Replica string
	Admin   masterpb.AdminServiceClient
	conn    *grpc.ClientConn
	c       *Cluster
}

// Proxy is a cubeproxy replica on its own host.
type Proxy struct {
	Host *Host
	Proc *Proc
	URL  string // https://<ip>:ProxyPort
}

// Node is a node host: network-agent and cubelet processes.
type Node struct {
	ID        string
	Host      *Host
	Env       *cubelettest.Env
	Agent     *Proc
	Cubelet   *Proc
	agentCfg  string
	cubeletCf string
	agentSock string
	netnsDir  string
	netRun    string
	netData   string
	c         *Cluster
}

func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// Start builds the cluster for t. Its cleanup stops and removes
// everything, also when t failed, and fails t on leaks.
func Start(t testing.TB, o Options) *Cluster {
	t.Helper()
	testenv.RequireRoot(t, "network namespaces, bridges, loop devices, mounts, cgroups")
	testenv.RequireBinary(t, "nsenter", "util-linux")
	testenv.RequireBinary(t, "ip", "iproute2")
	if o.Nodes == 0 {
		o.Nodes = 3
	}
	if o.Masters == 0 {
		o.Masters = 2
	}
	if o.Proxies == 0 {
		o.Proxies = 2
	}
	if o.UnhealthyAfter == 0 {
		o.UnhealthyAfter = 3 * time.Second
	}
	if o.LeaseTTL == 0 {
		o.LeaseTTL = 2 * time.Second
	}
	if o.SandboxMemoryMiB == 0 {
		o.SandboxMemoryMiB = 64
		if o.VM {
			o.SandboxMemoryMiB = 256
		}
	}
	c := &Cluster{ID: randHex(3), opts: o, AdminToken: randHex(16), bins: map[string]string{}}
	dir, err := os.MkdirTemp("", "cube-cluster-")
	if err != nil {
		t.Fatal(err)
	}
	// cubelet run dirs below must be searchable by sandbox users.
	if err := os.Chmod(dir, 0o711); err != nil {
		t.Fatal(err)
	}
	c.Dir = dir
	t.Cleanup(func() {
		os.RemoveAll(dir)
		c.assertGone(t)
	})
	c.buildBinaries(t)
	c.makeBridge(t)
	if c.CA, err = pki.NewCA("cube cluster test " + c.ID); err != nil {
		t.Fatal(err)
	}
	admin := c.issue(t, "admin", "admin", pki.RoleAdmin)
	if c.AdminTLS, err = admin.Client("test"); err != nil {
		t.Fatal(err)
	}
	// The busybox test image plus the bash shim the E2B SDK needs, imported
	// on every node as Template.
	c.image = filepath.Join(c.Dir, "e2b-busybox")
	if err := testimage.WriteE2BBusybox(c.image); err != nil {
		t.Fatal(err)
	}
	c.startMariaDB(t)
	// The first replica alone applies the migrations.
	for i := 0; i < o.Masters; i++ {
		c.startMaster(t, i)
	}
	if o.ObjectStore {
		c.startStore(t)
	}
	if o.VM {
		c.prepareVM(t)
	}
	for i := 0; i < o.Nodes; i++ {
		c.startNode(t, i)
	}
	for _, n := range c.Nodes {
		n.WaitHealthy(t, 60*time.Second)
	}
	for i := 0; i < o.Proxies; i++ {
		c.startProxy(t, i)
	}
	return c
}

func (c *Cluster) buildBinaries(t testing.TB) {
	t.Helper()
	bin := cubelettest.Binaries(t)
	c.bins["cubelet"] = filepath.Join(bin, "cubelet")
	c.bins["network-agent"] = nettest.Binary(t)
	c.bins["cubemaster"] = testbin.Build(t, "cubemaster", "failpoints")
	c.bins["cubeproxy"] = testbin.Build(t, "cubeproxy", "")
}

// makeBridge creates the cluster's bridge on a /24 no route of this
// machine covers, with the test's own address on it (the test reaches
// every host as a client on the same LAN).
func (c *Cluster) makeBridge(t testing.TB) {
	t.Helper()
	c.Bridge = "cbr" + c.ID
	routes, _ := exec.Command("ip", "-4", "route", "show", "table", "all").Output()
	for try := 0; ; try++ {
		b := make([]byte, 1)
		_, _ = rand.Read(b)
		// 172.31.254.0/24 and 172.31.255.0/24 are the network tests'
		// worlds' private addresses (internal/network/nettest), which
		// other packages' tests route while this one runs.
		c.net = fmt.Sprintf("172.31.%d", b[0]%254)
		if !strings.Contains(string(routes), c.net+".") {
			break
		}
		if try > 50 {
			t.Fatal("no free 172.31.x.0/24 for the cluster bridge")
		}
	}
	c.HostIP = c.net + ".1"
	if err := ip("link", "add", c.Bridge, "type", "bridge"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := ip("link", "del", c.Bridge); err != nil {
			t.Errorf("delete bridge: %v", err)
		}
	})
	for _, args := range [][]string{
		{"addr", "add", c.HostIP + "/24", "dev", c.Bridge},
		{"link", "set", c.Bridge, "up"},
	} {
		if err := ip(args...); err != nil {
			t.Fatal(err)
		}
	}
}

func (c *Cluster) newHost(t testing.TB, name string) *Host {
	t.Helper()
	c.hosts++
	return c.addHost(t, name, c.hosts)
}

func (c *Cluster) issue(t testing.TB, base, name string, role pki.Role, hosts ...string) serve.TLSFiles {
	t.Helper()
	d := filepath.Join(c.Dir, "pki", base)
	if err := os.MkdirAll(d, 0o700); err != nil {
		t.Fatal(err)
	}
	f, err := c.CA.Issue(d, base, name, role, hosts...)
	if err != nil {
		t.Fatal(err)
	}
	return f
}

func (c *Cluster) startMariaDB(t testing.TB) {
	t.Helper()
	server, install := lookPath("mariadbd", "mysqld"), lookPath("mariadb-install-db", "mysql_install_db")
	if server == "" || install == "" {
		testenv.Missing(t, "mariadb-server is not installed (hack/deps.sh installs it)")
	}
	h := c.newHost(t, "db")
	m := &MariaDB{Host: h, Dir: filepath.Join(c.Dir, "db")}
	m.Socket = filepath.Join(m.Dir, "mysqld.sock")
	data := filepath.Join(m.Dir, "data")
	if out, err := exec.Command(install, "--no-defaults", "--datadir="+data, "--auth-root-authentication-method=normal",
		"--skip-test-db", "--skip-name-resolve", "--user=root").CombinedOutput(); err != nil {
		t.Fatalf("mariadb-install-db: %v\n%s", err, out)
	}
	m.Proc = h.start(t, "mariadb", server, "--no-defaults", "--datadir="+data, "--socket="+m.Socket,
		fmt.Sprintf("--port=%d", MySQLPort), "--bind-address="+h.IP, "--skip-grant-tables", "--skip-name-resolve",
		"--pid-file="+filepath.Join(m.Dir, "mysqld.pid"), "--innodb-buffer-pool-size=32M", "--innodb-log-file-size=16M",
		"--performance-schema=OFF", "--skip-log-bin", "--user=root", "--max-connections=500")
	t.Cleanup(func() { m.Proc.Stop(20 * time.Second) })
	local := mysql.NewConfig()
	local.User, local.Net, local.Addr = "root", "unix", m.Socket
	waitFor(t, 60*time.Second, "mariadb", func() bool {
		if !m.Proc.Running() {
			t.Fatalf("mariadbd exited:\n%s", m.Proc.Output())
		}
		db, err := sql.Open("mysql", local.FormatDSN())
		if err != nil {
			return false
		}
		defer db.Close()
		_, err = db.Exec("CREATE DATABASE IF NOT EXISTS cube CHARACTER SET utf8mb4")
		return err == nil
	})
	tcp := mysql.NewConfig()
	tcp.User, tcp.Net, tcp.Addr, tcp.DBName = "root", "tcp", fmt.Sprintf("%s:%d", h.IP, MySQLPort), "cube"
	m.DSN = tcp.FormatDSN()
	c.DB = m
}

// startStore runs SeaweedFS on a host "s3": nodes reach it over the
// bridge, and killing it (Store.Server.Kill) cuts every node off the
// store at once.
func (c *Cluster) startStore(t testing.TB) {
	t.Helper()
	h := c.newHost(t, "s3")
	c.Store = &ObjectStore{Host: h, Server: objstoretest.StartWith(t, objstoretest.Options{IP: h.IP, NetNS: h.nsPath()})}
}

// prepareVM builds (or finds cached) the VM guest the nodes boot, when
// QEMU is installed.
func (c *Cluster) prepareVM(t testing.TB) {
	t.Helper()
	if _, err := exec.LookPath("qemu-system-x86_64"); err != nil {
		t.Logf("qemu-system-x86_64 not found: the nodes run no vm runtime")
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	if _, err := vmguest.Build(ctx, vmguest.BuildConfig{OutDir: VMGuestDir}); err != nil {
		t.Fatalf("vm guest artifacts: %v", err)
	}
	c.VM = true
}

// vmTOML is a node's [vm] section and the [sandbox] one it needs ("" when
// the nodes run no VM). A TCG guest runs only when QEMU's thread gets a
// core of this shared host: the agent-ready wait sized for containers is
// too short for its boot.
func (c *Cluster) vmTOML() string {
	if !c.VM {
		return ""
	}
	accel := os.Getenv("CUBE_VM_ACCEL")
	if accel == "" {
		accel = "tcg"
	}
	return fmt.Sprintf("[vm]\nguest_dir = %q\naccel = %q\n[sandbox]\nagent_ready_timeout = \"180s\"\n", VMGuestDir, accel)
}

// storeTOML is a node's [store] section ("" without a store).
func (c *Cluster) storeTOML() string {
	if c.Store == nil {
		return ""
	}
	srv := c.Store.Server
	return fmt.Sprintf("[store]\nendpoint = %q\nbucket = %q\naccess_key_file = %q\nsecret_key_file = %q\n",
		srv.Endpoint, srv.Bucket, srv.AccessKeyFile, srv.SecretKeyFile)
}

func lookPath(names ...string) string {
	for _, n := range names {
		if p, err := exec.LookPath(n); err == nil {
			return p
		}
		for _, d := range []string{"/usr/sbin", "/usr/bin"} {
			if _, err := os.Stat(filepath.Join(d, n)); err == nil {
				return filepath.Join(d, n)
			}
		}
	}
	return ""
}

// MasterAddrs is every replica's api.node, comma-separated.
func (c *Cluster) MasterAddrs() string {
	var a []string
	for i := 0; i < c.opts.Masters; i++ {
		a = append(a, fmt.Sprintf("%s.%d:%d", c.net, 10+2+i, NodeAPI))
	}
	return strings.Join(a, ",")
}

// replicaTOML is Options.ReplicaTOML of replica i ("" when none).
func (c *Cluster) replicaTOML(i int) string {
	if i < len(c.opts.ReplicaTOML) {
		return "\n" + c.opts.ReplicaTOML[i]
	}
	return ""
}

func (c *Cluster) startMaster(t testing.TB, i int) {
	t.Helper()
	name := fmt.Sprintf("m%d", i+1)
	h := c.newHost(t, name)
	if want := fmt.Sprintf("%s.%d", c.net, 10+2+i); h.IP != want {
		t.Fatalf("master %s at %s, want %s", name, h.IP, want) // MasterAddrs relies on the order
	}
	m := &Master{Host: h, Dir: filepath.Join(c.Dir, name), Replica: name, c: c}
	if err := os.MkdirAll(m.Dir, 0o700); err != nil {
		t.Fatal(err)
	}
	m.Socket = filepath.Join(m.Dir, "master.sock")
	f := c.issue(t, name, "cubemaster-"+name, pki.RoleMaster, h.IP)
	cfg := fmt.Sprintf(`[api]
e2b = "%[1]s:%[2]d"
e2b_tls_cert = %[3]q
e2b_tls_key = %[4]q
node = "%[1]s:%[6]d"
socket = %[7]q
admin_token = %[8]q
[tls]
cert = %[3]q
key = %[4]q
ca = %[5]q
[proxy]
listen = ""
domain = %[9]q
[catalog]
driver = "mysql"
dsn = %[10]q
[ha]
replica_id = %[11]q
lease_ttl = %[12]q
[nodes]
heartbeat_interval = "250ms"
unhealthy_after = %[13]q
lost_after = %[13]q
restart_wait = "5s"
[sandbox]
expiry_interval = "200ms"
memory_mib = %[16]d
[templates]
store_dir = %[14]q
[scheduler.weights]
# Every node holds every template here: locality would only pile the
# first sandboxes on the node that got the first one (its bonus outweighs
# spread's until a node has a few), and the cases assert the spread.
locality = 0.0
%[15]s
`, h.IP, E2BPort, f.Cert, f.Key, f.CA, NodeAPI, m.Socket, c.AdminToken, Domain, c.DB.DSN, name,
		c.opts.LeaseTTL.String(), c.opts.UnhealthyAfter.String(), filepath.Join(m.Dir, "templates"), c.opts.MasterTOML+c.replicaTOML(i), c.opts.SandboxMemoryMiB)
	m.Config = filepath.Join(m.Dir, "cubemaster.toml")
	if err := os.WriteFile(m.Config, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	conn, err := grpc.NewClient("unix://"+m.Socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	m.conn, m.Admin = conn, masterpb.NewAdminServiceClient(conn)
	m.Start(t)
	t.Cleanup(func() { m.Proc.Stop(15 * time.Second) })
	c.Masters = append(c.Masters, m)
}

// Start (re)starts the replica's process and waits for its admin socket.
func (m *Master) Start(t testing.TB) {
	t.Helper()
	m.Proc = m.Host.start(t, m.Replica, m.c.bins["cubemaster"], "-config", m.Config)
	waitFor(t, 60*time.Second, "cubemaster "+m.Replica, func() bool {
		if !m.Proc.Running() {
			t.Fatalf("cubemaster %s exited:\n%s", m.Replica, m.Proc.Output())
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_, err := m.Admin.ListNodes(ctx, &masterpb.ListNodesRequest{})
		return err == nil
	})
}

// API is an E2B REST client for the replica (TLS, the cluster CA).
func (m *Master) API(key string) *mastertest.Client {
	return &mastertest.Client{Base: fmt.Sprintf("https://%s:%d", m.Host.IP, E2BPort), Key: key,
		HC: &http.Client{Timeout: time.Minute, Transport: &http.Transport{TLSClientConfig: m.c.ServerTLS()}}}
}

// ServerTLS trusts the cluster CA (no client certificate: the E2B API and
// the route authenticate with keys and tokens).
func (c *Cluster) ServerTLS() *tls.Config {
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(c.CA.CertPEM)
	return &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}
}

// NodeResolver writes a Node.js preload (node --import) that resolves
// every name under Domain to the proxy p, as a wildcard DNS record for
// the route would, and returns its path.
func (c *Cluster) NodeResolver(t testing.TB, p *Proxy) string {
	t.Helper()
	path := filepath.Join(c.Dir, "resolve-"+p.Host.Name+".mjs")
	js := fmt.Sprintf(`import dns from 'node:dns'
const lookup = dns.lookup
dns.lookup = function (host, opts, cb) {
  if (typeof opts === 'function') { cb = opts; opts = {} }
  if (typeof opts === 'number') opts = { family: opts }
  if (host === %[1]q || host.endsWith('.' + %[1]q)) {
    if (opts && opts.all) return process.nextTick(cb, null, [{ address: %[2]q, family: 4 }])
    return process.nextTick(cb, null, %[2]q, 4)
  }
  return lookup.call(this, host, opts, cb)
}
`, Domain, p.Host.IP)
	if err := os.WriteFile(path, []byte(js), 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

// CAFile is the cluster CA's certificate (PEM), for clients such as
// Node.js (NODE_EXTRA_CA_CERTS).
func (c *Cluster) CAFile() string { return filepath.Join(c.Dir, "pki", "admin", "ca.crt") }

// APIKey creates an E2B API key through the first live replica.
func (c *Cluster) APIKey(t testing.TB) string {
	t.Helper()
	for _, m := range c.Masters {
		if !m.Proc.Running() {
			continue
		}
		resp, err := m.Admin.CreateAPIKey(context.Background(), &masterpb.CreateAPIKeyRequest{Name: "cluster-" + randHex(4)})
		if err != nil {
			t.Fatal(err)
		}
		return resp.Secret
	}
	t.Fatal("no live master")
	return ""
}

// AdminOf is the admin API of the first live replica.
func (c *Cluster) AdminOf(t testing.TB) masterpb.AdminServiceClient {
	t.Helper()
	for _, m := range c.Masters {
		if m.Proc.Running() {
			return m.Admin
		}
	}
	t.Fatal("no live master")
	return nil
}

func (c *Cluster) startProxy(t testing.TB, i int) {
	t.Helper()
	name := fmt.Sprintf("p%d", i+1)
	h := c.newHost(t, name)
	// Sandbox hosts (<port>-<id>.<domain>) too: clients that resolve
	// the domain to a proxy reach it by name.
	f := c.issue(t, name, "cubeproxy-"+name, pki.RoleProxy, h.IP, "*."+Domain)
	p := &Proxy{Host: h, URL: fmt.Sprintf("https://%s:%d", h.IP, ProxyPort)}
	p.Proc = h.start(t, name, c.bins["cubeproxy"], "--listen", fmt.Sprintf("%s:%d", h.IP, ProxyPort), "--domain", Domain,
		"--id", name, "--tls-cert", f.Cert, "--tls-key", f.Key, "--master", c.MasterAddrs(), "--admin-token", c.AdminToken,
		"--master-tls-cert", f.Cert, "--master-tls-key", f.Key, "--master-tls-ca", f.CA)
	t.Cleanup(func() { p.Proc.Stop(10 * time.Second) })
	hc := &http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{TLSClientConfig: c.ServerTLS()}}
	waitFor(t, 30*time.Second, "cubeproxy "+name, func() bool {
		if !p.Proc.Running() {
			t.Fatalf("cubeproxy %s exited:\n%s", name, p.Proc.Output())
		}
		resp, err := hc.Get(p.URL + "/health")
		if err != nil {
			return false
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
	c.Proxies = append(c.Proxies, p)
}

func (c *Cluster) startNode(t testing.TB, i int) {
	t.Helper()
	name := fmt.Sprintf("n%d", i+1)
	// The env's cleanup (registered first, so run last) checks the node's
	// state for leaks and removes its pool.
	env := cubelettest.New(t, "")
	h := c.newHost(t, name)
	n := &Node{ID: c.ID + "-" + name, Host: h, Env: env, c: c}
	netDir := filepath.Join(env.Dir, "net")
	n.netRun, n.netData = filepath.Join(netDir, "run"), filepath.Join(netDir, "data")
	n.netnsDir = filepath.Join(n.netRun, "netns")
	n.agentSock = filepath.Join(netDir, "agent.sock")
	if err := os.MkdirAll(netDir, 0o755); err != nil {
		t.Fatal(err)
	}
	// network-agent: the default node_cidr, a prefix per node (its pinned
	// namespaces are in its own run dir; links and nft tables live in the
	// node's namespace), no pool (every slot belongs to a sandbox, so
	// nothing is left once they are gone), DNS never forwarded off the
	// machine.
	agentCfg := fmt.Sprintf(`node_cidr = %q
prefix = "n%s%d"
run_dir = %q
data_dir = %q
[api]
socket = %q
http = ""
[pool]
size = 0
vm_size = 0
[dns]
upstreams = [%q]
`, NodeCIDR, c.ID[:4], i+1, n.netRun, n.netData, n.agentSock, nettest.OfflineDNS)
	n.agentCfg = filepath.Join(netDir, "agent.toml")
	if err := os.WriteFile(n.agentCfg, []byte(agentCfg), 0o644); err != nil {
		t.Fatal(err)
	}
	f := c.issue(t, name, n.ID, pki.RoleNode, h.IP)
	ec := env.Config
	cfg := fmt.Sprintf(`[node]
id = %q
data_dir = %q
run_dir = %q
cgroup_parent = %q
[api]
socket = %q
tcp = "%s:%d"
data = "%s:%d"
metrics = ""
[tls]
cert = %q
key = %q
ca = %q
[master]
addr = %q
advertise = "%s:%d"
heartbeat_interval = "250ms"
[network]
agent_socket = %q
[storage]
pool_image_size_mib = %d
agent_binary = %q
template_headroom_mib = %d
[gc]
interval = "200ms"
max_backoff = "2s"
%s
%s
%s`, n.ID, ec.Node.DataDir, ec.Node.RunDir, ec.Node.CgroupParent, ec.API.Socket, h.IP, CubeletAPI, h.IP, DataPort,
		f.Cert, f.Key, f.CA, c.MasterAddrs(), h.IP, CubeletAPI, n.agentSock,
		ec.Storage.PoolImageSizeMiB, ec.Storage.AgentBinary, ec.Storage.TemplateHeadroomMiB, c.storeTOML(), c.vmTOML(), c.opts.NodeTOML)
	n.cubeletCf = filepath.Join(env.Dir, "cubelet.toml")
	if err := os.WriteFile(n.cubeletCf, []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	// Registered after the env's and the host's cleanups: runs before
	// them (the sandboxes go first, then the daemons, then the host).
	t.Cleanup(func() { n.teardown(t) })
	n.Start(t)
	n.importTemplate(t)
	c.Nodes = append(c.Nodes, n)
}

// Start (re)starts the node's network-agent and cubelet.
func (n *Node) Start(t testing.TB) {
	t.Helper()
	if err := n.start(t); err != nil {
		t.Fatal(err)
	}
}

func (n *Node) start(t testing.TB) error {
	n.Agent = n.Host.start(t, n.Host.Name+"/network-agent", n.c.bins["network-agent"], "--config", n.agentCfg)
	err := poll(30*time.Second, "network-agent "+n.Host.Name, func() (bool, error) {
		if !n.Agent.Running() {
			return false, fmt.Errorf("network-agent %s exited:\n%s", n.Host.Name, n.Agent.Output())
		}
		nc, err := client.Dial(n.agentSock)
		if err != nil {
			return false, nil
		}
		defer nc.Close()
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		h, err := nc.Health(ctx)
		return err == nil && h.Ok, nil
	})
	if err != nil {
		return err
	}
	n.Cubelet = n.Host.start(t, n.Host.Name+"/cubelet", n.c.bins["cubelet"], "--config", n.cubeletCf)
	return poll(60*time.Second, "cubelet "+n.Host.Name, func() (bool, error) {
		if !n.Cubelet.Running() {
			return false, fmt.Errorf("cubelet %s exited:\n%s", n.Host.Name, n.Cubelet.Output())
		}
		_, err := n.call(func(ctx context.Context, cl cubeletpb.CubeletServiceClient) error {
			_, err := cl.Health(ctx, &cubeletpb.HealthRequest{})
			return err
		})
		return err == nil, nil
	})
}

// call runs f against the cubelet's local socket.
func (n *Node) call(f func(context.Context, cubeletpb.CubeletServiceClient) error) (struct{}, error) {
	conn, err := cubeletclient.Dial(n.Env.Config.API.Socket)
	if err != nil {
		return struct{}{}, err
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	return struct{}{}, f(ctx, cubeletclient.New(conn))
}

func (n *Node) importTemplate(t testing.TB) {
	t.Helper()
	_, err := n.call(func(ctx context.Context, cl cubeletpb.CubeletServiceClient) error {
		st, err := cl.ImportTemplate(ctx, &cubeletpb.ImportTemplateRequest{TemplateId: Template, Source: n.c.image})
		if err != nil {
			return err
		}
		for {
			if _, err := st.Recv(); err != nil {
				if errors.Is(err, io.EOF) {
					return nil
				}
				return err
			}
		}
	})
	if err != nil {
		t.Fatalf("import %s on %s: %v", Template, n.ID, err)
	}
}

// AddNode starts one more node host (a node that joins later) and waits
// until the masters report it healthy.
func (c *Cluster) AddNode(t testing.TB) *Node {
	t.Helper()
	c.startNode(t, len(c.Nodes))
	n := c.Nodes[len(c.Nodes)-1]
	n.WaitHealthy(t, 60*time.Second)
	return n
}

// Image is the OCI layout every node imported as Template (busybox with
// the E2B bash shim), readable by every host.
func (c *Cluster) Image() string { return c.image }

// WaitTemplate waits until every live replica reports the node holding
// the template (each re-reads the nodes' reports from the catalog every
// half heartbeat: the one that heard the report knows first).
func (n *Node) WaitTemplate(t testing.TB, id string, d time.Duration) {
	t.Helper()
	waitFor(t, d, "node "+n.ID+" holding template "+id+" on every replica", func() bool {
		for _, m := range n.c.Masters {
			if !m.Proc.Running() {
				continue
			}
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			resp, err := m.Admin.ListNodes(ctx, &masterpb.ListNodesRequest{})
			cancel()
			if err != nil {
				return false
			}
			held := false
			for _, v := range resp.Nodes {
				if v.Report.NodeId != n.ID {
					continue
				}
				for _, tr := range v.Report.Templates {
					held = held || tr.Id == id
				}
			}
			if !held {
				return false
			}
		}
		return true
	})
}

// WaitHealthy waits until a live replica reports the node healthy with
// the template.
func (n *Node) WaitHealthy(t testing.TB, d time.Duration) {
	t.Helper()
	waitFor(t, d, "node "+n.ID+" healthy", func() bool {
		v := n.c.node(t, n.ID)
		if v == nil || !v.Healthy {
			return false
		}
		for _, tr := range v.Report.Templates {
			if tr.Id == Template {
				return true
			}
		}
		return false
	})
}

func (c *Cluster) node(t testing.TB, id string) *masterpb.Node {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	resp, err := c.AdminOf(t).ListNodes(ctx, &masterpb.ListNodesRequest{})
	if err != nil {
		return nil
	}
	for _, v := range resp.Nodes {
		if v.Report.NodeId == id {
			return v
		}
	}
	return nil
}

// Lose makes the node's host vanish as a machine does: its daemons are
// SIGKILLed and its link to the network is gone. Sandboxes' processes
// stay until the test's cleanup (which brings the host back to remove
// them).
func (n *Node) Lose(t testing.TB) {
	t.Helper()
	n.Cubelet.Kill()
	n.Agent.Kill()
	if err := n.Host.Unplug(); err != nil {
		t.Fatal(err)
	}
}

// Return brings a lost node's host back: plugged in again, its daemons
// restarted on their state (the sandboxes' processes ran on meanwhile).
func (n *Node) Return(t testing.TB) {
	t.Helper()
	if n.Host.unplugged {
		if err := n.Host.Plug(); err != nil {
			t.Fatal(err)
		}
	}
	n.Start(t)
	n.WaitHealthy(t, 60*time.Second)
}

// teardown brings the node back if it was lost, destroys what sandboxes
// remain through its cubelet, stops its daemons, and removes what
// network-agent pinned; the env's cleanup then checks for leaks.
func (n *Node) teardown(t testing.TB) {
	if n.Cubelet == nil {
		return
	}
	if !n.Agent.Running() || !n.Cubelet.Running() {
		n.Cubelet.Kill()
		n.Agent.Kill()
		if n.Host.unplugged {
			if err := n.Host.Plug(); err != nil {
				t.Errorf("node %s: plug it back to clean up: %v", n.ID, err)
			}
		}
		if err := n.start(t); err != nil {
			t.Errorf("node %s: restart it to clean up: %v", n.ID, err)
		}
	}
	if n.Cubelet.Running() {
		_, err := n.call(func(ctx context.Context, cl cubeletpb.CubeletServiceClient) error {
			resp, err := cl.ListSandboxes(ctx, &cubeletpb.ListSandboxesRequest{})
			if err != nil {
				return err
			}
			for _, sb := range resp.Sandboxes {
				if _, err := cl.DeleteSandbox(ctx, &cubeletpb.DeleteSandboxRequest{SandboxId: sb.Id}); err != nil {
					return fmt.Errorf("delete %s: %w", sb.Id, err)
				}
			}
			return nil
		})
		if err != nil {
			t.Errorf("node %s: remove sandboxes: %v", n.ID, err)
		}
	}
	n.Cubelet.Stop(30 * time.Second)
	n.Agent.Stop(15 * time.Second)
	// Pinned slot namespaces (bind mounts) outlive the agent.
	ents, _ := os.ReadDir(n.netnsDir)
	for _, e := range ents {
		p := filepath.Join(n.netnsDir, e.Name())
		_ = syscall.Unmount(p, syscall.MNT_DETACH)
		_ = os.Remove(p)
	}
	leaks, err := leakcheck.Check(context.Background(), leakcheck.Scope{RunDir: n.netRun, DataDir: n.netData, NetnsDir: n.netnsDir})
	if err != nil {
		t.Errorf("leak check of %s's network: %v", n.ID, err)
	}
	for _, l := range leaks {
		t.Errorf("node %s: leak: %s", n.ID, l)
	}
}

// SandboxIDs lists the sandboxes the node's cubelet holds.
func (n *Node) SandboxIDs(t testing.TB) []string {
	t.Helper()
	var ids []string
	_, err := n.call(func(ctx context.Context, cl cubeletpb.CubeletServiceClient) error {
		resp, err := cl.ListSandboxes(ctx, &cubeletpb.ListSandboxesRequest{})
		if err != nil {
			return err
		}
		for _, sb := range resp.Sandboxes {
			ids = append(ids, sb.Id)
		}
		return nil
	})
	if err != nil {
		t.Fatalf("list sandboxes on %s: %v", n.ID, err)
	}
	return ids
}

// Sandboxes lists the catalog's sandboxes (every team) through a live
// replica.
func (c *Cluster) Sandboxes(t testing.TB, states ...string) []*masterpb.Sandbox {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp, err := c.AdminOf(t).ListSandboxes(ctx, &masterpb.ListSandboxesRequest{States: states})
	if err != nil {
		t.Fatal(err)
	}
	return resp.Sandboxes
}

// LeaseHolder reads which replica holds the loops' lease.
func (c *Cluster) LeaseHolder(t testing.TB) string {
	t.Helper()
	local := mysql.NewConfig()
	local.User, local.Net, local.Addr, local.DBName = "root", "unix", c.DB.Socket, "cube"
	db, err := sql.Open("mysql", local.FormatDSN())
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	var replica string
	err = db.QueryRow("SELECT replica FROM leases WHERE name = 'master-loops'").Scan(&replica)
	if errors.Is(err, sql.ErrNoRows) {
		return ""
	}
	if err != nil {
		t.Fatalf("read the lease: %v", err)
	}
	return replica
}

func waitFor(t testing.TB, d time.Duration, what string, ok func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !ok() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", d, what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// poll is waitFor returning an error (cleanups must not t.Fatal).
func poll(d time.Duration, what string, ok func() (bool, error)) error {
	deadline := time.Now().Add(d)
	for {
		done, err := ok()
		if err != nil || done {
			return err
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("timed out after %s waiting for %s", d, what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// assertGone fails t if a namespace or link of the cluster is left (run
// last, after every host's cleanup).
func (c *Cluster) assertGone(t testing.TB) {
	if c.Bridge == "" {
		return // it stopped before making any host
	}
	ns, _ := exec.Command("ip", "netns", "list").Output()
	links, _ := exec.Command("ip", "-o", "link", "show").Output()
	for _, l := range strings.Split(string(ns)+string(links), "\n") {
		if strings.Contains(l, "cube-cl-"+c.ID) || strings.Contains(l, "ccl"+c.ID) || strings.Contains(l, c.Bridge+":") || strings.Contains(l, c.Bridge+"@") {
			t.Errorf("left after the cluster: %s", l)
		}
	}
}
