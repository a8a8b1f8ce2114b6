// Command cubeproxy is the sandbox data plane on its own: it routes
// <port>-<sandboxID>.<domain> hosts and E2b-Sandbox-Id/Port headers to
// sandboxes, with a route cache fed by cubemaster, auto-resume, TLS,
// Prometheus metrics and access logs (package cubeproxy). It only wires
// flags to that package; run as many replicas as you like.
package main

import (
	"context"
	"flag"
	"log/slog"
	"os"
	"os/signal"
	"syscall"

	masterpb "github.com/cubesandbox/cube/api/master/v1"
	"github.com/cubesandbox/cube/internal/cubeproxy"
	"github.com/cubesandbox/cube/internal/serve"
)

func main() {
	var cfg cubeproxy.Config
	flag.StringVar(&cfg.Listen, "listen", "127.0.0.1:8082", "proxy address")
	flag.StringVar(&cfg.Domain, "domain", "localhost", "sandbox host suffix: <port>-<sandboxID>.<domain>")
	flag.StringVar(&cfg.MetricsListen, "metrics", "", "address serving /metrics (the proxy address does not: its series name live sandboxes); empty = none")
	flag.StringVar(&cfg.ID, "id", "", "replica name in activity reports and route watches, unique among the proxies of a master (default host-pid)")
	flag.StringVar(&cfg.TLS.CertFile, "tls-cert", "", "TLS certificate (PEM)")
	flag.StringVar(&cfg.TLS.KeyFile, "tls-key", "", "TLS key (PEM)")
	flag.BoolVar(&cfg.TLS.SelfSigned, "tls-self-signed", false, "serve TLS with a self-signed certificate made at start (development)")
	masterAddr := flag.String("master", envOr("CUBEMASTER_ADDR", "/run/cube/cubemaster.sock"), "cubemaster's admin API: unix socket path or host:port; several replicas comma-separated")
	token := flag.String("admin-token", os.Getenv("CUBEMASTER_TOKEN"), "cubemaster's api.admin_token (host:port only)")
	var masterTLS serve.TLSFiles
	flag.StringVar(&masterTLS.Cert, "master-tls-cert", "", "certificate (PEM, signed by the cluster CA, role proxy) for a master at host:port with [tls] and for the nodes' data listeners")
	flag.StringVar(&masterTLS.Key, "master-tls-key", "", "its key (PEM)")
	flag.StringVar(&masterTLS.CA, "master-tls-ca", "", "the cluster CA (PEM) that signed the master's certificate")
	apiURL := flag.String("api", "", "domain mode: pass requests for api.<domain> on to this E2B API (a master's api.e2b, http(s)://host:port; https verified against --master-tls-ca when given); empty = none")
	debug := flag.Bool("debug", false, "debug logging")
	flag.Parse()
	level := slog.LevelInfo
	if *debug {
		level = slog.LevelDebug
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
	slog.SetDefault(log)
	tc, err := masterTLS.Client("--master-tls-*")
	if err != nil {
		log.Error("cubeproxy: master TLS", "err", err)
		os.Exit(1)
	}
	conn, err := cubeproxy.DialMaster(*masterAddr, *token, tc)
	if err != nil {
		log.Error("cubeproxy: master", "err", err)
		os.Exit(1)
	}
	defer conn.Close()
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	// The same certificate (role proxy) opens the nodes' data listeners.
	cfg.NodeTLS = tc
	if *apiURL != "" {
		if cfg.API, err = cubeproxy.APIUpstream(*apiURL, tc); err != nil {
			log.Error("cubeproxy: --api", "err", err)
			os.Exit(1)
		}
	}
	srv, err := cubeproxy.Start(ctx, cfg, masterpb.NewRouteServiceClient(conn), log)
	if err != nil {
		log.Error("cubeproxy failed to start", "err", err)
		os.Exit(1)
	}
	if err := srv.Wait(); err != nil {
		log.Error("cubeproxy stopped with an error", "err", err)
		os.Exit(1)
	}
}

func envOr(k, def string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return def
}
