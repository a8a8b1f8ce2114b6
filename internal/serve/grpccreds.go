package serve

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"net"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"
)

// NewGRPCServer is grpc.NewServer for a Group: one server may serve a
// unix socket and a TLS listener of Group.TCP at once, and a call that
// came over TLS carries its peer's verified certificate (PeerCert).
func NewGRPCServer(opts ...grpc.ServerOption) *grpc.Server {
	return grpc.NewServer(append([]grpc.ServerOption{grpc.Creds(listenerCreds{})}, opts...)...)
}

// listenerCreds takes the transport security from the listener: a
// connection of a TLS listener finishes its handshake here and reports
// the TLS state; any other connection (a unix socket, loopback TCP) is
// used as it is, like insecure credentials.
type listenerCreds struct{}

var _ credentials.TransportCredentials = listenerCreds{}

type plainInfo struct{ credentials.CommonAuthInfo }

func (plainInfo) AuthType() string { return "insecure" }

func (listenerCreds) ServerHandshake(c net.Conn) (net.Conn, credentials.AuthInfo, error) {
	tc, ok := c.(*tls.Conn)
	if !ok {
		return c, plainInfo{credentials.CommonAuthInfo{SecurityLevel: credentials.NoSecurity}}, nil
	}
	// gRPC set a deadline on c for the handshake.
	if err := tc.Handshake(); err != nil {
		return nil, nil, err
	}
	return tc, credentials.TLSInfo{State: tc.ConnectionState(), CommonAuthInfo: credentials.CommonAuthInfo{SecurityLevel: credentials.PrivacyAndIntegrity}}, nil
}

func (listenerCreds) ClientHandshake(context.Context, string, net.Conn) (net.Conn, credentials.AuthInfo, error) {
	return nil, nil, errors.New("serve: listener credentials are for servers")
}

func (listenerCreds) Info() credentials.ProtocolInfo {
	return credentials.ProtocolInfo{SecurityProtocol: "listener"}
}

func (listenerCreds) Clone() credentials.TransportCredentials { return listenerCreds{} }

func (listenerCreds) OverrideServerName(string) error { return nil }

// PeerCert is the verified certificate the caller of a gRPC call served
// by NewGRPCServer presented over mutual TLS; nil when the call came
// over a unix socket or plaintext loopback, or without a certificate.
func PeerCert(ctx context.Context) *x509.Certificate {
	p, ok := peer.FromContext(ctx)
	if !ok {
		return nil
	}
	ti, ok := p.AuthInfo.(credentials.TLSInfo)
	if !ok || len(ti.State.VerifiedChains) == 0 || len(ti.State.VerifiedChains[0]) == 0 {
		return nil
	}
	return ti.State.VerifiedChains[0][0]
}
