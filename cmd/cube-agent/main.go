// Command cube-agent runs inside every sandbox, as PID 1 in containers:
// it reaps zombies, forwards signals and serves the envd-compatible API.
package main

import (
	"context"
	"flag"
	"log/slog"
	"os"

	"github.com/cubesandbox/cube/internal/agent"
	"github.com/cubesandbox/cube/internal/agent/initproc"
)

func main() {
	addr := flag.String("addr", agent.DefaultAddr, "listen address of the agent API")
	flag.Parse()

	log := slog.New(slog.NewTextHandler(os.Stderr, nil)).With("component", "cube-agent")
	slog.SetDefault(log)

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	reaper := initproc.NewReaper(log)
	srv := agent.New(agent.Config{Addr: *addr, Logger: log})

	serveErr := make(chan error, 1)
	go func() {
		err := srv.Run(ctx)
		if err != nil {
			log.Error("agent server stopped", "error", err)
		}
		serveErr <- err
		// Without its API the sandbox is useless; stop supervising so
		// the process exits and the runtime reports the sandbox dead.
		cancel()
	}()

	err := initproc.Supervise(ctx, initproc.Config{Reaper: reaper, Logger: log})
	cancel()
	if serr := <-serveErr; serr != nil {
		os.Exit(1)
	}
	if err != nil && ctx.Err() == nil {
		log.Error("supervise", "error", err)
		os.Exit(1)
	}
}
