// Command system runs a command (the Node control-plane suite) against a
// whole single-node cube: it builds cubelet, cubemaster and cube-agent,
// starts them with the launcher (`cube up`'s code) in private directories,
// ports and cgroups, with a template the E2B SDK can drive (busybox plus
// a bash shim), then runs the command with E2B_API_URL, E2B_SANDBOX_URL
// and E2B_API_KEY set, kills what the command left, stops the system,
// checks for leaks and exits with the command's status.
//
// For the tenancy spec it also makes three teams through the admin socket
// and gives the command a key of each: CUBE_E2E_TEAM_A_KEY,
// CUBE_E2E_TEAM_B_KEY and CUBE_E2E_QUOTA_KEY (a team whose quota is one
// sandbox).
//
// E2B_SANDBOX_URL is cubemaster's in-process cubeproxy; with
// -standalone-proxy it is a separate cmd/cubeproxy process instead.
//
// With -runtime gvisor or vm the node's default runtime is that one, with
// a network-agent (on a private link prefix and a random node CIDR) for
// the sandboxes' slots; vm builds the guest kernel and initramfs once
// (CUBE_VM_ACCEL: tcg by default). CUBE_E2E_RUNTIME tells the suite.
//
// With -template-builds the node runs a network-agent (on runc too) whose
// DNS forwards to the host's resolvers, so that a template build's
// sandbox reaches the package mirrors the host reaches (its allow list;
// docs/templates.md), and the Debian base image is built (or found) in
// $CUBE_BASE_CACHE for builds from it; CUBE_E2E_TEMPLATE_BUILDS=1 tells
// the suite.
//
// With -domain the system runs in domain mode (cube up --domain-mode): the
// route serves the E2B API at api.<domain> and the sandboxes at
// <port>-<id>.<domain> over TLS with a certificate from the cluster CA, the
// domain is unique to the run (<id>.cube.test:<route port>), and the
// command gets E2B_DOMAIN, E2B_API_KEY and the CA variables
// (NODE_EXTRA_CA_CERTS, SSL_CERT_FILE, REQUESTS_CA_BUNDLE) but no URL: it
// runs in a private mount namespace whose /etc/resolv.conf names a test
// resolver answering the domain and every name under it (domain.go).
//
// With -domain -standalone-proxy the domain is a separate cubeproxy's
// (--tls-cert with the route's certificate, --api passing api.<domain> on
// to the master's E2B API).
//
// With -code-interpreter it also imports the code-interpreter template
// (built once into $CUBE_BASE_CACHE, then cached) as code-interpreter-v1,
// the SDKs' default, and names it in CUBE_E2E_CODE_INTERPRETER.
//
//	go run ./test/e2e/node/system -- npm --prefix test/e2e/node run test:controlplane
//	go run ./test/e2e/node/system -standalone-proxy -- npm --prefix test/e2e/node run test:controlplane
//	go run ./test/e2e/node/system -runtime gvisor -- npm --prefix test/e2e/node run test:snapshots
//	go run ./test/e2e/node/system -egress -- npm --prefix test/e2e/node run test:egress
package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	masterpb "github.com/cubesandbox/cube/api/master/v1"
	"github.com/cubesandbox/cube/internal/launcher"
	"github.com/cubesandbox/cube/internal/leakcheck"
	"github.com/cubesandbox/cube/internal/storage"
	"github.com/cubesandbox/cube/internal/template/baseimage"
	"github.com/cubesandbox/cube/internal/testimage"
)

func main() {
	verbose := flag.Bool("v", false, "show the daemons' logs")
	flag.BoolVar(&standaloneProxy, "standalone-proxy", false, "point E2B_SANDBOX_URL at a separate cubeproxy process")
	flag.StringVar(&runtimeName, "runtime", "runc", "the node's default runtime: runc, gvisor or vm")
	flag.BoolVar(&templateBuilds, "template-builds", false, "run a network-agent with the host's DNS and build the Debian base, for template builds through the API")
	flag.BoolVar(&domainMode, "domain", false, "domain mode: E2B_DOMAIN alone over TLS, names from a test resolver")
	flag.BoolVar(&codeInterpreter, "code-interpreter", false, "also import the code-interpreter template (built from Debian, cached in $CUBE_BASE_CACHE)")
	flag.BoolVar(&egress, "egress", false, "run network-agent against a fake internet (the egress spec; CUBE_E2E_EGRESS)")
	flag.Usage = func() {
		fmt.Fprintln(os.Stderr, "usage: system [-v] -- command [args...]")
		flag.PrintDefaults()
	}
	flag.Parse()
	if flag.NArg() == 0 {
		flag.Usage()
		os.Exit(2)
	}
	if os.Geteuid() != 0 {
		fmt.Fprintln(os.Stderr, "system: needs root (loop devices, mounts, cgroups, runc)")
		os.Exit(2)
	}
	switch runtimeName {
	case "runc", "gvisor", "vm":
	default:
		fmt.Fprintf(os.Stderr, "system: -runtime %q: want runc, gvisor or vm\n", runtimeName)
		os.Exit(2)
	}
	level := slog.LevelWarn
	if *verbose {
		level = slog.LevelInfo
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level})).With("component", "e2e-system")
	os.Exit(run(flag.Args(), *verbose, log))
}

var (
	standaloneProxy bool
	runtimeName     string
	codeInterpreter bool
	templateBuilds  bool
	egress          bool
	domainMode      bool
)

// withNetworkAgent reports whether the node runs network-agent: gVisor
// and VM sandboxes are reached only through a slot; the egress spec and
// template builds (their egress allow list) need its policies.
func withNetworkAgent() bool { return runtimeName != "runc" || egress || templateBuilds }

func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

func freeAddr() (string, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer l.Close()
	return l.Addr().String(), nil
}

func build(dir string) error {
	bins := []string{"cubelet", "cubemaster", "cube-agent", "cubeproxy"}
	if withNetworkAgent() {
		// gVisor and VM sandboxes are reached only through a slot.
		bins = append(bins, "network-agent")
	}
	for _, b := range bins {
		cmd := exec.Command("go", "build", "-trimpath", "-o", filepath.Join(dir, b), "./cmd/"+b)
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("build %s (run from the repository root): %w\n%s", b, err, out)
		}
	}
	return nil
}

func run(command []string, verbose bool, log *slog.Logger) int {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	fail := func(err error) int {
		fmt.Fprintln(os.Stderr, "system:", err)
		return 1
	}
	id := randHex(4)
	var rtNode, rtTables string
	if runtimeName != "runc" {
		var err error
		if rtNode, rtTables, err = runtimeTOML(); err != nil {
			return fail(err)
		}
	}
	root := filepath.Join(os.TempDir(), "cube-e2e-system-"+id)
	bin := filepath.Join(root, "bin")
	if err := os.MkdirAll(bin, 0o755); err != nil {
		return fail(err)
	}
	cfg := launcher.Config{
		StateDir: filepath.Join(root, "state"), RunDir: filepath.Join(root, "run"), LogDir: filepath.Join(root, "log"), BinDir: bin,
		Template: "e2b", TemplateSource: filepath.Join(root, "image"),
		ExtraMasterTOML: "[api]\nnode = \"\"\n",
		ExtraCubeletTOML: fmt.Sprintf("[node]\nid = \"e2e-%[1]s\"\ncgroup_parent = \"cube-e2e-%[1]s\"\n%[2]s[api]\ntcp = \"\"\nmetrics = \"\"\n"+
			"[storage]\npool_image_size_mib = 4096\ntemplate_headroom_mib = 64\n[gc]\ninterval = \"200ms\"\n%[3]s", id, rtNode, rtTables),
		Out: io.Discard, Log: log,
	}
	scope := leakcheck.Scope{
		DataDir: cfg.StateDir, RunDir: cfg.RunDir, RuncRoot: filepath.Join(cfg.RunDir, "runc"), CgroupName: "cube-e2e-" + id,
		AllowMounts: []string{filepath.Join(cfg.StateDir, "pool")}, AllowLoopBacking: []string{filepath.Join(cfg.StateDir, "pool.img")},
	}
	if withNetworkAgent() {
		// A TCG VM boots in seconds when it gets a core; a fork restores
		// two of them at once.
		cfg.ExtraMasterTOML += "[sandbox]\ncreate_timeout = \"5m\"\n"
	}
	if withNetworkAgent() {
		prefix := "sy" + id[:6]
		// The sandboxes' DNS goes nowhere but to the egress world: the
		// host's resolvers are off the machine, which tests never reach
		// (loopback's discard port answers at once with a refusal).
		// Template builds are the exception: their sandboxes resolve the
		// package mirrors with the host's resolvers.
		dns := "127.0.0.1:9"
		if templateBuilds {
			dns = ""
		}
		cfg.ExtraNetworkTOML = networkTOML(prefix, dns, "")
		scope.NetPrefix, scope.NetnsDir = prefix, filepath.Join(cfg.RunDir, "network", "netns")
		scope.RunscRoot, scope.VMRoot = filepath.Join(cfg.RunDir, "runsc"), filepath.Join(cfg.RunDir, "vm")
	}
	defer func() {
		if p, err := storage.OpenPool(context.Background(), storage.PoolConfig{Dir: filepath.Join(cfg.StateDir, "pool"), ImageSizeBytes: 1 << 30}); err == nil {
			_ = p.Teardown(context.Background())
		}
		os.RemoveAll(root)
	}()
	if err := build(bin); err != nil {
		return fail(err)
	}
	if err := testimage.WriteE2BBusybox(cfg.TemplateSource); err != nil {
		return fail(err)
	}
	if templateBuilds {
		if err := buildBase(ctx); err != nil {
			return fail(err)
		}
	}
	var world *egressWorld
	if egress {
		var err error
		if world, err = startEgressWorld(bin, cfg.StateDir); err != nil {
			return fail(fmt.Errorf("egress world: %w", err))
		}
		defer func() {
			if err := world.stop(); err != nil {
				fmt.Fprintln(os.Stdout, "system: egress world:", err)
			}
		}()
		cfg.ExtraNetworkTOML = networkTOML(scope.NetPrefix, world.dns, world.AgentHTTP) + world.network
	}
	if codeInterpreter {
		res, err := buildCodeInterpreter(ctx, log)
		if err != nil {
			return fail(err)
		}
		cfg.Imports = map[string]string{baseimage.CodeInterpreterTemplate: res}
	}
	var err error
	if cfg.APIAddr, err = freeAddr(); err != nil {
		return fail(err)
	}
	if cfg.ProxyAddr, err = freeAddr(); err != nil {
		return fail(err)
	}
	var res *resolver
	standaloneAddr := ""
	if domainMode {
		_, port, _ := net.SplitHostPort(cfg.ProxyAddr)
		if standaloneProxy {
			// The domain is the standalone replica's: its port in
			// E2B_DOMAIN and in the API's create answers.
			if standaloneAddr, err = freeAddr(); err != nil {
				return fail(err)
			}
			_, port, _ = net.SplitHostPort(standaloneAddr)
		}
		cfg.DomainMode, cfg.Domain = true, id+".cube.test:"+port
		if res, err = startResolver(root, cfg.Domain); err != nil {
			return fail(err)
		}
		defer res.stop()
	}
	if !verbose {
		// The daemons' output goes to their log files only.
		devnull, _ := os.OpenFile(os.DevNull, os.O_WRONLY, 0)
		stderr := os.Stderr
		os.Stderr = devnull
		defer func() { os.Stderr = stderr }()
		log = slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
		cfg.Log = log
	}
	upCtx, cancelUp := context.WithCancel(ctx)
	defer cancelUp()
	upDone := make(chan error, 1)
	go func() { upDone <- launcher.Up(upCtx, cfg) }()
	var env map[string]string
	deadline := time.Now().Add(5 * time.Minute)
	for env == nil {
		select {
		case err := <-upDone:
			return fail(fmt.Errorf("cube up: %v (logs in %s)", err, cfg.LogDir))
		case <-time.After(200 * time.Millisecond):
		}
		if vars, err := launcher.Env(cfg); err == nil && healthy(cfg, vars) {
			env = map[string]string{}
			for _, v := range vars {
				env[v.Name] = v.Value
			}
		}
		if env != nil && domainMode {
			// The harness's own calls (cleanup) use the API listener.
			fmt.Fprintln(os.Stdout, "system: domain mode: E2B_DOMAIN="+env["E2B_DOMAIN"]+", names from the resolver at "+res.addr)
		}
		if time.Now().After(deadline) {
			cancelUp()
			return fail(fmt.Errorf("cube up did not come up in 5m (logs in %s)", cfg.LogDir))
		}
	}

	if standaloneProxy && domainMode {
		// Domain mode through a separate replica: the route's
		// certificate, and api.<domain> passed on to the master's API.
		pctx, stopProxy := context.WithCancel(ctx)
		defer stopProxy()
		pkiDir := filepath.Join(cfg.StateDir, "pki")
		p := exec.CommandContext(pctx, filepath.Join(bin, "cubeproxy"), "--master", filepath.Join(cfg.RunDir, "cubemaster.sock"),
			"--listen", standaloneAddr, "--domain", cfg.Domain, "--tls-cert", filepath.Join(pkiDir, "route.crt"),
			"--tls-key", filepath.Join(pkiDir, "route.key"), "--api", "http://"+cfg.APIAddr)
		p.Cancel = func() error { return p.Process.Signal(syscall.SIGTERM) }
		if verbose {
			p.Stderr = os.Stderr
		}
		if err := p.Start(); err != nil {
			return fail(err)
		}
		defer func() { stopProxy(); _ = p.Wait() }()
		for i := 0; ; i++ {
			if c, err := net.Dial("tcp", standaloneAddr); err == nil {
				c.Close()
				break
			}
			if i > 100 {
				return fail(fmt.Errorf("cubeproxy did not come up"))
			}
			time.Sleep(100 * time.Millisecond)
		}
		fmt.Fprintln(os.Stdout, "system: E2B_DOMAIN is a standalone cubeproxy (--api) at", standaloneAddr)
	} else if standaloneProxy {
		addr, err := freeAddr()
		if err != nil {
			return fail(err)
		}
		pctx, stopProxy := context.WithCancel(ctx)
		defer stopProxy()
		p := exec.CommandContext(pctx, filepath.Join(bin, "cubeproxy"), "--master", filepath.Join(cfg.RunDir, "cubemaster.sock"),
			"--listen", addr, "--domain", env["E2B_DOMAIN"])
		p.Cancel = func() error { return p.Process.Signal(syscall.SIGTERM) }
		if verbose {
			p.Stderr = os.Stderr
		}
		if err := p.Start(); err != nil {
			return fail(err)
		}
		defer func() { stopProxy(); _ = p.Wait() }()
		env["E2B_SANDBOX_URL"] = "http://" + addr
		for i := 0; ; i++ {
			if resp, err := http.Get(env["E2B_SANDBOX_URL"] + "/health"); err == nil {
				resp.Body.Close()
				break
			}
			if i > 100 {
				return fail(fmt.Errorf("cubeproxy did not come up"))
			}
			time.Sleep(100 * time.Millisecond)
		}
		fmt.Fprintln(os.Stdout, "system: E2B_SANDBOX_URL is a standalone cubeproxy at", env["E2B_SANDBOX_URL"])
	}
	teamKeys, err := makeTeams(ctx, filepath.Join(cfg.RunDir, "cubemaster.sock"))
	if err != nil {
		cancelUp()
		if upErr := <-upDone; upErr != nil {
			fmt.Fprintln(os.Stdout, "system: cube up:", upErr)
		}
		return fail(err)
	}
	apiURL := "http://" + cfg.APIAddr
	if res != nil {
		command = res.wrap(command)
	}
	cmd := exec.CommandContext(ctx, command[0], command[1:]...)
	cmd.Stdout, cmd.Stderr = os.Stdout, os.Stdout
	if domainMode {
		// E2B_DOMAIN alone: a URL variable left in the environment would
		// take over from it.
		for _, kv := range os.Environ() {
			if !strings.HasPrefix(kv, "E2B_API_URL=") && !strings.HasPrefix(kv, "E2B_SANDBOX_URL=") {
				cmd.Env = append(cmd.Env, kv)
			}
		}
		for k, v := range env {
			cmd.Env = append(cmd.Env, k+"="+v)
		}
		cmd.Env = append(cmd.Env, "CUBE_E2E_TEMPLATE="+cfg.Template, "CUBE_E2E_RUNTIME="+runtimeName, "CUBE_E2E_DOMAIN_MODE=1")
	} else {
		cmd.Env = append(os.Environ(), "E2B_API_URL="+env["E2B_API_URL"], "E2B_SANDBOX_URL="+env["E2B_SANDBOX_URL"],
			"E2B_API_KEY="+env["E2B_API_KEY"], "E2B_DOMAIN="+env["E2B_DOMAIN"], "CUBE_E2E_TEMPLATE="+cfg.Template,
			"CUBE_E2E_RUNTIME="+runtimeName)
	}
	if codeInterpreter {
		cmd.Env = append(cmd.Env, "CUBE_E2E_CODE_INTERPRETER="+baseimage.CodeInterpreterTemplate)
	}
	if templateBuilds {
		cmd.Env = append(cmd.Env, "CUBE_E2E_TEMPLATE_BUILDS=1")
	}
	if world != nil {
		cmd.Env = append(cmd.Env, world.env())
	}
	for name, key := range teamKeys {
		cmd.Env = append(cmd.Env, name+"="+key)
	}
	code := 0
	if err := cmd.Run(); err != nil {
		code = 1
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			code = ee.ExitCode()
		}
		fmt.Fprintf(os.Stdout, "system: command failed: %v (daemon logs in %s)\n", err, cfg.LogDir)
	}
	left := killAll(apiURL, env["E2B_API_KEY"])
	for _, key := range teamKeys {
		left += killAll(apiURL, key)
	}
	if left > 0 {
		fmt.Fprintf(os.Stdout, "system: the command left %d sandbox(es); killed\n", left)
	}
	cancelUp()
	if err := <-upDone; err != nil {
		fmt.Fprintln(os.Stdout, "system: cube up:", err)
		code = max(code, 1)
	}
	if withNetworkAgent() {
		// cube up leaves network-agent's slots for the next start, as it
		// leaves sandboxes: this run's go with it.
		out, err := exec.Command(filepath.Join(bin, "network-agent"), "--config",
			filepath.Join(cfg.StateDir, "launcher", "network-agent.toml"), "--purge").CombinedOutput()
		if err != nil {
			fmt.Fprintf(os.Stdout, "system: network-agent --purge: %v\n%s", err, out)
			code = max(code, 1)
		}
	}
	if code != 0 {
		// root goes when this returns: keep the daemons' logs.
		keep := root + "-logs"
		if err := exec.Command("cp", "-a", cfg.LogDir, keep).Run(); err == nil {
			fmt.Fprintln(os.Stdout, "system: daemon logs kept in", keep)
		}
	}
	if leaks, err := leakcheck.Check(context.Background(), scope); err != nil || len(leaks) > 0 {
		fmt.Fprintf(os.Stdout, "system: leaks after the run: %v %v\n", leaks, err)
		code = max(code, 1)
	}
	return code
}

// buildBase builds (or finds) the Debian base image in $CUBE_BASE_CACHE,
// where cubemaster's template builds find it (debian:stable, e2bdev/base).
func buildBase(ctx context.Context) error {
	dir := os.Getenv("CUBE_BASE_CACHE")
	if dir == "" {
		dir = "/var/cache/cube/base"
		os.Setenv("CUBE_BASE_CACHE", dir)
	}
	start := time.Now()
	res, err := baseimage.Build(ctx, baseimage.Options{Dir: dir})
	if err != nil {
		return fmt.Errorf("base image: %w", err)
	}
	fmt.Fprintf(os.Stdout, "system: base image %s (built: %v, %s)\n", res.Layout, res.Built, time.Since(start).Round(time.Millisecond))
	return nil
}

// buildCodeInterpreter returns the code-interpreter image's layout,
// building it when the cache ($CUBE_BASE_CACHE, /var/cache/cube/base by
// default) lacks it or an input changed; it logs how long that took.
func buildCodeInterpreter(ctx context.Context, log *slog.Logger) (string, error) {
	dir := os.Getenv("CUBE_BASE_CACHE")
	if dir == "" {
		dir = "/var/cache/cube/base"
	}
	start := time.Now()
	res, err := baseimage.Build(ctx, baseimage.CodeInterpreter(baseimage.Options{Dir: dir, Log: log}))
	if err != nil {
		return "", fmt.Errorf("code-interpreter image: %w", err)
	}
	fmt.Fprintf(os.Stdout, "system: code-interpreter image %s (built: %v, %s)\n", res.Layout, res.Built, time.Since(start).Round(time.Millisecond))
	return res.Layout, nil
}

// healthy reports whether the E2B API answers: cube up has written its
// environment (vars) and the API listener is serving.
func healthy(cfg launcher.Config, vars []launcher.Var) bool {
	if len(vars) == 0 {
		return false
	}
	resp, err := http.Get("http://" + cfg.APIAddr + "/health")
	if err != nil {
		return false
	}
	resp.Body.Close()
	return resp.StatusCode == 200
}

// makeTeams creates the tenancy spec's teams and a key of each, and
// returns the keys by the variable that carries them.
func makeTeams(ctx context.Context, socket string) (map[string]string, error) {
	conn, err := grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	a := masterpb.NewAdminServiceClient(conn)
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	out := map[string]string{}
	for _, t := range []struct {
		env, team string
		quota     *masterpb.TeamQuota
	}{
		{"CUBE_E2E_TEAM_A_KEY", "e2e-a", nil},
		{"CUBE_E2E_TEAM_B_KEY", "e2e-b", nil},
		{"CUBE_E2E_QUOTA_KEY", "e2e-quota", &masterpb.TeamQuota{MaxSandboxes: 1}},
	} {
		if _, err := a.CreateTeam(ctx, &masterpb.CreateTeamRequest{Name: t.team, Quota: t.quota}); err != nil {
			return nil, fmt.Errorf("create team %s: %w", t.team, err)
		}
		k, err := a.CreateAPIKey(ctx, &masterpb.CreateAPIKeyRequest{Name: t.team + "-key", Team: t.team})
		if err != nil {
			return nil, fmt.Errorf("create a key of team %s: %w", t.team, err)
		}
		out[t.env] = k.Secret
	}
	return out, nil
}

// killAll kills every sandbox a key sees through the API and returns how
// many.
func killAll(api, key string) int {
	req, _ := http.NewRequest("GET", api+"/v2/sandboxes", nil)
	req.Header.Set("X-API-Key", key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0
	}
	defer resp.Body.Close()
	var list []struct{ SandboxID string }
	_ = json.NewDecoder(resp.Body).Decode(&list)
	for _, s := range list {
		req, _ := http.NewRequest("DELETE", api+"/sandboxes/"+s.SandboxID, nil)
		req.Header.Set("X-API-Key", key)
		if r, err := http.DefaultClient.Do(req); err == nil {
			r.Body.Close()
		}
	}
	return len(list)
}
