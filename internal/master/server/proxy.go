package server

import (
	"context"
	"log/slog"
	"net/http"

	masterpb "github.com/cubesandbox/cube/api/master/v1"
	"github.com/cubesandbox/cube/internal/cubeproxy"
	"github.com/cubesandbox/cube/internal/master"
)

// startProxy runs cubeproxy in-process, talking to this master over its
// admin socket exactly as a standalone replica would over TCP.
func (s *Server) startProxy(ctx context.Context, cfg *master.Config, api http.Handler, log *slog.Logger) error {
	// The master's certificate opens the nodes' data listeners.
	nodeTLS, err := cfg.TLS.Client("tls")
	if err != nil {
		return err
	}
	conn, err := cubeproxy.DialMaster(cfg.API.Socket, "", nil)
	if err != nil {
		return err
	}
	p, err := cubeproxy.Start(ctx, cubeproxy.Config{
		Listen: cfg.Proxy.Listen, Domain: cfg.Proxy.Domain, ID: "cubemaster",
		TLS:           cubeproxy.TLSConfig{CertFile: cfg.Proxy.TLSCert, KeyFile: cfg.Proxy.TLSKey, SelfSigned: cfg.Proxy.TLSSelfSigned},
		MetricsListen: cfg.Proxy.Metrics, NodeTLS: nodeTLS, API: api,
		Settings: cubeproxy.Settings{Listen: "proxy.listen", Metrics: "proxy.metrics", TLS: "proxy.tls_cert and proxy.tls_key (or proxy.tls_self_signed)"},
	}, masterpb.NewRouteServiceClient(conn), log.With("component", "cubeproxy"))
	if err != nil {
		conn.Close()
		return err
	}
	s.ProxyAddr, s.ProxyMetricsAddr, s.Proxy = p.Addr, p.MetricsAddr, p
	s.run(func() error {
		defer conn.Close()
		<-ctx.Done()
		return p.Stop()
	})
	return nil
}
