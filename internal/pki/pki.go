// Package pki is the cluster's certificate authority: it makes a CA and
// signs component certificates with it (crypto/x509, ECDSA P-256), and
// keeps both as PEM files a daemon's [tls] table names. A certificate's
// common name is the component's identity (a node's ID, "cubemaster");
// its organizational unit says what kind of component it is (Role).
package pki

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/serve"
)

// Role is the kind of component a certificate identifies, its subject's
// organizational unit.
type Role string

const (
	RoleMaster Role = "master"
	RoleNode   Role = "node"
	RoleProxy  Role = "proxy"
	RoleAdmin  Role = "admin"
	// RoleRoute is the route's server certificate in domain mode
	// (*.<domain>, which SDK clients are told to trust): no listener of
	// the cluster accepts it as a caller.
	RoleRoute Role = "route"
)

// Validity of what NewCA and Issue make.
const (
	CAValidity   = 10 * 365 * 24 * time.Hour
	CertValidity = 2 * 365 * 24 * time.Hour
)

// File names in a CA directory.
const (
	CACertFile = "ca.crt"
	CAKeyFile  = "ca.key"
)

// CA signs component certificates.
type CA struct {
	Cert    *x509.Certificate
	CertPEM []byte
	key     *ecdsa.PrivateKey
}

// NewCA makes a self-signed CA named name.
func NewCA(name string) (*CA, error) { return newCA(name, nil) }

// NewRouteCA makes a self-signed CA for a route's certificates only: name
// constrained to domain (and its subdomains), localhost and loopback
// addresses, for
// server authentication only. Clients that trust it to reach the route
// (SSL_CERT_FILE, NODE_EXTRA_CA_CERTS) trust nothing else it could sign,
// and it signs no cluster identity.
func NewRouteCA(name, domain string) (*CA, error) {
	if domain == "" {
		return nil, fmt.Errorf("route CA without a domain: %w", errdefs.ErrInvalidArgument)
	}
	return newCA(name, func(t *x509.Certificate) {
		t.PermittedDNSDomainsCritical = true
		// localhost: names that resolve to loopback only (RFC 6761).
		t.PermittedDNSDomains = []string{domain, "localhost"}
		t.PermittedIPRanges = []*net.IPNet{
			{IP: net.IPv4(127, 0, 0, 0).To4(), Mask: net.CIDRMask(8, 32)},
			{IP: net.IPv6loopback, Mask: net.CIDRMask(128, 128)},
		}
		t.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}
	})
}

func newCA(name string, shape func(*x509.Certificate)) (*CA, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber:          serial(),
		Subject:               pkix.Name{CommonName: name},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.Add(CAValidity),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
		BasicConstraintsValid: true,
		IsCA:                  true,
		MaxPathLenZero:        true,
	}
	if shape != nil {
		shape(tmpl)
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, err
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	return &CA{Cert: cert, CertPEM: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), key: key}, nil
}

// LoadOrCreateCA reads the CA in dir (ca.crt, ca.key), making one named
// name first when neither file exists. dir is created mode 0700 and the
// key written 0600: whoever reads it can mint any component's identity.
func LoadOrCreateCA(dir, name string) (*CA, error) {
	return loadOrCreate(dir, func() (*CA, error) { return NewCA(name) })
}

// LoadOrCreateRouteCA is LoadOrCreateCA for NewRouteCA(name, domain).
func LoadOrCreateRouteCA(dir, name, domain string) (*CA, error) {
	return loadOrCreate(dir, func() (*CA, error) { return NewRouteCA(name, domain) })
}

func loadOrCreate(dir string, mk func() (*CA, error)) (*CA, error) {
	certPath, keyPath := filepath.Join(dir, CACertFile), filepath.Join(dir, CAKeyFile)
	certPEM, cerr := os.ReadFile(certPath)
	keyPEM, kerr := os.ReadFile(keyPath)
	switch {
	case cerr == nil && kerr == nil:
		return parseCA(certPEM, keyPEM)
	case !errors.Is(cerr, os.ErrNotExist) && cerr != nil:
		return nil, cerr
	case !errors.Is(kerr, os.ErrNotExist) && kerr != nil:
		return nil, kerr
	case cerr == nil || kerr == nil:
		return nil, fmt.Errorf("CA in %s: one of %s and %s is missing: %w", dir, CACertFile, CAKeyFile, errdefs.ErrFailedPrecondition)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	ca, err := mk()
	if err != nil {
		return nil, err
	}
	der, err := x509.MarshalECPrivateKey(ca.key)
	if err != nil {
		return nil, err
	}
	if err := writeFile(keyPath, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: der}), 0o600); err != nil {
		return nil, err
	}
	if err := writeFile(certPath, ca.CertPEM, 0o644); err != nil {
		return nil, err
	}
	return ca, nil
}

// Sign makes a certificate for pub (a key its holder made and kept) as
// the component name of kind role, valid for hosts, for server and
// client authentication; it returns the certificate as PEM.
func (ca *CA) Sign(pub crypto.PublicKey, name string, role Role, hosts ...string) ([]byte, error) {
	if name == "" {
		return nil, fmt.Errorf("certificate without a name: %w", errdefs.ErrInvalidArgument)
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber: serial(),
		Subject:      pkix.Name{CommonName: name, OrganizationalUnit: []string{string(role)}},
		NotBefore:    now.Add(-time.Hour),
		NotAfter:     now.Add(CertValidity),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
	}
	if role == RoleRoute {
		// A route serves; it is nobody's client.
		tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}
	}
	for _, h := range hosts {
		if ip := net.ParseIP(h); ip != nil {
			tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
		} else if h != "" {
			tmpl.DNSNames = append(tmpl.DNSNames, h)
		}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.Cert, pub, ca.key)
	if err != nil {
		return nil, fmt.Errorf("sign: %v: %w", err, errdefs.ErrInvalidArgument)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), nil
}

func parseCA(certPEM, keyPEM []byte) (*CA, error) {
	cb, _ := pem.Decode(certPEM)
	kb, _ := pem.Decode(keyPEM)
	if cb == nil || kb == nil {
		return nil, fmt.Errorf("CA: no PEM block: %w", errdefs.ErrFailedPrecondition)
	}
	cert, err := x509.ParseCertificate(cb.Bytes)
	if err != nil {
		return nil, fmt.Errorf("CA certificate: %v: %w", err, errdefs.ErrFailedPrecondition)
	}
	key, err := x509.ParseECPrivateKey(kb.Bytes)
	if err != nil {
		return nil, fmt.Errorf("CA key: %v: %w", err, errdefs.ErrFailedPrecondition)
	}
	if !key.PublicKey.Equal(cert.PublicKey) {
		return nil, fmt.Errorf("CA key does not match its certificate: %w", errdefs.ErrFailedPrecondition)
	}
	return &CA{Cert: cert, CertPEM: certPEM, key: key}, nil
}

// Issue signs a certificate for the component name of kind role, valid
// for the hosts (IP addresses or DNS names) it serves on, for both server
// and client authentication, and writes it into dir as <base>.crt and
// <base>.key (0600) with the CA's certificate as ca.crt. It returns the
// three paths.
func (ca *CA) Issue(dir, base, name string, role Role, hosts ...string) (serve.TLSFiles, error) {
	if name == "" {
		return serve.TLSFiles{}, fmt.Errorf("certificate without a name: %w", errdefs.ErrInvalidArgument)
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return serve.TLSFiles{}, err
	}
	certPEM, err := ca.Sign(&key.PublicKey, name, role, hosts...)
	if err != nil {
		return serve.TLSFiles{}, err
	}
	kder, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return serve.TLSFiles{}, err
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return serve.TLSFiles{}, err
	}
	f := serve.TLSFiles{Cert: filepath.Join(dir, base+".crt"), Key: filepath.Join(dir, base+".key"), CA: filepath.Join(dir, CACertFile)}
	if err := writeFile(f.Key, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kder}), 0o600); err != nil {
		return serve.TLSFiles{}, err
	}
	if err := writeFile(f.Cert, certPEM, 0o644); err != nil {
		return serve.TLSFiles{}, err
	}
	if err := writeFile(f.CA, ca.CertPEM, 0o644); err != nil {
		return serve.TLSFiles{}, err
	}
	return f, nil
}

// writeFile replaces path with data at mode (a temporary file renamed
// over it, so a reader never sees half a key and the mode never depends
// on the umask).
func writeFile(path string, data []byte, mode os.FileMode) error {
	tmp, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+"-")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	if err := tmp.Chmod(mode); err != nil {
		tmp.Close()
		return err
	}
	if _, err := tmp.Write(data); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), path)
}

func serial() *big.Int {
	n, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		panic(err) // crypto/rand does not fail on Linux
	}
	return n
}
