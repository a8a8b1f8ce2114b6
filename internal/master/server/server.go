// Package server runs a whole cubemaster: the service and its three edges
// (the node/admin gRPC API, the E2B REST API, the built-in data-plane
// route). cmd/cubemaster and the tests start it the same way.
package server

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync"

	"github.com/cubesandbox/cube/internal/cubeproxy"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/master"
	"github.com/cubesandbox/cube/internal/master/e2bapi"
	"github.com/cubesandbox/cube/internal/master/joinapi"
	"github.com/cubesandbox/cube/internal/master/nodeapi"
	"github.com/cubesandbox/cube/internal/master/opsapi"
	"github.com/cubesandbox/cube/internal/proxy"
	"github.com/cubesandbox/cube/internal/serve"
)

// Server is a running cubemaster.
type Server struct {
	Service *master.Service
	// Addresses actually bound (useful when the config says port 0).
	E2BAddr, ProxyAddr string
	// ProxyMetricsAddr is the in-process cubeproxy's /metrics listener
	// (proxy.metrics), "" when none.
	ProxyMetricsAddr string
	// JoinAddr is the join listener (join.listen), "" when none.
	JoinAddr string
	// OpsAddr is CubeOps (api.ops), "" when none.
	OpsAddr string
	// Proxy is the in-process cubeproxy (nil when the plain route runs).
	Proxy *cubeproxy.Server

	cancel context.CancelFunc
	wg     sync.WaitGroup
	mu     sync.Mutex
	errs   []error
}

// Start opens the catalog and serves every configured listener. Stop (or
// ctx ending) shuts it down.
func Start(ctx context.Context, cfg *master.Config, log *slog.Logger, opts ...master.Option) (*Server, error) {
	if log == nil {
		log = slog.Default()
	}
	svc, err := master.New(ctx, cfg, log, opts...)
	if err != nil {
		return nil, err
	}
	var lis []net.Listener
	listen := func(setting, tlsSetting, addr string, tc *tls.Config) (net.Listener, error) {
		l, err := serve.ListenTCP(setting, tlsSetting, addr, tc != nil)
		if err != nil {
			for _, l := range lis {
				l.Close()
			}
			svc.Close()
			return nil, err
		}
		if tc != nil {
			l = tls.NewListener(l, tc)
		}
		lis = append(lis, l)
		return l, nil
	}
	e2bTLS, err := serve.ServerCert("api.e2b_tls_cert", cfg.API.E2BTLSCert, cfg.API.E2BTLSKey)
	if err != nil {
		svc.Close()
		return nil, err
	}
	var e2bLn, proxyLn, opsLn net.Listener
	if cfg.API.E2B != "" {
		if e2bLn, err = listen("api.e2b", "api.e2b_tls_cert and api.e2b_tls_key", cfg.API.E2B, e2bTLS); err != nil {
			return nil, err
		}
	}
	if cfg.API.Ops != "" {
		if opsLn, err = listen("api.ops", "api.e2b_tls_cert and api.e2b_tls_key", cfg.API.Ops, e2bTLS); err != nil {
			return nil, err
		}
	}
	if cfg.Proxy.API && (cfg.API.E2B == "" || cfg.API.Socket == "" || cfg.Proxy.Listen == "" || cfg.Proxy.Domain == "") {
		svc.Close()
		for _, l := range lis {
			l.Close()
		}
		return nil, fmt.Errorf("proxy.api serves the E2B API at api.<proxy.domain> on proxy.listen through the in-process cubeproxy: it needs api.e2b, api.socket, proxy.listen and proxy.domain: %w", errdefs.ErrInvalidArgument)
	}
	// With an admin socket, the route is cubeproxy in-process: it listens
	// itself, below, once the socket is served.
	inProcessProxy := cfg.Proxy.Listen != "" && cfg.API.Socket != ""
	if cfg.Proxy.Listen != "" && !inProcessProxy {
		// The plain route (no api.socket) serves no TLS.
		if proxyLn, err = listen("proxy.listen", "api.socket (the route with TLS is the in-process cubeproxy)", cfg.Proxy.Listen, nil); err != nil {
			return nil, err
		}
	}
	var joinLn net.Listener
	if cfg.Join.Listen != "" {
		host, _, _ := net.SplitHostPort(cfg.Join.Listen)
		jtc, err := joinapi.TLSConfig(svc.JoinCA(), append([]string{host}, cfg.Join.Hosts...)...)
		if err != nil {
			for _, l := range lis {
				l.Close()
			}
			svc.Close()
			return nil, err
		}
		if joinLn, err = listen("join.listen", "join.ca_dir", cfg.Join.Listen, jtc); err != nil {
			return nil, err
		}
	}
	nodes, err := nodeapi.Listen(svc, log)
	if err != nil {
		for _, l := range lis {
			l.Close()
		}
		svc.Close()
		return nil, err
	}
	rctx, cancel := context.WithCancel(ctx)
	s := &Server{Service: svc, cancel: cancel}
	s.run(func() error { return nodes.Run(rctx) })
	if joinLn != nil {
		s.JoinAddr = joinLn.Addr().String()
		log.Info("join listener listening", "addr", s.JoinAddr)
		s.run(func() error { return joinapi.Serve(rctx, svc, joinLn, log) })
	}
	var api *e2bapi.Handler
	if e2bLn != nil {
		s.E2BAddr = e2bLn.Addr().String()
		api = e2bapi.New(svc, e2bapi.Config{
			Domain: cfg.Proxy.Domain, EnvdVersion: cfg.Sandbox.EnvdVersion, V1DefaultTimeout: cfg.Sandbox.V1DefaultTimeout.Duration,
			MilliCPU: cfg.Sandbox.MilliCPU, MemoryMiB: cfg.Sandbox.MemoryMiB,
		}, log)
		log.Info("E2B API listening", "addr", s.E2BAddr)
		s.run(func() error { return e2bapi.Serve(rctx, api, e2bLn) })
	}
	if opsLn != nil {
		s.OpsAddr = opsLn.Addr().String()
		ops := opsapi.New(svc, opsapi.Config{
			AdminUser: cfg.Console.AdminUser, AdminPasswordHash: cfg.Console.AdminPasswordHash,
			SessionTTL: cfg.Console.SessionTTL.Duration, Secure: e2bTLS != nil, Done: rctx.Done(),
		}, log)
		log.Info("CubeOps listening", "addr", s.OpsAddr)
		s.run(func() error {
			err := e2bapi.Serve(rctx, ops, opsLn)
			ops.Wait() // its jobs end with rctx; the service closes after them
			return err
		})
	}
	if inProcessProxy {
		// Domain mode: the route serves api.<domain> with the same handler
		// as api.e2b (no second hop).
		var apiHandler http.Handler
		if cfg.Proxy.API && api != nil {
			apiHandler = api
		}
		if err := s.startProxy(rctx, cfg, apiHandler, log); err != nil {
			s.cancel()
			_ = s.Wait()
			return nil, err
		}
	}
	if proxyLn != nil {
		s.ProxyAddr = proxyLn.Addr().String()
		route := proxy.New(proxy.Config{Resolver: svc, Dialer: svc.Dialer(), Domain: cfg.Proxy.Domain, Log: log})
		log.Info("sandbox route listening", "addr", s.ProxyAddr, "domain", cfg.Proxy.Domain)
		s.run(func() error { return route.Serve(rctx, proxyLn) })
	}
	return s, nil
}

func (s *Server) run(fn func() error) {
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		if err := fn(); err != nil {
			s.mu.Lock()
			s.errs = append(s.errs, err)
			s.mu.Unlock()
			s.cancel() // one edge down takes the whole master down
		}
	}()
}

// Wait blocks until every edge has stopped, then closes the service.
func (s *Server) Wait() error {
	s.wg.Wait()
	err := s.Service.Close()
	s.mu.Lock()
	defer s.mu.Unlock()
	return errors.Join(append(s.errs, err)...)
}

// Stop shuts every edge down and closes the service.
func (s *Server) Stop() error {
	s.cancel()
	return s.Wait()
}
