package cubelettest

import (
	"testing"

	"github.com/cubesandbox/cube/internal/network/nettest"
)

// StartNetworkAgent runs a real network-agent for this env (in-process,
// serving gRPC on a unix socket of its own) and points the env's cubelet
// config ([network] agent_socket) at it; call it before Start. The agent
// gets a private link prefix, node CIDR and directories. Its cleanup,
// which runs after the cubelet's, fails the test if a slot is still
// assigned, purges the pool and checks for leaked namespaces, links and
// rules. A cubelet run as a process needs
// "[network]\nagent_socket = <Socket>" in WriteConfig's extra.
func (e *Env) StartNetworkAgent(t testing.TB, o nettest.Options) *nettest.Env {
	t.Helper()
	o.Serve = true
	n := nettest.Start(t, o)
	e.Config.Network.AgentSocket = n.Socket
	return n
}
