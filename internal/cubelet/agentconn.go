package cubelet

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"time"

	"github.com/cubesandbox/cube/internal/agentproto"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/nsdial"
	"github.com/cubesandbox/cube/internal/sandbox"
)

// agentEndpoint is how cubelet reaches one sandbox's cube-agent: an HTTP
// client and the base URL requests go to. Callers close idle connections
// when done (a VM's channel takes one client at a time).
type agentEndpoint struct {
	client *http.Client
	base   string // "http://host:port", no trailing slash
	pid    int    // the sandbox's init on the host, watched while polling
}

func (e agentEndpoint) url(path string) string { return e.base + path }

// agentChannel is a driver whose sandboxes expose cube-agent on a host-side
// channel of their own (a VM's virtio-serial or vsock device) rather than
// in a network namespace cubelet can enter.
type agentChannel interface {
	AgentClient(id string) (*http.Client, error)
}

// agentEndpointFor picks the path to a sandbox's agent, most direct first:
// the runtime's own channel (VMs), the slot's host IP (what the proxy
// uses: with a slot, a sandbox is Running only when reachable that way),
// or the sandbox's network namespace (runc without network-agent).
func (n *node) agentEndpointFor(rec *sandbox.Record) (agentEndpoint, error) {
	if rec.Container == nil || rec.Container.PID == 0 {
		return agentEndpoint{}, fmt.Errorf("agent: sandbox has no running container: %w", errdefs.ErrFailedPrecondition)
	}
	pid := rec.Container.PID
	d, err := n.driver(rec.Runtime)
	if err != nil {
		return agentEndpoint{}, err
	}
	if ch, ok := d.(agentChannel); ok {
		c, err := ch.AgentClient(rec.Container.ID)
		if err != nil {
			return agentEndpoint{}, err
		}
		// The host is a placeholder: the channel's transport ignores it.
		return agentEndpoint{client: c, base: "http://agent", pid: pid}, nil
	}
	if nw := rec.Network; nw != nil && nw.HostIP != "" {
		return agentEndpoint{client: hostIPClient(), base: "http://" + net.JoinHostPort(nw.HostIP, strconv.Itoa(agentproto.Port)), pid: pid}, nil
	}
	return agentEndpoint{
		client: nsdial.HTTPClient(fmt.Sprintf("/proc/%d/ns/net", pid)),
		base:   fmt.Sprintf("http://127.0.0.1:%d", agentproto.Port),
		pid:    pid,
	}, nil
}

func hostIPClient() *http.Client {
	return &http.Client{Transport: &http.Transport{
		Proxy:       nil,
		DialContext: (&net.Dialer{Timeout: time.Second}).DialContext,
	}}
}

// waitAgent polls the sandbox's agent /health until it answers.
func (n *node) waitAgent(ctx context.Context, rec *sandbox.Record) error {
	e, err := n.agentEndpointFor(rec)
	if err != nil {
		return err
	}
	return pollHealth(ctx, e.client, e.url("/health"), e.pid)
}
