package serve

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"os"

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

// load reads the files; setting names the table in errors.
func (f TLSFiles) load(setting string) (tls.Certificate, *x509.CertPool, error) {
	if f.Cert == "" || f.Key == "" || f.CA == "" {
		return tls.Certificate{}, nil, fmt.Errorf("%s: cert, key and ca are all needed: %w", setting, errdefs.ErrInvalidArgument)
	}
	cert, err := tls.LoadX509KeyPair(f.Cert, f.Key)
	if err != nil {
		return tls.Certificate{}, nil, fmt.Errorf("%s: %v: %w", setting, err, errdefs.ErrInvalidArgument)
	}
	pem, err := os.ReadFile(f.CA)
	if err != nil {
		return tls.Certificate{}, nil, fmt.Errorf("%s.ca: %v: %w", setting, err, errdefs.ErrInvalidArgument)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return tls.Certificate{}, nil, fmt.Errorf("%s.ca %s: no PEM certificate: %w", setting, f.CA, errdefs.ErrInvalidArgument)
	}
	return cert, pool, nil
}

// MutualServer is the TLS config of a component listener: it presents
// the component's certificate and admits only callers presenting a
// certificate the CA signed. nil (and no error) when no file is named.
func (f TLSFiles) MutualServer(setting string) (*tls.Config, error) {
	if !f.Enabled() {
		return nil, nil
	}
	cert, pool, err := f.load(setting)
	if err != nil {
		return nil, err
	}
	return &tls.Config{
		MinVersion:   tls.VersionTLS13,
		Certificates: []tls.Certificate{cert},
		ClientAuth:   tls.RequireAndVerifyClientCert,
		ClientCAs:    pool,
		// gRPC clients insist on ALPN h2; HTTP clients may speak either.
		NextProtos: []string{"h2", "http/1.1"},
	}, nil
}

// Client is the TLS config a component dials another with: it presents
// its certificate and trusts only the CA. nil when no file is named.
func (f TLSFiles) Client(setting string) (*tls.Config, error) {
	if !f.Enabled() {
		return nil, nil
	}
	cert, pool, err := f.load(setting)
	if err != nil {
		return nil, err
	}
	return &tls.Config{MinVersion: tls.VersionTLS13, Certificates: []tls.Certificate{cert}, RootCAs: pool}, nil
}

// ServerCert is the TLS config of a listener for clients that hold no
// certificate (the E2B API): certFile and keyFile, ALPN h2 and http/1.1.
func ServerCert(setting, certFile, keyFile string) (*tls.Config, error) {
	if certFile == "" && keyFile == "" {
		return nil, nil
	}
	cert, err := tls.LoadX509KeyPair(certFile, keyFile)
	if err != nil {
		return nil, fmt.Errorf("%s: %v: %w", setting, err, errdefs.ErrInvalidArgument)
	}
	return &tls.Config{MinVersion: tls.VersionTLS12, Certificates: []tls.Certificate{cert}, NextProtos: []string{"h2", "http/1.1"}}, nil
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
