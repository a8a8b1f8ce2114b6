// Command cube-agent runs inside every sandbox, as PID 1 in containers:
// it reaps zombies, forwards signals and serves the envd-compatible API.
package main

import (
	"context"
	"crypto/sha256"
	"flag"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"

	"github.com/cubesandbox/cube/internal/agent"
	"github.com/cubesandbox/cube/internal/agent/initproc"
	"github.com/cubesandbox/cube/internal/agent/logring"
	"github.com/cubesandbox/cube/internal/agentproto"
)

// version is set at build time (-ldflags "-X main.version=...").
var version = "dev"

func main() {
	addr := flag.String("addr", agent.DefaultAddr, "listen address of the agent API")
	user := flag.String("default-user", "user", "user for requests that name none, until /init sets one (root when the sandbox lacks it)")
	vm := flag.Bool("vm", false, "run as PID 1 of a VM: mount, name and network the guest from cube.* kernel parameters, and serve on the agent channel too")
	flag.Parse()
	// What the runtime set for this process's Go runtime alone (read at
	// its start) goes before anything can inherit it.
	for _, k := range strings.Split(os.Getenv(agentproto.AgentOnlyEnv), ",") {
		if k != "" {
			os.Unsetenv(k)
		}
	}
	os.Unsetenv(agentproto.AgentOnlyEnv)

	// First: nothing in the sandbox may read the agent's environment or
	// write to its console through /proc before it is protected.
	protectErr := protectSelf()
	console := newCappedConsole(os.Stderr, consoleMax, consoleKeep)
	// The agent's log goes to the console and into the sandbox's log
	// (GET /_cube/logs), beside the output of the processes it starts.
	logs := logring.New(agent.DefaultLogBytes)
	log, quietConsole := newLog(console, logs.Writer(agentproto.LogEntry{Source: agentproto.LogSourceAgent, Stream: "stderr"}))
	slog.SetDefault(log)
	if protectErr != nil {
		log.Error("protect the agent from its sandbox", "error", protectErr)
		os.Exit(1)
	}
	// The access token's verifier, before anything serves: a sandbox
	// created with a token never answers without it. Taken out of the
	// environment so that nothing the agent starts inherits it.
	tokenHash, hasHash := os.LookupEnv(agentproto.TokenHashEnv)
	os.Unsetenv(agentproto.TokenHashEnv)
	resolver := os.Getenv(agentproto.ResolverEnv)
	os.Unsetenv(agentproto.ResolverEnv)
	var egressCA []byte
	if v := os.Getenv(agentproto.EgressCAEnv); v != "" {
		var err error
		if egressCA, err = agentproto.DecodeCA(v); err != nil {
			log.Error("egress CA", "error", err)
		}
	}
	os.Unsetenv(agentproto.EgressCAEnv)
	if *vm {
		h, r, ca, err := vmSetup(log)
		if err != nil {
			log.Error("vm setup", "error", err)
			os.Exit(1)
		}
		tokenHash, hasHash, resolver, egressCA = h, h != "", r, ca
	}
	if resolver != "" {
		// Not fatal: a sandbox whose image keeps /etc read-only still
		// serves, it just resolves nothing.
		if err := agent.WriteResolvConf(agent.ResolvConfPath, resolver); err != nil {
			log.Error("write resolv.conf", "error", err)
		}
	}
	if len(egressCA) > 0 {
		// Not fatal either: without it only hosts whose TLS the egress
		// proxy terminates (credential rules) fail verification.
		bundle, err := agent.InstallCA("/", egressCA)
		if err != nil {
			log.Error("install the egress CA", "error", err)
		}
		if bundle != "" {
			// Before SandboxEnv below: what the sandbox's processes get.
			for k, v := range agent.TrustEnv(bundle) {
				if _, set := os.LookupEnv(k); !set {
					os.Setenv(k, v)
				}
			}
		}
	}
	var verifier *[sha256.Size]byte
	if hasHash {
		h, err := agent.ParseTokenHash(tokenHash)
		if err != nil {
			// Fail closed: serving without the token is what a verifier
			// in the spec asks never to happen.
			log.Error("access token", "error", err)
			os.Exit(1)
		}
		verifier = &h
	}

	// Before anything serves or starts: nothing the agent starts may
	// inherit CAP_SYS_ADMIN where the runtime granted it to PID 1 only.
	if os.Getenv(agentproto.DropSysAdminEnv) == "1" {
		if err := agent.DropSysAdminBound(); err != nil {
			log.Error("drop CAP_SYS_ADMIN", "error", err)
			os.Exit(1)
		}
		os.Unsetenv(agentproto.DropSysAdminEnv)
	}

	workdir := os.Getenv(agentproto.WorkdirEnv)
	os.Unsetenv(agentproto.WorkdirEnv)
	if workdir != "" && !filepath.IsAbs(workdir) {
		log.Warn("ignoring a relative template working directory", "workdir", workdir)
		workdir = ""
	}

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	// The Reaper is the only waiter in this process: the processes the
	// API starts go through it too, so PID 1's reaping never steals their
	// exit statuses.
	var listening []func()
	if os.Getenv(agentproto.DetachConsoleEnv) == "1" {
		os.Unsetenv(agentproto.DetachConsoleEnv)
		listening = append(listening, func() {
			if err := console.detach(1, 2); err != nil {
				log.Error("detach from the console", "error", err)
			}
		})
	}
	if *vm {
		// A VM's console is an emulated UART: under TCG a log line
		// costs the guest ~2 ms of its vCPU (one exit per byte), on a
		// claim's reinit too, and once cubelet has seen the agent
		// answer it seals the console into a ring inside QEMU that
		// nothing reads. From here the console gets warnings and
		// errors only; the sandbox's log keeps every line.
		listening = append(listening, quietConsole)
	}
	onListening := func() {
		for _, f := range listening {
			f()
		}
	}
	reaper := initproc.NewReaper(log)
	srv := agent.New(agent.Config{
		Addr: *addr, Logger: log, Starter: reaper, DefaultUser: *user, DefaultWorkdir: workdir, Version: version,
		Env: agent.SandboxEnv(os.Environ()), OnListening: onListening, TokenHash: verifier, Logs: logs,
	})

	// The TCP port is bound before the channel serves: cubelet takes a VM
	// as ready once the agent answers on the channel, and the control
	// plane's next call comes over TCP through the TAP. Bound later (the
	// goroutines below run in no set order, and a TCG vCPU can stall for
	// tens of ms), that call could meet a guest that resets it.
	ln, err := srv.Listen()
	if err != nil {
		log.Error("agent server", "error", err)
		os.Exit(1)
	}
	if *vm {
		go serveChannel(ctx, srv.Handler(), log)
	}

	serveErr := make(chan error, 1)
	go func() {
		err := srv.Serve(ctx, ln)
		if err != nil {
			log.Error("agent server stopped", "error", err)
		}
		serveErr <- err
		// Without its API the sandbox is useless; stop supervising so
		// the process exits and the runtime reports the sandbox dead.
		cancel()
	}()

	err = initproc.Supervise(ctx, initproc.Config{Reaper: reaper, Logger: log})
	cancel()
	if serr := <-serveErr; serr != nil {
		os.Exit(1)
	}
	if err != nil && ctx.Err() == nil {
		log.Error("supervise", "error", err)
		os.Exit(1)
	}
}

// newLog is the agent's logger: every line to the sandbox's log (ring),
// and to the console until quietConsole, warnings and errors after.
func newLog(console, ring io.Writer) (log *slog.Logger, quietConsole func()) {
	level := new(slog.LevelVar)
	log = slog.New(slog.NewMultiHandler(
		slog.NewTextHandler(console, &slog.HandlerOptions{Level: level}),
		slog.NewTextHandler(ring, nil),
	)).With("component", "cube-agent")
	return log, func() { level.Set(slog.LevelWarn) }
}
