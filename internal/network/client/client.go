// Package client is the gRPC client of network-agent that cubelet uses.
// Errors come back wrapping the errdefs sentinels, as if the agent ran
// in-process.
package client

import (
	"context"
	"fmt"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/credentials/insecure"

	pb "github.com/cubesandbox/cube/api/network/v1"
	"github.com/cubesandbox/cube/internal/errdefs/grpcerr"
	"github.com/cubesandbox/cube/internal/network"
	"github.com/cubesandbox/cube/internal/network/policy"
	"github.com/cubesandbox/cube/internal/network/wire"
)

// Client talks to one network-agent.
type Client struct {
	conn *grpc.ClientConn
	api  pb.NetworkAgentClient
}

// Dial connects (lazily) to the agent's unix socket.
func Dial(socket string) (*Client, error) {
	target := socket
	if strings.HasPrefix(socket, "/") {
		target = "unix://" + socket
	}
	// The agent restarts in well under a second; reconnect quickly.
	conn, err := grpc.NewClient(target,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithConnectParams(grpc.ConnectParams{
			Backoff:           backoff.Config{BaseDelay: 20 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: time.Second},
			MinConnectTimeout: 2 * time.Second,
		}))
	if err != nil {
		return nil, err
	}
	return &Client{conn: conn, api: pb.NewNetworkAgentClient(conn)}, nil
}

// Close closes the connection.
func (c *Client) Close() error { return c.conn.Close() }

// Ensure gives sandboxID its slot (idempotent; see the RPC).
func (c *Client) Ensure(ctx context.Context, sandboxID string, kind network.Kind, p policy.Policy) (*network.Network, error) {
	resp, err := c.api.EnsureNetwork(ctx, &pb.EnsureNetworkRequest{
		SandboxId: sandboxID, Kind: wire.KindToPB(kind), Policy: wire.PolicyToPB(p),
	}, grpc.WaitForReady(true))
	if err != nil {
		return nil, fromGRPC(err)
	}
	return wire.NetworkFromPB(resp.Network)
}

// Release destroys sandboxID's slot; false when it had none.
func (c *Client) Release(ctx context.Context, sandboxID string) (bool, error) {
	resp, err := c.api.ReleaseNetwork(ctx, &pb.ReleaseNetworkRequest{SandboxId: sandboxID}, grpc.WaitForReady(true))
	if err != nil {
		return false, fromGRPC(err)
	}
	return resp.Released, nil
}

// Get returns sandboxID's slot.
func (c *Client) Get(ctx context.Context, sandboxID string) (*network.Network, error) {
	resp, err := c.api.GetNetwork(ctx, &pb.GetNetworkRequest{SandboxId: sandboxID})
	if err != nil {
		return nil, fromGRPC(err)
	}
	return wire.NetworkFromPB(resp.Network)
}

// List returns every assigned slot.
func (c *Client) List(ctx context.Context) ([]*network.Network, error) {
	resp, err := c.api.ListNetworks(ctx, &pb.ListNetworksRequest{})
	if err != nil {
		return nil, fromGRPC(err)
	}
	out := make([]*network.Network, 0, len(resp.Networks))
	for _, p := range resp.Networks {
		n, err := wire.NetworkFromPB(p)
		if err != nil {
			return nil, err
		}
		out = append(out, n)
	}
	return out, nil
}

// UpdatePolicy replaces sandboxID's policy; nil re-applies the stored one
// (and repairs the slot).
func (c *Client) UpdatePolicy(ctx context.Context, sandboxID string, p *policy.Policy) (*network.Network, error) {
	req := &pb.UpdatePolicyRequest{SandboxId: sandboxID}
	if p != nil {
		req.Policy = wire.PolicyToPB(*p)
	}
	resp, err := c.api.UpdatePolicy(ctx, req, grpc.WaitForReady(true))
	if err != nil {
		return nil, fromGRPC(err)
	}
	return wire.NetworkFromPB(resp.Network)
}

// TakeEgressVerdicts returns the agent's notable egress verdicts since the
// last call (and the agent forgets them).
func (c *Client) TakeEgressVerdicts(ctx context.Context) (*pb.TakeEgressVerdictsResponse, error) {
	resp, err := c.api.TakeEgressVerdicts(ctx, &pb.TakeEgressVerdictsRequest{})
	return resp, fromGRPC(err)
}

// Health returns the agent's health.
func (c *Client) Health(ctx context.Context) (*pb.HealthResponse, error) {
	resp, err := c.api.Health(ctx, &pb.HealthRequest{})
	return resp, fromGRPC(err)
}

// fromGRPC turns the agent's status errors back into the errdefs
// vocabulary (grpcerr), naming the agent.
func fromGRPC(err error) error {
	if err == nil {
		return nil
	}
	return fmt.Errorf("network-agent: %w", grpcerr.FromGRPC(err))
}
