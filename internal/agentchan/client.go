package agentchan

import (
	"context"
	"crypto/tls"
	"fmt"
	"net"
	"net/http"
	"time"

	"golang.org/x/net/http2"
)

// BaseURL is the URL prefix to use with the clients below: the host part
// is ignored, every request goes over the channel.
const BaseURL = "http://agent"

// pingTimeout bounds how long a dead connection (the QEMU socket of a VM
// that was paused or replaced) holds requests before it is dropped.
const pingTimeout = 5 * time.Second

// SerialClient returns an HTTP client for the agent behind QEMU's
// virtio-serial chardev socket at socketPath. QEMU serves one client at a
// time, so all requests share one HTTP/2 connection; when it breaks (the
// VM restarted or was restored into a new QEMU) the next request dials
// again.
func SerialClient(socketPath string) *http.Client {
	return h2cClient(func(ctx context.Context) (net.Conn, error) {
		var d net.Dialer
		c, err := d.DialContext(ctx, "unix", socketPath)
		if err != nil {
			return nil, fmt.Errorf("agentchan: dial %s: %w", socketPath, err)
		}
		sc, err := hostSync(ctx, c)
		if err != nil {
			c.Close()
			return nil, err
		}
		return sc, nil
	})
}

// VsockClient returns an HTTP client for the agent listening on vsock
// cid:port (VsockPort in cube guests).
func VsockClient(cid, port uint32) *http.Client {
	return h2cClient(func(ctx context.Context) (net.Conn, error) { return dialVsock(ctx, cid, port) })
}

func h2cClient(dial func(ctx context.Context) (net.Conn, error)) *http.Client {
	return &http.Client{Transport: &http2.Transport{
		AllowHTTP: true,
		// http2.Transport pools one connection per host and dials it
		// once for concurrent first requests: what QEMU's one-client
		// socket needs.
		DialTLSContext: func(ctx context.Context, _, _ string, _ *tls.Config) (net.Conn, error) {
			return dial(ctx)
		},
		ReadIdleTimeout: 15 * time.Second,
		PingTimeout:     pingTimeout,
	}}
}
