// Command cubelet is the node daemon. It only wires flags and config to
// package cubelet and its gRPC edge.
package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"syscall"

	"github.com/cubesandbox/cube/internal/cubelet"
	"github.com/cubesandbox/cube/internal/cubelet/config"
	"github.com/cubesandbox/cube/internal/cubeletapi"
	"github.com/cubesandbox/cube/internal/failpoint"
)

func main() {
	cfgPath := flag.String("config", "", "TOML config merged over the embedded defaults")
	printCfg := flag.Bool("print-config", false, "print the embedded default config and exit")
	debug := flag.Bool("debug", false, "debug logging")
	flag.Parse()
	if *printCfg {
		os.Stdout.Write(config.DefaultTOML())
		return
	}
	level := slog.LevelInfo
	if *debug {
		level = slog.LevelDebug
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
	slog.SetDefault(log)
	if err := run(*cfgPath, log); err != nil {
		log.Error("cubelet failed", "err", err)
		os.Exit(1)
	}
}

func run(cfgPath string, log *slog.Logger) error {
	if err := failpoint.LoadEnv(); err != nil {
		return err
	}
	cfg, err := config.Load(cfgPath)
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	svc, err := cubelet.New(ctx, cfg, log)
	if err != nil {
		return err
	}
	defer svc.Close()

	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	go func() {
		for range hup {
			next, err := config.Load(cfgPath)
			if err == nil {
				err = svc.ReloadFlows(next)
			}
			if err != nil {
				log.Error("reload refused", "err", err)
				continue
			}
			log.Info("flows reloaded")
		}
	}()
	if err := cubeletapi.Serve(ctx, svc, log); err != nil {
		return fmt.Errorf("serve: %w", err)
	}
	log.Info("cubelet stopped; sandboxes keep running")
	return nil
}
