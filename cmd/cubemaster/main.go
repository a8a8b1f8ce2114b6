// Command cubemaster is the control plane: node registry, scheduler, SQL
// catalog, deadlines, the E2B-compatible REST API and the built-in sandbox
// route. It only wires flags and config to package server.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/cubesandbox/cube/internal/failpoint"
	"github.com/cubesandbox/cube/internal/master"
	"github.com/cubesandbox/cube/internal/master/opsapi"
	"github.com/cubesandbox/cube/internal/master/server"
)

func main() {
	cfgPath := flag.String("config", "", "TOML config merged over the embedded defaults")
	printCfg := flag.Bool("print-config", false, "print the embedded default config and exit")
	debug := flag.Bool("debug", false, "debug logging (one line per API request)")
	hashPw := flag.Bool("hash-password", false, "read a password on stdin, print its bcrypt hash for console.admin_password_hash and exit")
	flag.Parse()
	if *printCfg {
		os.Stdout.Write(master.DefaultTOML())
		return
	}
	if *hashPw {
		pw, err := io.ReadAll(io.LimitReader(os.Stdin, 1024))
		if err != nil {
			fmt.Fprintln(os.Stderr, "cubemaster:", err)
			os.Exit(1)
		}
		h, err := opsapi.HashPassword(strings.TrimRight(string(pw), "\r\n"))
		if err != nil {
			fmt.Fprintln(os.Stderr, "cubemaster:", err)
			os.Exit(1)
		}
		fmt.Println(h)
		return
	}
	level := slog.LevelInfo
	if *debug {
		level = slog.LevelDebug
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
	slog.SetDefault(log)
	if err := failpoint.LoadEnv(); err != nil {
		log.Error("cubemaster: "+failpoint.EnvVar, "err", err)
		os.Exit(1)
	}
	cfg, err := master.LoadConfig(*cfgPath)
	if err != nil {
		log.Error("cubemaster: config", "err", err)
		os.Exit(1)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	srv, err := server.Start(ctx, cfg, log)
	if err != nil {
		log.Error("cubemaster failed to start", "err", err)
		os.Exit(1)
	}
	if err := srv.Wait(); err != nil {
		log.Error("cubemaster stopped with an error", "err", err)
		os.Exit(1)
	}
	log.Info("cubemaster stopped; sandboxes keep running")
}
