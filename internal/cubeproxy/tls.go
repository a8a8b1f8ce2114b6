package cubeproxy

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"fmt"
	"math/big"
	"net"
	"time"

	"github.com/cubesandbox/cube/internal/serve"
)

// TLSConfig is how cubeproxy serves TLS: a certificate and key from files,
// or (for development) a self-signed certificate made in memory at start.
type TLSConfig struct {
	CertFile, KeyFile string
	SelfSigned        bool
}

func (c TLSConfig) enabled() bool { return c.SelfSigned || c.CertFile != "" }

// load returns the server's tls.Config, offering HTTP/2 and HTTP/1.1. A
// certificate from files is re-read when the files change (serve.ServerCert).
func (c TLSConfig) load(domain string) (*tls.Config, error) {
	switch {
	case c.CertFile != "" && c.KeyFile != "":
		return serve.ServerCert("tls", c.CertFile, c.KeyFile)
	case c.CertFile != "" || c.KeyFile != "":
		return nil, fmt.Errorf("tls: cert_file and key_file go together")
	}
	cert, err := SelfSigned(domain)
	if err != nil {
		return nil, fmt.Errorf("tls: %w", err)
	}
	return &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12, NextProtos: []string{"h2", "http/1.1"}}, nil
}

// SelfSigned makes a P-256 certificate valid for a week for domain,
// *.domain (every <port>-<id>.domain host), localhost and loopback. Nothing
// trusts it: clients must skip verification or trust it explicitly.
func SelfSigned(domain string) (tls.Certificate, error) {
	if h, _, err := net.SplitHostPort(domain); err == nil {
		domain = h
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return tls.Certificate{}, err
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 120))
	if err != nil {
		return tls.Certificate{}, err
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{CommonName: "cubeproxy (self-signed, development)"},
		NotBefore:    now.Add(-time.Hour), NotAfter: now.Add(7 * 24 * time.Hour),
		KeyUsage:    x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		DNSNames:    []string{"localhost"},
		IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback},
	}
	if domain != "" && domain != "localhost" {
		tmpl.DNSNames = append(tmpl.DNSNames, domain)
	}
	if domain != "" {
		tmpl.DNSNames = append(tmpl.DNSNames, "*."+domain)
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return tls.Certificate{}, err
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}, nil
}
