// Command cube runs a whole single-node system in one command:
//
//	cube up     start network-agent (if built), cubemaster (E2B API +
//	            sandbox route) and cubelet, import the default template,
//	            print the E2B environment, keep serving until Ctrl-C
//	cube env    print the environment of the running system
//	cube down   stop a running `cube up` (sandboxes keep running)
//	cube pki STEP  rotate the cluster's certificates and CA under a running
//	            `cube up` (status, reissue, ca-begin, ca-promote, ca-finish)
//	cube join   on a new compute-only node: spend a join token (cubecli node
//	            join-token on the master) for this node's certificate
//
// It only wires flags to package launcher.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/cubesandbox/cube/internal/launcher"
	"github.com/cubesandbox/cube/internal/nodejoin"
)

func main() {
	if len(os.Args) < 2 {
		usage()
	}
	if os.Args[1] == "join" {
		join(os.Args[2:])
		return
	}
	exe, _ := os.Executable()
	cfg := launcher.Config{Out: os.Stdout}
	args := os.Args[2:]
	var pkiStep string
	if os.Args[1] == "pki" {
		if len(args) == 0 || strings.HasPrefix(args[0], "-") {
			fail("usage: cube pki status|reissue|ca-begin|ca-promote|ca-finish [--state-dir DIR]")
		}
		pkiStep, args = args[0], args[1:]
	}
	fs := flag.NewFlagSet("cube "+os.Args[1], flag.ExitOnError)
	fs.StringVar(&cfg.StateDir, "state-dir", "/var/lib/cube", "state: catalog, storage pool, configs, API key")
	fs.StringVar(&cfg.RunDir, "run-dir", "/run/cube", "sockets and the launcher lock")
	fs.StringVar(&cfg.LogDir, "log-dir", "/var/log/cube", "one log file per daemon")
	fs.StringVar(&cfg.BinDir, "bin-dir", filepath.Dir(exe), "where cubelet, cubemaster, cube-agent and network-agent are")
	fs.StringVar(&cfg.APIAddr, "api", "127.0.0.1:3000", "E2B API listen address (E2B_API_URL)")
	fs.StringVar(&cfg.ProxyAddr, "proxy", "127.0.0.1:8081", "sandbox route listen address (E2B_SANDBOX_URL)")
	fs.StringVar(&cfg.Domain, "domain", "", "sandbox host domain (E2B_DOMAIN); empty = localhost:<route port>")
	fs.BoolVar(&cfg.DomainMode, "domain-mode", false, "serve the E2B API at api.<domain> and sandboxes at <port>-<id>.<domain> on the route with TLS (E2B_DOMAIN alone); the domain is then cube.localhost:<route port> unless --domain says otherwise")
	fs.StringVar(&cfg.TLSCert, "tls-cert", "", "domain mode: the route's certificate (PEM, for <domain> and *.<domain>); empty = issued from the cluster CA at every start")
	fs.StringVar(&cfg.TLSKey, "tls-key", "", "domain mode: its key (PEM)")
	fs.StringVar(&cfg.Template, "template", "busybox", "default template (alias \"base\"), imported when missing")
	fs.StringVar(&cfg.TemplateSource, "template-source", "", "OCI layout or image tar for the default template; empty = build busybox from busybox-static")
	fs.Func("import", "ID=SOURCE: one more template imported when missing (repeatable)", func(v string) error {
		id, src, ok := strings.Cut(v, "=")
		if !ok || id == "" || src == "" {
			return fmt.Errorf("want ID=SOURCE, not %q", v)
		}
		if cfg.Imports == nil {
			cfg.Imports = map[string]string{}
		}
		cfg.Imports[id] = src
		return nil
	})
	masterExtra := fs.String("master-config", "", "TOML file merged over the generated cubemaster config")
	cubeletExtra := fs.String("cubelet-config", "", "TOML file merged over the generated cubelet config")
	debug := fs.Bool("debug", false, "debug logging")
	_ = fs.Parse(args)
	for _, x := range []struct {
		path string
		dst  *string
	}{{*masterExtra, &cfg.ExtraMasterTOML}, {*cubeletExtra, &cfg.ExtraCubeletTOML}} {
		if x.path != "" {
			b, err := os.ReadFile(x.path)
			if err != nil {
				fail(err.Error())
			}
			*x.dst = "\n" + string(b)
		}
	}
	level := slog.LevelInfo
	if *debug {
		level = slog.LevelDebug
	}
	cfg.Log = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level})).With("component", "cube")

	switch os.Args[1] {
	case "up":
		if os.Geteuid() != 0 {
			fail("cube up must run as root (cubelet manages mounts, cgroups and runc)")
		}
		ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
		defer stop()
		err := launcher.Up(ctx, cfg)
		if errors.Is(err, launcher.ErrAlreadyRunning) {
			env, eerr := launcher.Env(cfg)
			if eerr != nil {
				fail(err.Error())
			}
			fmt.Fprintln(os.Stderr, "cube is already running; its environment:")
			launcher.PrintEnv(os.Stdout, env, filepath.Join(cfg.StateDir, "launcher", "env"))
			return
		}
		if err != nil {
			fail(err.Error())
		}
	case "env":
		env, err := launcher.Env(cfg)
		if err != nil {
			fail(err.Error())
		}
		for _, v := range env {
			fmt.Printf("export %s=%s\n", v.Name, v.Value)
		}
	case "pki":
		if err := launcher.PKI(cfg, pkiStep, os.Stdout); err != nil {
			fail(err.Error())
		}
	case "down":
		if err := launcher.Down(cfg, time.Minute); err != nil {
			fail(err.Error())
		}
	default:
		usage()
	}
}

// join is `cube join`: the node makes its key, the master's join listener
// signs a node certificate for it, and cubelet's [tls] lines are printed.
func join(args []string) {
	fs := flag.NewFlagSet("cube join", flag.ExitOnError)
	addr := fs.String("master", "", "the master's join listener, host:port (its join.listen)")
	token := fs.String("token", os.Getenv("CUBE_JOIN_TOKEN"), "the join token (cubecli node join-token; env CUBE_JOIN_TOKEN)")
	nodeID := fs.String("node-id", "", "this node's ID (cubelet's node.id); default the host name")
	hosts := fs.String("hosts", "", "comma-separated addresses this node is dialled at (its api.tcp and api.data hosts)")
	dir := fs.String("dir", "/var/lib/cube/pki", "where to write node.key (0600), node.crt, ca.crt and egress/ (the cluster's egress CA, for network-agent)")
	_ = fs.Parse(args)
	if *addr == "" || *token == "" || *hosts == "" {
		fail("usage: cube join --master HOST:PORT --token TOKEN --hosts ADDR[,ADDR] [--node-id ID] [--dir DIR]")
	}
	if *nodeID == "" {
		h, err := os.Hostname()
		if err != nil {
			fail(err.Error())
		}
		*nodeID = h
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	cert, key, ca, err := nodejoin.Join(ctx, *addr, *token, *nodeID, strings.Split(*hosts, ","), *dir)
	if err != nil {
		fail(err.Error())
	}
	fmt.Printf("# node %s joined; in cubelet's config:\n[node]\nid = %q\n[tls]\ncert = %q\nkey = %q\nca = %q\n", *nodeID, *nodeID, cert, key, ca)
	if ed := filepath.Join(*dir, nodejoin.EgressDir); fileExists(filepath.Join(ed, nodejoin.EgressCAFile)) {
		fmt.Printf("# in network-agent's config (the cluster's egress CA):\n[egress]\nca_dir = %q\n", ed)
	}
}

func fileExists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}

func usage() {
	fmt.Fprintln(os.Stderr, "usage: cube up|env|down|pki|join [flags]   (cube up -h for the flags)")
	os.Exit(2)
}

func fail(msg string) {
	fmt.Fprintln(os.Stderr, "cube:", msg)
	os.Exit(1)
}
