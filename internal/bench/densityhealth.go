package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"time"

	pb "github.com/cubesandbox/cube/api/cubelet/v1"
	"github.com/cubesandbox/cube/internal/agentproto"
	"github.com/cubesandbox/cube/internal/bench/report"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/proxy"
)

// healthWithin is how soon an idle sandbox must answer /health.
const healthWithin = time.Second

// nodeResolver finds a sandbox of the bench's cubelet where a single
// node's proxy does: at its slot's host IP, else in its network namespace
// on this host (a runc sandbox without network-agent).
type nodeResolver struct{ c pb.CubeletServiceClient }

var _ proxy.Resolver = nodeResolver{}

func (r nodeResolver) Resolve(ctx context.Context, id string) (*proxy.Target, error) {
	got, err := r.c.GetSandbox(ctx, &pb.GetSandboxRequest{SandboxId: id})
	if err != nil {
		return nil, fmt.Errorf("sandbox %s: %w", id, errdefs.ErrNotFound)
	}
	sb := got.GetSandbox()
	t := &proxy.Target{SandboxID: id, HostIP: sb.GetNetwork().GetHostIp()}
	if t.HostIP == "" && sb.GetPid() > 0 {
		t.NetNS = fmt.Sprintf("/proc/%d/ns/net", sb.GetPid())
	}
	return t, nil
}

// healthThroughProxy asks each sandbox's envd GET /health once, one at a
// time, through the sandbox proxy (package proxy, the handler cubeproxy
// and cubemaster's route serve) on a loopback listener, the way the E2B
// SDKs address it (sandbox and port in headers). A request's time runs
// from sending it to the end of the answer: the proxy's resolve (a
// GetSandbox) and its dial into the sandbox included. After each answer
// the proxy's idle upstream connection is closed, so no agent is left
// holding one.
func (e *Env) healthThroughProxy(ctx context.Context, ids []string) (*report.HealthCheck, error) {
	px, err := e.startProxy(ctx)
	if err != nil {
		return nil, err
	}
	defer px.stop()
	h := px.h
	hc := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	url := px.base + "/health"
	port := strconv.Itoa(agentproto.Port)

	res := &report.HealthCheck{Within: healthWithin}
	lat := make([]time.Duration, 0, len(ids))
	e.Progress.Start("density: /health through the proxy", len(ids))
	for _, id := range ids {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if err != nil {
			return nil, err
		}
		req.Header.Set(proxy.HeaderSandboxID, id)
		req.Header.Set(proxy.HeaderSandboxPort, port)
		start := time.Now()
		err = askHealth(hc, req)
		d := time.Since(start)
		h.Close()
		res.Asked++
		switch {
		case err != nil:
			res.Failed++
			if res.FirstError == "" {
				res.FirstError = fmt.Sprintf("sandbox %s: %v", id, err)
			}
		case d > healthWithin:
			res.Late++
		}
		if err == nil {
			lat = append(lat, d)
		}
		e.Progress.Step(err == nil)
	}
	e.Progress.Finish()
	res.Latency = report.Summarize(lat)
	return res, nil
}

func askHealth(hc *http.Client, req *http.Request) error {
	resp, err := hc.Do(req)
	if err != nil {
		return err
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		return fmt.Errorf("envd /health: %s", resp.Status)
	}
	return nil
}

// loopbackProxy is the sandbox proxy served on a loopback listener.
type loopbackProxy struct {
	h    *proxy.Handler
	base string // http://127.0.0.1:port
	stop func()
}

func (e *Env) startProxy(ctx context.Context) (*loopbackProxy, error) {
	h := proxy.New(proxy.Config{Resolver: nodeResolver{c: e.Client}, Log: e.Log, NoRetry: true})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		h.Close()
		return nil, err
	}
	sctx, stop := context.WithCancel(context.WithoutCancel(ctx))
	served := make(chan error, 1)
	go func() { served <- h.Serve(sctx, ln) }()
	return &loopbackProxy{h: h, base: "http://" + ln.Addr().String(), stop: func() {
		stop()
		if err := <-served; err != nil && e.Log != nil {
			e.Log.Debug("density: proxy listener", "err", err)
		}
		h.Close()
	}}, nil
}

// useThroughProxy has every sandbox run `true` n times through the proxy,
// c sandboxes at a time: sandboxes that were used, for density to measure
// once they are idle again.
func (e *Env) useThroughProxy(ctx context.Context, ids []string, n, c int) error {
	px, err := e.startProxy(ctx)
	if err != nil {
		return err
	}
	defer px.stop()
	port := strconv.Itoa(agentproto.Port)
	hc := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: c}}
	defer hc.CloseIdleConnections()
	e.Progress.Start(fmt.Sprintf("density: %d commands in each sandbox", n), len(ids))
	d := drive(ctx, e.Progress, len(ids), c, func(ctx context.Context, i int) (time.Duration, error) {
		for range n {
			if err := envdTrue(ctx, hc, px.base, ids[i], port); err != nil {
				return 0, fmt.Errorf("sandbox %s: %w", ids[i], err)
			}
		}
		return 0, nil
	})
	e.Progress.Finish()
	if d.failed > 0 {
		return fmt.Errorf("density: commands failed in %d of %d sandboxes: %w", d.failed, len(ids), errors.Join(d.errs...))
	}
	return ctx.Err()
}
