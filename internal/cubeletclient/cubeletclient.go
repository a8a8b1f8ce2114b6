// Package cubeletclient is the client side of cubelet's gRPC API: dialing,
// the typed client and the names of API values, for cubecli, cubemaster,
// the bench and the launcher. It imports the generated protos and gRPC,
// never the daemon, so a client links no runtime driver, no nftables and no
// in-sandbox agent. The server side is package cubeletapi; errors are
// mapped with package errdefs/grpcerr (grpcerr.FromGRPC, grpcerr.Detail).
package cubeletclient

import (
	"crypto/tls"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/credentials/insecure"

	pb "github.com/cubesandbox/cube/api/cubelet/v1"
	"github.com/cubesandbox/cube/internal/serve"
)

// Dial connects (lazily) to a cubelet at addr: "unix:///run/cube/cubelet.sock",
// a bare socket path, or "host:port".
func Dial(addr string) (*grpc.ClientConn, error) { return DialTLS(addr, nil) }

// DialTLS is Dial with tc, when set, as the TLS of a cubelet at host:port
// (a unix socket needs none: its mode admits root only).
func DialTLS(addr string, tc *tls.Config) (*grpc.ClientConn, error) {
	target := addr
	if strings.HasPrefix(addr, "/") {
		target = "unix://" + addr
	}
	creds := insecure.NewCredentials()
	if tc != nil && !strings.HasPrefix(target, "unix:") {
		creds = serve.ClientCredentials(tc)
	}
	// A short reconnect backoff: cubelet restarts in well under a second and
	// callers (the CLI, the master) should not sit out gRPC's default 1 s+.
	return grpc.NewClient(target,
		grpc.WithTransportCredentials(creds),
		grpc.WithConnectParams(grpc.ConnectParams{
			Backoff:           backoff.Config{BaseDelay: 20 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: time.Second},
			MinConnectTimeout: 2 * time.Second,
		}))
}

// New returns a typed client over conn.
func New(conn grpc.ClientConnInterface) pb.CubeletServiceClient {
	return pb.NewCubeletServiceClient(conn)
}

const statePrefix = "SANDBOX_STATE_"

// StateName is the short lowercase name of an API state ("running"), the
// name of the lifecycle state it stands for; "unspecified" for
// SANDBOX_STATE_UNSPECIFIED and values this build does not know.
func StateName(s pb.SandboxState) string {
	name, ok := pb.SandboxState_name[int32(s)]
	if !ok {
		return "unspecified"
	}
	return strings.ToLower(strings.TrimPrefix(name, statePrefix))
}

// ParseState is the API state named name (any case, "running"), the
// inverse of StateName; false for an unknown name and for "unspecified".
func ParseState(name string) (pb.SandboxState, bool) {
	v, ok := pb.SandboxState_value[statePrefix+strings.ToUpper(name)]
	if !ok || pb.SandboxState(v) == pb.SandboxState_SANDBOX_STATE_UNSPECIFIED {
		return pb.SandboxState_SANDBOX_STATE_UNSPECIFIED, false
	}
	return pb.SandboxState(v), true
}
