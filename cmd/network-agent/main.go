// Command network-agent is the node's network daemon: sandbox network
// slots, IPAM, egress policy and reconcile. It only wires flags and config
// to package agent and its gRPC/HTTP edge.
package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"syscall"

	"github.com/cubesandbox/cube/internal/failpoint"
	"github.com/cubesandbox/cube/internal/network/agent"
	"github.com/cubesandbox/cube/internal/network/agentapi"
)

func main() {
	cfgPath := flag.String("config", "", "TOML config merged over the embedded defaults")
	printCfg := flag.Bool("print-config", false, "print the embedded default config and exit")
	purge := flag.Bool("purge", false, "release every slot and remove the host rules, then exit (uninstall)")
	debug := flag.Bool("debug", false, "debug logging")
	flag.Parse()
	if *printCfg {
		os.Stdout.Write(agent.DefaultTOML())
		return
	}
	level := slog.LevelInfo
	if *debug {
		level = slog.LevelDebug
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
	slog.SetDefault(log)
	if err := run(*cfgPath, *purge, log); err != nil {
		log.Error("network-agent failed", "err", err)
		os.Exit(1)
	}
}

func run(cfgPath string, purge bool, log *slog.Logger) error {
	if err := failpoint.LoadEnv(); err != nil {
		return err
	}
	cfg, err := agent.LoadConfig(cfgPath)
	if err != nil {
		return err
	}
	if purge {
		cfg.Pool.Size, cfg.Pool.VMSize = 0, 0
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	a, err := agent.New(ctx, cfg, log)
	if err != nil {
		return err
	}
	defer a.Close()
	if purge {
		if err := a.Purge(ctx); err != nil {
			return fmt.Errorf("purge: %w", err)
		}
		log.Info("every slot released and host rules removed")
		return nil
	}
	if err := agentapi.Serve(ctx, a, log); err != nil {
		return fmt.Errorf("serve: %w", err)
	}
	log.Info("network-agent stopped; slots stay for the sandboxes that use them")
	return nil
}
