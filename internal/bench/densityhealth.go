package bench

import (
	"context"
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
	h := proxy.New(proxy.Config{Resolver: nodeResolver{c: e.Client}, Log: e.Log, NoRetry: true})
	defer h.Close()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	sctx, stop := context.WithCancel(context.WithoutCancel(ctx))
	served := make(chan error, 1)
	go func() { served <- h.Serve(sctx, ln) }()
	defer func() {
		stop()
		if err := <-served; err != nil && e.Log != nil {
			e.Log.Debug("density: proxy listener", "err", err)
		}
	}()
	hc := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	url := "http://" + ln.Addr().String() + "/health"
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
