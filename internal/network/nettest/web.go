package nettest

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/network/netnsdir"
)

// TestCA is a CA made for one test: it signs the world's web servers.
type TestCA struct {
	Cert *x509.Certificate
	PEM  []byte
	// File holds PEM (an agent's [egress] upstream_ca).
	File string
	Pool *x509.CertPool
	key  *ecdsa.PrivateKey
}

// NewTestCA makes a CA in t's temporary directory.
func NewTestCA(t testing.TB, name string) *TestCA {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: name},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		KeyUsage: x509.KeyUsageCertSign, BasicConstraintsValid: true, IsCA: true}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, _ := x509.ParseCertificate(der)
	ca := &TestCA{Cert: cert, key: key, Pool: x509.NewCertPool(),
		PEM: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})}
	ca.Pool.AddCert(cert)
	ca.File = filepath.Join(t.TempDir(), name+".pem")
	if err := os.WriteFile(ca.File, ca.PEM, 0o644); err != nil {
		t.Fatal(err)
	}
	return ca
}

// Issue returns a server certificate for names.
func (ca *TestCA) Issue(t testing.TB, names ...string) tls.Certificate {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(time.Now().UnixNano()), Subject: pkix.Name{CommonName: names[0]},
		DNSNames: names, NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.Cert, &key.PublicKey, ca.key)
	if err != nil {
		t.Fatal(err)
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}
}

// WebRequest is what a world web server received.
type WebRequest struct {
	Method, Host, Path, SNI string
	Header                  http.Header
	// Upgraded: the protocol the connection had switched to before this
	// request ("" none).
	Upgraded string
}

// Web is the world's HTTP (port 80) and HTTPS (port 443) servers, on
// every world address. Every response body is
// "host=<Host> addr=<local address> auth=<AuthDigest(Authorization)>\n":
// a digest, so that a credential the proxy injected never travels back
// into the sandbox (tests look for it there).
type Web struct {
	mu   sync.Mutex
	reqs []WebRequest
}

// Requests returns what the servers received so far.
func (w *Web) Requests() []WebRequest {
	w.mu.Lock()
	defer w.mu.Unlock()
	return append([]WebRequest(nil), w.reqs...)
}

// AuthDigest is how the world's web servers echo an Authorization value:
// the first 16 hex digits of its SHA-256, "" for none.
func AuthDigest(v string) string {
	if v == "" {
		return ""
	}
	sum := sha256.Sum256([]byte(v))
	return hex.EncodeToString(sum[:8])
}

// ServeWeb starts the world's web servers. certFor picks the certificate
// for a TLS server name (any name the client sends, "" included).
func (w *World) ServeWeb(t testing.TB, certFor func(sni string) *tls.Certificate) *Web {
	t.Helper()
	web := &Web{}
	h := http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		sni := ""
		if r.TLS != nil {
			sni = r.TLS.ServerName
		}
		web.mu.Lock()
		web.reqs = append(web.reqs, WebRequest{Method: r.Method, Host: r.Host, Path: r.URL.Path, SNI: sni, Header: r.Header.Clone()})
		web.mu.Unlock()
		local, _ := r.Context().Value(http.LocalAddrContextKey).(net.Addr)
		if up := r.Header.Get("Upgrade"); up != "" {
			web.upgraded(rw, up, sni)
			return
		}
		fmt.Fprintf(rw, "host=%s addr=%s auth=%s\n", r.Host, local, AuthDigest(r.Header.Get("Authorization")))
	})
	var plain, secure net.Listener
	err := netnsdir.Do(w.NS, func() error {
		var err error
		if plain, err = net.Listen("tcp4", ":80"); err != nil {
			return err
		}
		secure, err = net.Listen("tcp4", ":443")
		return err
	})
	if err != nil {
		t.Fatalf("world web: %v", err)
	}
	hs := &http.Server{Handler: h, ReadHeaderTimeout: 5 * time.Second}
	tlsCfg := &tls.Config{GetCertificate: func(ch *tls.ClientHelloInfo) (*tls.Certificate, error) {
		return certFor(strings.ToLower(ch.ServerName)), nil
	}}
	hs2 := &http.Server{Handler: h, ReadHeaderTimeout: 5 * time.Second, TLSConfig: tlsCfg}
	go func() { _ = hs.Serve(plain) }()
	go func() { _ = hs2.ServeTLS(secure, "", "") }()
	t.Cleanup(func() {
		for _, s := range []*http.Server{hs, hs2} {
			if err := s.Close(); err != nil && !errors.Is(err, http.ErrServerClosed) {
				t.Errorf("world web: %v", err)
			}
		}
	})
	return web
}

// upgraded accepts any protocol switch (101 with the protocol asked for)
// and then, whatever the protocol, reads HTTP/1 requests from the
// connection, records them with Upgraded set and answers each as the
// servers do: a stand-in for a server that speaks h2c or websocket after
// the switch, enough to show what reaches it past the 101.
func (w *Web) upgraded(rw http.ResponseWriter, proto, sni string) {
	c, brw, err := http.NewResponseController(rw).Hijack()
	if err != nil {
		http.Error(rw, err.Error(), http.StatusInternalServerError)
		return
	}
	defer c.Close()
	fmt.Fprintf(brw, "HTTP/1.1 101 Switching Protocols\r\nUpgrade: %s\r\nConnection: Upgrade\r\n\r\n", proto)
	if brw.Flush() != nil {
		return
	}
	for {
		_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
		req, err := http.ReadRequest(brw.Reader)
		if err != nil {
			return
		}
		w.mu.Lock()
		w.reqs = append(w.reqs, WebRequest{Method: req.Method, Host: req.Host, Path: req.URL.Path, SNI: sni,
			Header: req.Header.Clone(), Upgraded: proto})
		w.mu.Unlock()
		body := fmt.Sprintf("host=%s upgraded=%s path=%s\n", req.Host, proto, req.URL.Path)
		fmt.Fprintf(brw, "HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
		if brw.Flush() != nil {
			return
		}
	}
}
