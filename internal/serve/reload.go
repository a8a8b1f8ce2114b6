package serve

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"log/slog"
	"net"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"weak"

	"google.golang.org/grpc/credentials"
)

// TLS material is re-read when its files change, so a certificate, its
// key and the trusted CA bundle can be replaced under a running daemon
// (a leaf reissue, a CA rotation) without a restart and without failing a
// call. The check is a stat of the files at every TLS handshake: handshakes
// are rare (gRPC and HTTP/2 keep their connections) and each costs far more
// than three stats, it needs no signal sent to every daemon of every node,
// and a client that dials once per run (cubecli) reads the files anyway.
// Connections established before a change keep the identity they proved;
// only new handshakes see the new material.
//
// Files are expected to be replaced by a rename (internal/pki does), so a
// reader sees a whole old or a whole new file. A certificate and its key
// are two renames: between them the pair does not match, the load fails,
// and the previous material stays in use until the next change of a file.

// stamp identifies a version of a file: a rename gives a new inode, a
// rewrite in place a new mtime or size.
type stamp struct {
	dev, ino, size uint64
	mtimeNS        int64
	missing        bool
}

func statStamp(path string) stamp {
	if path == "" {
		return stamp{}
	}
	fi, err := os.Stat(path)
	if err != nil {
		return stamp{missing: true}
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return stamp{size: uint64(fi.Size()), mtimeNS: fi.ModTime().UnixNano()}
	}
	return stamp{dev: st.Dev, ino: st.Ino, size: uint64(st.Size), mtimeNS: fi.ModTime().UnixNano()}
}

// material is one consistent read of the files.
type material struct {
	cert *tls.Certificate
	pool *x509.CertPool // nil when no CA file is named
}

// reloader holds the material of a TLSFiles and re-reads it when a file
// changed since the last read.
type reloader struct {
	files   TLSFiles
	setting string

	cur atomic.Pointer[material]

	mu     sync.Mutex
	loaded [3]stamp // the stamps cur was read at
	failed [3]stamp // the stamps the last failed read saw (not retried)
}

func (r *reloader) stamps() [3]stamp {
	return [3]stamp{statStamp(r.files.Cert), statStamp(r.files.Key), statStamp(r.files.CA)}
}

// newReloader reads the files once; an error here is a configuration
// error of the daemon's start.
func newReloader(setting string, f TLSFiles) (*reloader, error) {
	r := &reloader{files: f, setting: setting}
	st := r.stamps()
	m, err := r.read()
	if err != nil {
		return nil, err
	}
	r.cur.Store(m)
	r.loaded = st
	return r, nil
}

func (r *reloader) read() (*material, error) {
	cert, err := tls.LoadX509KeyPair(r.files.Cert, r.files.Key)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", r.setting, err)
	}
	m := &material{cert: &cert}
	if r.files.CA == "" {
		return m, nil
	}
	pemData, err := os.ReadFile(r.files.CA)
	if err != nil {
		return nil, fmt.Errorf("%s.ca: %w", r.setting, err)
	}
	m.pool = x509.NewCertPool()
	if !m.pool.AppendCertsFromPEM(pemData) {
		return nil, fmt.Errorf("%s.ca %s: no PEM certificate", r.setting, r.files.CA)
	}
	return m, nil
}

// get returns the current material, re-read first if a file changed.
// A read that fails keeps the previous material (logged once per change).
func (r *reloader) get() *material {
	st := r.stamps()
	r.mu.Lock()
	defer r.mu.Unlock()
	if st == r.loaded || st == r.failed {
		return r.cur.Load()
	}
	m, err := r.read()
	if err != nil {
		r.failed = st
		slog.Warn("TLS files changed but do not load; serving the previous ones", "setting", r.setting, "err", err)
		return r.cur.Load()
	}
	r.cur.Store(m)
	r.loaded, r.failed = st, [3]stamp{}
	slog.Info("TLS files reloaded", "setting", r.setting, "cert", r.files.Cert, "ca", r.files.CA)
	return m
}

// serverConfig is a config whose certificate (and, with a pool, the CAs
// client certificates are verified against) are read per handshake from r.
// Each handshake uses a copy of base with the current material, so fields
// set on the returned config after it was made (VerifyConnection, ...)
// hold for every handshake.
func serverConfig(r *reloader, base *tls.Config) *tls.Config {
	outer := base.Clone()
	outer.GetConfigForClient = func(*tls.ClientHelloInfo) (*tls.Config, error) {
		m := r.get()
		c := outer.Clone()
		c.GetConfigForClient = nil
		c.Certificates = []tls.Certificate{*m.cert}
		if m.pool != nil {
			c.ClientCAs = m.pool
		}
		return c, nil
	}
	return outer
}

// clientConfig presents r's certificate and trusts r's CA bundle as they
// are now, in a plain config (tests take its certificate away or replace
// its trust to probe a server). ClientCredentials, which every gRPC client
// of a daemon dials with, puts r's current certificate and bundle into a
// copy of it at every handshake; the certificate and the trust are
// replaced only where the config still holds those clientConfig put
// there. crypto/tls offers no hook that could do it inside the config: it
// reads RootCAs from the config it dials with, and verifying elsewhere
// would need the server's name, which a TLS 1.3 client does not report
// for an IP address.
//
// The config's RootCAs pool is a copy made for it alone, and the key that
// finds r: tls.Config.Clone keeps the pointer, so a copy of the config
// (one that adds a check of the server's role, say) still follows r.
func clientConfig(r *reloader) *tls.Config {
	m := r.get()
	pool := m.pool.Clone()
	key := weak.Make(pool)
	clientReloaders.Store(key, clientEntry{r: r, leaf: m.cert.Certificate[0]})
	runtime.AddCleanup(pool, func(k weak.Pointer[x509.CertPool]) { clientReloaders.Delete(k) }, key)
	return &tls.Config{MinVersion: tls.VersionTLS13, Certificates: []tls.Certificate{*m.cert}, RootCAs: pool}
}

// clientReloaders finds the reloader of a config clientConfig made by its
// RootCAs pool (until the pool is collected).
var clientReloaders sync.Map // weak.Pointer[x509.CertPool] -> clientEntry

type clientEntry struct {
	r    *reloader
	leaf []byte // the certificate (DER) the config was made with
}

// ClientCredentials is gRPC's TLS transport credentials for tc: those of
// credentials.NewTLS, except that for a config of TLSFiles.Client (or a
// copy of one) each handshake presents the certificate and trusts the CA
// bundle the files hold at that moment, so a long-lived client follows a
// reissue and a CA rotation.
func ClientCredentials(tc *tls.Config) credentials.TransportCredentials {
	return &clientCreds{TransportCredentials: credentials.NewTLS(tc), tc: tc}
}

type clientCreds struct {
	credentials.TransportCredentials
	tc *tls.Config
}

var _ credentials.TransportCredentials = (*clientCreds)(nil)

func (c *clientCreds) ClientHandshake(ctx context.Context, authority string, conn net.Conn) (net.Conn, credentials.AuthInfo, error) {
	cfg, ok := current(c.tc)
	if !ok {
		return c.TransportCredentials.ClientHandshake(ctx, authority, conn)
	}
	return credentials.NewTLS(cfg).ClientHandshake(ctx, authority, conn)
}

// Current is, for a config of TLSFiles.Client (or a copy of one), a copy
// that presents the certificate and trusts the CA bundle its files hold
// now, as ClientCredentials does for gRPC: a client that dials with
// crypto/tls itself calls it before each dial to follow a reissue and a
// CA rotation. Any other config comes back as it is.
func Current(tc *tls.Config) *tls.Config {
	if cfg, ok := current(tc); ok {
		return cfg
	}
	return tc
}

func current(tc *tls.Config) (*tls.Config, bool) {
	var e clientEntry
	if tc != nil && tc.RootCAs != nil {
		v, _ := clientReloaders.Load(weak.Make(tc.RootCAs))
		e, _ = v.(clientEntry)
	}
	if e.r == nil {
		return nil, false
	}
	cfg := tc.Clone()
	m := e.r.get()
	cfg.RootCAs = m.pool
	if len(cfg.Certificates) == 1 && bytes.Equal(cfg.Certificates[0].Certificate[0], e.leaf) {
		cfg.Certificates = []tls.Certificate{*m.cert}
	}
	return cfg, true
}

func (c *clientCreds) Clone() credentials.TransportCredentials {
	return &clientCreds{TransportCredentials: c.TransportCredentials.Clone(), tc: c.tc}
}
