package serve

import (
	"crypto/tls"
	"errors"
	"fmt"
	"net"

	"github.com/cubesandbox/cube/internal/errdefs"
)

// TLSFiles names a component's TLS material, PEM files: its certificate
// and key, and the CA certificate that signs the certificates of every
// component of the cluster. The daemons' [tls] tables decode into it.
type TLSFiles struct {
	Cert string `toml:"cert"`
	Key  string `toml:"key"`
	CA   string `toml:"ca"`
}

// Enabled reports whether any file is named.
func (f TLSFiles) Enabled() bool { return f.Cert != "" || f.Key != "" || f.CA != "" }

// reloader checks the files are named and readable and returns what
// re-reads them when they change (reload.go); setting names the table in
// errors.
func (f TLSFiles) reloader(setting string) (*reloader, error) {
	if f.Cert == "" || f.Key == "" || f.CA == "" {
		return nil, fmt.Errorf("%s: cert, key and ca are all needed: %w", setting, errdefs.ErrInvalidArgument)
	}
	r, err := newReloader(setting, f)
	if err != nil {
		return nil, fmt.Errorf("%v: %w", err, errdefs.ErrInvalidArgument)
	}
	return r, nil
}

// MutualServer is the TLS config of a component listener: it presents
// the component's certificate and admits only callers presenting a
// certificate a CA of the bundle signed. The files are re-read when they
// change (reload.go). nil (and no error) when no file is named.
func (f TLSFiles) MutualServer(setting string) (*tls.Config, error) {
	if !f.Enabled() {
		return nil, nil
	}
	r, err := f.reloader(setting)
	if err != nil {
		return nil, err
	}
	return serverConfig(r, &tls.Config{
		MinVersion: tls.VersionTLS13,
		ClientAuth: tls.RequireAndVerifyClientCert,
		// gRPC clients insist on ALPN h2; HTTP clients may speak either.
		NextProtos: []string{"h2", "http/1.1"},
	}), nil
}

// Client is the TLS config a component dials another with: it presents
// its certificate and trusts only the CA bundle, both re-read when their
// files change (reload.go). nil when no file is named.
func (f TLSFiles) Client(setting string) (*tls.Config, error) {
	if !f.Enabled() {
		return nil, nil
	}
	r, err := f.reloader(setting)
	if err != nil {
		return nil, err
	}
	return clientConfig(r), nil
}

// ServerCert is the TLS config of a listener for clients that hold no
// certificate (the E2B API): certFile and keyFile, re-read when they
// change, ALPN h2 and http/1.1.
func ServerCert(setting, certFile, keyFile string) (*tls.Config, error) {
	if certFile == "" && keyFile == "" {
		return nil, nil
	}
	r, err := newReloader(setting, TLSFiles{Cert: certFile, Key: keyFile})
	if err != nil {
		return nil, fmt.Errorf("%v: %w", err, errdefs.ErrInvalidArgument)
	}
	return serverConfig(r, &tls.Config{MinVersion: tls.VersionTLS12, NextProtos: []string{"h2", "http/1.1"}}), nil
}

// ErrNotLocal is wrapped by the refusal of a listener beyond loopback
// that serves no TLS.
var ErrNotLocal = errors.New("a listener beyond loopback needs TLS")

// ListenTCP listens on addr, the value of the setting named setting;
// secured says the caller serves TLS on the listener. Without TLS the
// address it bound must be a loopback one: anyone who reaches another
// interface could call the listener unauthenticated and read its answers
// in clear. Anything else is refused (the listener closed) with an error
// that names setting and tlsSetting, where its TLS is configured.
func ListenTCP(setting, tlsSetting, addr string, secured bool) (net.Listener, error) {
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("%s: listen %s: %w", setting, addr, err)
	}
	if a, ok := l.Addr().(*net.TCPAddr); ok && !secured && !a.IP.IsLoopback() {
		l.Close()
		return nil, fmt.Errorf("%s = %q binds %s, beyond loopback, and serves no TLS: set %s or a loopback address (127.0.0.1): %w: %w",
			setting, addr, a.IP, tlsSetting, ErrNotLocal, errdefs.ErrInvalidArgument)
	}
	return l, nil
}
