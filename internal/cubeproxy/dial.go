package cubeproxy

import (
	"context"
	"crypto/tls"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"

	masterpb "github.com/cubesandbox/cube/api/master/v1"
	"github.com/cubesandbox/cube/internal/pki"
	"github.com/cubesandbox/cube/internal/serve"
)

// DialMaster connects to the master's RouteService: addr is a unix socket
// path ("/run/cube/cubemaster.sock" or "unix:///…"), served to root
// without a token, or host:port, which needs the master's api.admin_token
// and, when the master has [tls], tc: a certificate the cluster CA signed.
// The master must present a master certificate of that CA.
// Several master replicas are a comma-separated list: the proxy uses the
// first that answers and moves to the next when it goes away (every
// replica serves every route and streams every replica's route changes).
func DialMaster(addr, token string, tc *tls.Config) (*grpc.ClientConn, error) {
	target, opts := serve.ReplicaTarget(addr)
	creds := insecure.NewCredentials()
	if tc != nil && !strings.HasPrefix(target, "unix:") {
		// Only a master's certificate answers for the master.
		creds = serve.ClientCredentials(pki.ExpectPeer(tc, "", pki.RoleMaster))
	}
	opts = append(opts, grpc.WithTransportCredentials(creds))
	if token != "" {
		withToken := func(ctx context.Context) context.Context {
			return metadata.AppendToOutgoingContext(ctx, masterpb.AdminTokenHeader, token)
		}
		opts = append(opts,
			grpc.WithUnaryInterceptor(func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, o ...grpc.CallOption) error {
				return invoker(withToken(ctx), method, req, reply, cc, o...)
			}),
			grpc.WithStreamInterceptor(func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, o ...grpc.CallOption) (grpc.ClientStream, error) {
				return streamer(withToken(ctx), desc, cc, method, o...)
			}))
	}
	return grpc.NewClient(target, opts...)
}
