// Package launcher is `cube up`: one command that runs a whole single-node
// system — network-agent (when its binary is there), cubemaster with its
// E2B API and sandbox route, and cubelet — as supervised child processes
// with embedded defaults, imports the default template if the node lacks
// it, makes sure an API key exists, prints the E2B environment to use, and
// keeps serving until interrupted.
//
// It is idempotent: a second `cube up` while one runs prints the same
// environment and exits; stopping and starting again keeps every sandbox
// (cubelet adopts them, cubemaster's catalog keeps them) and the same key.
//
// Files:
//
//	<state>/launcher/cubemaster.toml, cubelet.toml,
//	  network-agent.toml                             generated configs
//	<state>/launcher/api-key                         the key it prints (0600)
//	<state>/launcher/env                             the E2B_* variables, to source
//	<state>/images/                                  the default template's OCI layout
//	<state>/master/catalog.db                        cubemaster's catalog (SQLite)
//	<state>/master/templates/                        cubemaster's template store
//	<state>/pki/ca.crt, ca.key                       the cluster CA (made once; the key 0600)
//	<state>/pki/{master,node,admin}.{crt,key}        certificates issued at every start
//	<run>/cube-up.lock, cube-up.pid                  one launcher at a time
//	<logs>/<daemon>.log                              each daemon's output
package launcher

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	toml "github.com/pelletier/go-toml/v2"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	cubeletpb "github.com/cubesandbox/cube/api/cubelet/v1"
	masterpb "github.com/cubesandbox/cube/api/master/v1"
	"github.com/cubesandbox/cube/internal/cubeletclient"
	"github.com/cubesandbox/cube/internal/testimage"
)

// Config is what `cube up` runs with.
type Config struct {
	StateDir  string // /var/lib/cube
	RunDir    string // /run/cube
	LogDir    string // /var/log/cube
	BinDir    string // where cubelet, cubemaster, cube-agent (and network-agent) are
	APIAddr   string // E2B API, 127.0.0.1:3000
	ProxyAddr string // sandbox route, 127.0.0.1:8081
	// Domain of sandbox hosts; empty = localhost:<route port>, so that
	// http://<port>-<id>.localhost:<route port> works from this machine.
	Domain string
	// DomainMode: the route (ProxyAddr) serves TLS with a certificate for
	// *.<domain> and the E2B API at api.<domain> besides the sandboxes at
	// <port>-<id>.<domain>, so that an SDK configured by E2B_DOMAIN alone
	// (and the CA) works. The domain is then cube.localhost:<route port>
	// unless Domain says otherwise. The certificate is TLSCert/TLSKey
	// when given, else issued from the cluster CA at every start.
	DomainMode      bool
	TLSCert, TLSKey string
	// Template is imported when the node lacks it; TemplateSource is its
	// OCI layout (empty = the busybox image built from busybox-static).
	Template       string
	TemplateSource string
	// Imports are more templates (ID -> OCI layout or image tar) imported
	// when the node lacks them.
	Imports map[string]string
	// Extra TOML appended to the generated daemon configs (settings the
	// flags do not cover; tests use it for private cgroups and ports).
	ExtraMasterTOML  string
	ExtraCubeletTOML string
	ExtraNetworkTOML string
	// Out receives the environment and the sample; Log the progress.
	Out io.Writer
	Log *slog.Logger
}

// ErrAlreadyRunning: another `cube up` holds the lock.
var ErrAlreadyRunning = errors.New("cube is already running")

func (cfg *Config) launcherDir() string  { return filepath.Join(cfg.StateDir, "launcher") }
func (cfg *Config) masterSocket() string { return filepath.Join(cfg.RunDir, "cubemaster.sock") }
func (cfg *Config) cubeletSocket() string {
	return filepath.Join(cfg.RunDir, "cubelet.sock")
}
func (cfg *Config) envFile() string { return filepath.Join(cfg.launcherDir(), "env") }

func (cfg *Config) domain() string {
	if cfg.Domain != "" {
		return cfg.Domain
	}
	_, port, _ := net.SplitHostPort(cfg.ProxyAddr)
	if cfg.DomainMode {
		// Two labels: TLS clients refuse a wildcard over a single label
		// (*.localhost), and RFC 6761 keeps *.localhost on loopback.
		return DefaultLocalDomain + ":" + port
	}
	return "localhost:" + port
}

// DefaultLocalDomain is the domain of domain mode unless Domain says
// otherwise (with the route's port after it).
const DefaultLocalDomain = "cube.localhost"

// hostURL is a listen address as clients on this machine reach it.
func hostURL(addr string) string {
	host, port, _ := net.SplitHostPort(addr)
	if host == "" || host == "0.0.0.0" || host == "::" {
		host = "127.0.0.1"
	}
	return "http://" + net.JoinHostPort(host, port)
}

// lock takes the one-launcher lock, or returns ErrAlreadyRunning.
func (cfg *Config) lock() (*os.File, error) {
	f, err := os.OpenFile(filepath.Join(cfg.RunDir, "cube-up.lock"), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return nil, err
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			return nil, ErrAlreadyRunning
		}
		return nil, err
	}
	return f, nil
}

// Up runs the system until ctx ends, then stops the daemons (sandboxes
// keep running).
func Up(ctx context.Context, cfg Config) error {
	log := cfg.Log
	for _, d := range []string{cfg.StateDir, cfg.RunDir, cfg.LogDir, cfg.launcherDir()} {
		if err := os.MkdirAll(d, 0o711); err != nil {
			return err
		}
	}
	lockf, err := cfg.lock()
	if err != nil {
		return err
	}
	defer lockf.Close()
	pidFile := filepath.Join(cfg.RunDir, "cube-up.pid")
	_ = os.WriteFile(pidFile, []byte(strconv.Itoa(os.Getpid())+"\n"), 0o644)
	defer os.Remove(pidFile)

	for _, b := range []string{"cubelet", "cubemaster", "cube-agent"} {
		if _, err := os.Stat(filepath.Join(cfg.BinDir, b)); err != nil {
			return fmt.Errorf("%s not found in %s (make build): %w", b, cfg.BinDir, err)
		}
	}
	withNetwork := false
	if _, err := os.Stat(filepath.Join(cfg.BinDir, "network-agent")); err == nil {
		withNetwork = true
	}
	masterCfg, cubeletCfg, err := cfg.writeConfigs(withNetwork)
	if err != nil {
		return err
	}
	netCfg := filepath.Join(cfg.launcherDir(), "network-agent.toml")
	if withNetwork {
		// Its state follows the launcher's directories; the rest (node
		// CIDR, pool) keeps network-agent's defaults.
		nt := fmt.Sprintf("# Written by cube up; regenerated at every start.\nrun_dir = %q\ndata_dir = %q\n[api]\nsocket = %q\n",
			filepath.Join(cfg.RunDir, "network"), filepath.Join(cfg.StateDir, "network"), filepath.Join(cfg.RunDir, "network-agent.sock"))
		if nt, err = mergeTOML(nt, cfg.ExtraNetworkTOML); err != nil {
			return fmt.Errorf("extra network-agent config: %w", err)
		}
		if err := os.WriteFile(netCfg, []byte(nt), 0o600); err != nil {
			return err
		}
	}

	var children []*child
	defer func() {
		// Reverse order: cubelet first (it talks to the others).
		for i := len(children) - 1; i >= 0; i-- {
			children[i].stop(20 * time.Second)
		}
	}()
	superCtx, cancelSuper := context.WithCancel(ctx)
	defer cancelSuper()
	start := func(name string, args ...string) (*child, error) {
		logf, err := os.OpenFile(filepath.Join(cfg.LogDir, name+".log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o640)
		if err != nil {
			return nil, err
		}
		out := io.MultiWriter(logf, &prefixWriter{w: os.Stderr, prefix: []byte("[" + name + "] ")})
		c := &child{name: name, path: filepath.Join(cfg.BinDir, name), args: args, out: out, log: log}
		if err := c.start(); err != nil {
			return nil, err
		}
		children = append(children, c)
		go c.supervise(superCtx)
		return c, nil
	}
	if withNetwork {
		if _, err := start("network-agent", "--config", netCfg); err != nil {
			return err
		}
	}
	if _, err := start("cubemaster", "--config", masterCfg); err != nil {
		return err
	}
	admin, closeAdmin, err := dial(cfg.masterSocket())
	if err != nil {
		return err
	}
	defer closeAdmin()
	adminc := masterpb.NewAdminServiceClient(admin)
	if err := waitFor(ctx, time.Minute, "cubemaster", func(ctx context.Context) error {
		_, err := adminc.ListNodes(ctx, &masterpb.ListNodesRequest{})
		return err
	}); err != nil {
		return err
	}
	if _, err := start("cubelet", "--config", cubeletCfg); err != nil {
		return err
	}
	node, err := cubeletclient.Dial(cfg.cubeletSocket())
	if err != nil {
		return err
	}
	defer node.Close()
	nodec := cubeletclient.New(node)
	// The first start makes the storage pool: allow it time.
	if err := waitFor(ctx, 5*time.Minute, "cubelet", func(ctx context.Context) error {
		_, err := nodec.Health(ctx, &cubeletpb.HealthRequest{})
		return err
	}); err != nil {
		return err
	}
	if err := cfg.ensureTemplate(ctx, nodec, cfg.Template, cfg.TemplateSource); err != nil {
		return err
	}
	for id, src := range cfg.Imports {
		if err := cfg.ensureTemplate(ctx, nodec, id, src); err != nil {
			return err
		}
	}
	// Up only once a create of the default template can succeed: the
	// node healthy and its report (a heartbeat after the import) naming
	// the template.
	if err := waitFor(ctx, time.Minute, "the node to register with cubemaster", func(ctx context.Context) error {
		resp, err := adminc.ListNodes(ctx, &masterpb.ListNodesRequest{})
		if err != nil {
			return err
		}
		for _, n := range resp.Nodes {
			if !n.Healthy {
				continue
			}
			for _, tr := range n.GetReport().GetTemplates() {
				if tr.GetId() == cfg.Template {
					return nil
				}
			}
		}
		return fmt.Errorf("no healthy node reports template %s yet", cfg.Template)
	}); err != nil {
		return err
	}
	key, err := cfg.ensureKey(ctx, adminc)
	if err != nil {
		return err
	}
	env := cfg.environment(key)
	if err := os.WriteFile(cfg.envFile(), []byte(exportLines(env)), 0o600); err != nil {
		return err
	}
	PrintEnv(cfg.Out, env, cfg.envFile())
	log.Info("cube is up; Ctrl-C stops the daemons (sandboxes keep running)")
	<-ctx.Done()
	log.Info("stopping")
	return nil
}

func dial(sock string) (*grpc.ClientConn, func(), error) {
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, nil, err
	}
	return conn, func() { conn.Close() }, nil
}

// waitFor polls fn (with a per-call timeout) until it succeeds.
func waitFor(ctx context.Context, d time.Duration, what string, fn func(context.Context) error) error {
	deadline := time.Now().Add(d)
	var last error
	for time.Now().Before(deadline) {
		cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		last = fn(cctx)
		cancel()
		if last == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
	return fmt.Errorf("waiting for %s: %w", what, last)
}

// writeConfigs writes the daemons' configs: only what differs from their
// embedded defaults.
func (cfg *Config) writeConfigs(withNetwork bool) (master, cubelet string, err error) {
	master = filepath.Join(cfg.launcherDir(), "cubemaster.toml")
	cubelet = filepath.Join(cfg.launcherDir(), "cubelet.toml")
	domainMode := ""
	if cfg.DomainMode {
		route, err := cfg.routeCertificate()
		if err != nil {
			return "", "", err
		}
		domainMode = fmt.Sprintf("api = true\ntls_cert = %q\ntls_key = %q\n", route.Cert, route.Key)
	}
	mt := fmt.Sprintf(`# Written by cube up; regenerated at every start.
[api]
e2b = %q
socket = %q
[proxy]
listen = %q
domain = %q
%s[catalog]
driver = "sqlite"
dsn = %q
[templates]
aliases = { base = %q }
store_dir = %q
`, cfg.APIAddr, cfg.masterSocket(), cfg.ProxyAddr, cfg.domain(), domainMode, filepath.Join(cfg.StateDir, "master", "catalog.db"), cfg.Template,
		filepath.Join(cfg.StateDir, "master", "templates"))
	ct := fmt.Sprintf(`# Written by cube up; regenerated at every start.
[node]
data_dir = %q
run_dir = %q
[api]
socket = %q
[master]
addr = %q
`, cfg.StateDir, cfg.RunDir, cfg.cubeletSocket(), "unix://"+cfg.masterSocket())
	if withNetwork {
		ct += "[network]\nagent_socket = " + strconv.Quote(filepath.Join(cfg.RunDir, "network-agent.sock")) + "\n"
	}
	if mt, err = mergeTOML(mt, cfg.ExtraMasterTOML); err != nil {
		return "", "", fmt.Errorf("extra cubemaster config: %w", err)
	}
	if ct, err = mergeTOML(ct, cfg.ExtraCubeletTOML); err != nil {
		return "", "", fmt.Errorf("extra cubelet config: %w", err)
	}
	// The component links go over the root-only sockets; the TCP
	// listeners (cubemaster's api.node, cubelet's api.tcp and api.metrics,
	// loopback by default) serve mutual TLS with the cluster's
	// certificates, so another local account cannot call them.
	id, err := nodeID(ct)
	if err != nil {
		return "", "", err
	}
	masterTLS, nodeTLS, err := cfg.certificates(id)
	if err != nil {
		return "", "", err
	}
	if mt, err = withTLS(mt, masterTLS); err != nil {
		return "", "", err
	}
	if ct, err = withTLS(ct, nodeTLS); err != nil {
		return "", "", err
	}
	if err := os.WriteFile(master, []byte(mt), 0o600); err != nil {
		return "", "", err
	}
	if err := os.WriteFile(cubelet, []byte(ct), 0o600); err != nil {
		return "", "", err
	}
	return master, cubelet, nil
}

// mergeTOML lays extra over base, table by table (a plain append would
// define a table twice, which TOML forbids).
func mergeTOML(base, extra string) (string, error) {
	if strings.TrimSpace(extra) == "" {
		return base, nil
	}
	var b, e map[string]any
	if err := toml.Unmarshal([]byte(base), &b); err != nil {
		return "", err
	}
	if err := toml.Unmarshal([]byte(extra), &e); err != nil {
		return "", err
	}
	merge(b, e)
	out, err := toml.Marshal(b)
	if err != nil {
		return "", err
	}
	return "# Written by cube up; regenerated at every start.\n" + string(out), nil
}

func merge(dst, src map[string]any) {
	for k, v := range src {
		if sm, ok := v.(map[string]any); ok {
			if dm, ok := dst[k].(map[string]any); ok {
				merge(dm, sm)
				continue
			}
		}
		dst[k] = v
	}
}

// ensureTemplate imports a template on every start; an empty source means
// the busybox image built from busybox-static. Imports are idempotent by
// image digest (a no-op when nothing changed) and rebuild the template
// when the node's cube-agent changed since, which VMs need: they boot the
// template's own copy of the agent.
func (cfg *Config) ensureTemplate(ctx context.Context, c cubeletpb.CubeletServiceClient, id, src string) error {
	if src == "" {
		var err error
		if src, err = testimage.Busybox(ctx, filepath.Join(cfg.StateDir, "images")); err != nil {
			return fmt.Errorf("build the default template image: %w", err)
		}
	}
	cfg.Log.Info("importing a template", "template", id, "source", src)
	stream, err := c.ImportTemplate(ctx, &cubeletpb.ImportTemplateRequest{TemplateId: id, Source: src})
	if err != nil {
		return err
	}
	for {
		if _, err := stream.Recv(); errors.Is(err, io.EOF) {
			return nil
		} else if err != nil {
			return fmt.Errorf("import template %s: %w", id, err)
		}
	}
}

const keyName = "cube-up"

// ensureKey returns the key the launcher keeps in <state>/launcher/api-key,
// making a new one when the file is missing or the master no longer has it.
func (cfg *Config) ensureKey(ctx context.Context, a masterpb.AdminServiceClient) (string, error) {
	path := filepath.Join(cfg.launcherDir(), "api-key")
	resp, err := a.ListAPIKeys(ctx, &masterpb.ListAPIKeysRequest{})
	if err != nil {
		return "", err
	}
	var stored *masterpb.APIKey
	for _, k := range resp.Keys {
		if k.Name == keyName {
			stored = k
		}
	}
	if b, err := os.ReadFile(path); err == nil {
		secret := strings.TrimSpace(string(b))
		if stored != nil && strings.HasPrefix(secret, stored.Prefix) {
			return secret, nil
		}
	}
	if stored != nil {
		if _, err := a.DeleteAPIKey(ctx, &masterpb.DeleteAPIKeyRequest{Key: stored.Id}); err != nil {
			return "", err
		}
	}
	created, err := a.CreateAPIKey(ctx, &masterpb.CreateAPIKeyRequest{Name: keyName})
	if err != nil {
		return "", err
	}
	if err := os.WriteFile(path, []byte(created.Secret+"\n"), 0o600); err != nil {
		return "", err
	}
	return created.Secret, nil
}

// Var is one environment variable to print.
type Var struct{ Name, Value string }

func (cfg *Config) environment(key string) []Var {
	if cfg.DomainMode {
		// E2B_DOMAIN alone: the SDKs derive https://api.<domain> and
		// https://<port>-<id>.<domain>; a URL variable would take over.
		env := []Var{{"E2B_DOMAIN", cfg.domain()}, {"E2B_API_KEY", key}}
		if cfg.TLSCert == "" {
			// The certificate is the route CA's: Node adds
			// NODE_EXTRA_CA_CERTS to its roots; Python (httpx, requests)
			// and OpenSSL replace theirs with SSL_CERT_FILE /
			// REQUESTS_CA_BUNDLE, hence a bundle of the system's roots
			// and the route CA.
			env = append(env, Var{"NODE_EXTRA_CA_CERTS", cfg.routeCACert()},
				Var{"SSL_CERT_FILE", cfg.caBundle()}, Var{"REQUESTS_CA_BUNDLE", cfg.caBundle()})
		}
		return env
	}
	return []Var{
		{"E2B_API_URL", hostURL(cfg.APIAddr)},
		{"E2B_SANDBOX_URL", hostURL(cfg.ProxyAddr)},
		{"E2B_DOMAIN", cfg.domain()},
		{"E2B_API_KEY", key},
	}
}

func exportLines(env []Var) string {
	var b strings.Builder
	for _, v := range env {
		fmt.Fprintf(&b, "export %s=%s\n", v.Name, v.Value)
	}
	return b.String()
}

// PrintEnv writes the environment and a sample to out.
func PrintEnv(out io.Writer, env []Var, envFile string) {
	vals := map[string]string{}
	for _, v := range env {
		vals[v.Name] = v.Value
	}
	if vals["E2B_API_URL"] == "" {
		printDomainEnv(out, env, vals, envFile)
		return
	}
	fmt.Fprintf(out, `
cube is up: an E2B-compatible API on %[1]s, sandboxes behind %[2]s.
Point an unmodified E2B SDK at it:

%[3]s
(also in %[4]s: source it)

Sample (Node, npm i e2b):
  node -e "const {Sandbox}=require('e2b');(async()=>{const s=await Sandbox.create();console.log(await s.commands.run('echo hi'));await s.kill()})()"

Or plain HTTP:
  curl -s -H "X-API-Key: $E2B_API_KEY" -H 'Content-Type: application/json' $E2B_API_URL/v2/sandboxes -d '{"templateID":"base"}'
  curl -s -H "X-API-Key: $E2B_API_KEY" $E2B_API_URL/v2/sandboxes
  curl -s -H "E2b-Sandbox-Id: <sandboxID>" -H "E2b-Sandbox-Port: 49983" -o /dev/null -w '%%{http_code}\n' $E2B_SANDBOX_URL/health

Operate it with cubecli (node ls, sandbox ls --all-nodes, apikey create NAME, template import --all-nodes).
`, vals["E2B_API_URL"], vals["E2B_SANDBOX_URL"], exportLines(env), envFile)
}

// printDomainEnv is PrintEnv in domain mode.
func printDomainEnv(out io.Writer, env []Var, vals map[string]string, envFile string) {
	host := domainHost(vals["E2B_DOMAIN"])
	fmt.Fprintf(out, `
cube is up in domain mode: the E2B API at https://api.%[1]s and sandboxes at
https://<port>-<sandboxID>.%[1]s, on one TLS listener. Point an unmodified E2B
SDK at it with E2B_DOMAIN alone (and the CA, when the route CA issued the
certificate):

%[2]s
(also in %[3]s: source it)

The names must resolve to this machine: *.localhost does through
systemd-resolved or nss-myhostname; otherwise add a wildcard to a local
resolver (dnsmasq: address=/%[4]s/127.0.0.1), or /etc/hosts lines for
api.%[4]s and each <port>-<sandboxID>.%[4]s. docs/proxy.md, "Domain mode".

Sample (Node, npm i e2b):
  node -e "const {Sandbox}=require('e2b');(async()=>{const s=await Sandbox.create();console.log(await s.commands.run('echo hi'));await s.kill()})()"
`, vals["E2B_DOMAIN"], exportLines(env), envFile, host)
}

// Env reads the environment of a running (or last) `cube up`.
func Env(cfg Config) ([]Var, error) {
	b, err := os.ReadFile(cfg.envFile())
	if err != nil {
		return nil, fmt.Errorf("no environment recorded (has cube up run?): %w", err)
	}
	var out []Var
	for _, line := range strings.Split(string(b), "\n") {
		name, val, ok := strings.Cut(strings.TrimPrefix(line, "export "), "=")
		if ok {
			out = append(out, Var{name, val})
		}
	}
	return out, nil
}

// Down signals a running `cube up` to stop and waits for it.
func Down(cfg Config, timeout time.Duration) error {
	b, err := os.ReadFile(filepath.Join(cfg.RunDir, "cube-up.pid"))
	if err != nil {
		return fmt.Errorf("cube is not running: %w", err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		return fmt.Errorf("bad pid file: %w", err)
	}
	if err := unix.Kill(pid, unix.SIGTERM); err != nil {
		return fmt.Errorf("signal cube up (pid %d): %w", pid, err)
	}
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		if err := unix.Kill(pid, 0); errors.Is(err, unix.ESRCH) {
			return nil
		}
		time.Sleep(100 * time.Millisecond)
	}
	return fmt.Errorf("cube up (pid %d) still running after %s", pid, timeout)
}
