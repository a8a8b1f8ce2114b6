package serve

import (
	"context"
	"net"
	"strings"
	"sync/atomic"

	"google.golang.org/grpc"
	"google.golang.org/grpc/resolver"
	"google.golang.org/grpc/resolver/manual"
)

// replicaSeq names each ReplicaTarget's resolver scheme apart.
var replicaSeq atomic.Int64

// ReplicaTarget is how a client dials one of several replicas of a server
// (cubemaster replicas in a comma-separated master address): a gRPC
// target and the options that make the channel use the first replica
// that answers and move to the next when it goes away (pick_first over
// every address, in order). Each address is host:port (its TLS server
// name the host) or a unix socket (unix:///path or /path). With one
// address it returns that address as the target and no options, as a
// plain dial would.
func ReplicaTarget(list string) (string, []grpc.DialOption) {
	var addrs []string
	for _, a := range strings.Split(list, ",") {
		if a = strings.TrimSpace(a); a != "" {
			addrs = append(addrs, a)
		}
	}
	if len(addrs) == 1 {
		if strings.HasPrefix(addrs[0], "/") {
			return "unix://" + addrs[0], nil
		}
		return addrs[0], nil
	}
	scheme := "cube-replicas-" + itoa(replicaSeq.Add(1))
	r := manual.NewBuilderWithScheme(scheme)
	st := resolver.State{}
	for _, a := range addrs {
		ra := resolver.Address{Addr: a}
		if !isUnix(a) {
			if h, _, err := net.SplitHostPort(a); err == nil {
				ra.ServerName = h
			}
		}
		st.Addresses = append(st.Addresses, ra)
	}
	r.InitialState(st)
	dial := func(ctx context.Context, addr string) (net.Conn, error) {
		var d net.Dialer
		if isUnix(addr) {
			return d.DialContext(ctx, "unix", strings.TrimPrefix(addr, "unix://"))
		}
		return d.DialContext(ctx, "tcp", addr)
	}
	return scheme + ":///replicas", []grpc.DialOption{grpc.WithResolvers(r), grpc.WithContextDialer(dial)}
}

func isUnix(a string) bool { return strings.HasPrefix(a, "unix://") || strings.HasPrefix(a, "/") }

func itoa(n int64) string {
	var b [20]byte
	i := len(b)
	for {
		i--
		b[i] = byte('0' + n%10)
		n /= 10
		if n == 0 {
			return string(b[i:])
		}
	}
}
