package egress

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
)

// CA is the node's egress CA: it signs the certificates the proxy shows a
// sandbox for the hosts whose TLS it terminates (credential rules).
// Sandboxes trust it (its PEM is installed in their trust store); its key
// never leaves network-agent's data directory.
type CA struct {
	Cert *x509.Certificate
	PEM  []byte
	key  crypto.Signer

	mu     sync.Mutex
	leaves map[string]*tls.Certificate
}

// Files of a CA in its directory.
const (
	CACertFile = "egress-ca.pem"
	CAKeyFile  = "egress-ca-key.pem"
)

const (
	caValidity   = 10 * 365 * 24 * time.Hour
	leafValidity = 7 * 24 * time.Hour
	leafRenew    = 24 * time.Hour // a cached leaf this close to expiry is made again
)

// LoadOrCreateCA reads the CA from dir, or makes one (ECDSA P-256, key
// file mode 0600) when neither file exists. Creation is safe against a
// crash and against another process (a master replica on a shared dir)
// creating at the same time: both files are written in full under
// temporary names, then published by hard link, key first, cert last, a
// link never replacing a file. The process whose key link loses the race
// loads the winner's pair (waiting up to caSettle for its cert). A key
// without a cert is refused with an error: no cert was ever published,
// so nothing trusts that key, and the operator removes it to make a new
// CA (doing it here could remove the key of a creator still between its
// two links). A cert without its key is refused too: sandboxes trust it.
func LoadOrCreateCA(dir string) (*CA, error) {
	certPath, keyPath := filepath.Join(dir, CACertFile), filepath.Join(dir, CAKeyFile)
	_, cerr := os.Stat(certPath)
	_, kerr := os.Stat(keyPath)
	if errors.Is(cerr, os.ErrNotExist) && errors.Is(kerr, os.ErrNotExist) {
		if err := createCA(dir, certPath, keyPath); err != nil {
			return nil, err
		}
	}
	return loadCA(dir, certPath, keyPath)
}

// caSettle is how long a load waits for the cert of a key another
// process has just published.
var caSettle = 2 * time.Second

func loadCA(dir, certPath, keyPath string) (*CA, error) {
	deadline := time.Now().Add(caSettle)
	for {
		certPEM, cerr := os.ReadFile(certPath)
		keyPEM, kerr := os.ReadFile(keyPath)
		switch {
		case cerr == nil && kerr == nil:
			return ParseCA(certPEM, keyPEM)
		case errors.Is(cerr, os.ErrNotExist) && kerr == nil:
			if time.Now().Before(deadline) {
				time.Sleep(20 * time.Millisecond)
				continue
			}
			return nil, fmt.Errorf("egress CA in %s: %s without %s: its creation was interrupted; no certificate was published, so nothing trusts this key: remove %s to make a new CA: %w",
				dir, CAKeyFile, CACertFile, keyPath, errdefs.ErrFailedPrecondition)
		default:
			return nil, fmt.Errorf("egress CA in %s: %w", dir, errors.Join(cerr, kerr))
		}
	}
}

// createCA makes a pair and publishes it in dir unless another process
// published one first (then it returns nil and the caller loads that).
func createCA(dir, certPath, keyPath string) error {
	certPEM, keyPEM, err := newCA()
	if err != nil {
		return err
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	tmpKey, err := writeTemp(dir, ".egress-ca-key-*.tmp", keyPEM, 0o600)
	if err != nil {
		return err
	}
	defer os.Remove(tmpKey)
	tmpCert, err := writeTemp(dir, ".egress-ca-*.tmp", certPEM, 0o644)
	if err != nil {
		return err
	}
	defer os.Remove(tmpCert)
	if err := os.Link(tmpKey, keyPath); err != nil {
		if errors.Is(err, os.ErrExist) {
			return nil // another process won: load its pair
		}
		return fmt.Errorf("egress CA: publish the key: %w", err)
	}
	if err := os.Link(tmpCert, certPath); err != nil {
		return fmt.Errorf("egress CA: publish the certificate: %w", err)
	}
	if d, err := os.Open(dir); err == nil {
		_ = d.Sync()
		d.Close()
	}
	return nil
}

// writeTemp writes b to a new file in dir (synced) and returns its path.
func writeTemp(dir, pattern string, b []byte, mode os.FileMode) (string, error) {
	f, err := os.CreateTemp(dir, pattern)
	if err != nil {
		return "", err
	}
	_, err = f.Write(b)
	if err == nil {
		err = f.Chmod(mode)
	}
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(f.Name())
		return "", err
	}
	return f.Name(), nil
}

// ParseCA builds a CA from PEM files' contents.
func ParseCA(certPEM, keyPEM []byte) (*CA, error) {
	pair, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		return nil, fmt.Errorf("egress CA: %w", err)
	}
	cert, err := x509.ParseCertificate(pair.Certificate[0])
	if err != nil {
		return nil, fmt.Errorf("egress CA: %w", err)
	}
	if !cert.IsCA {
		return nil, errors.New("egress CA: the certificate is not a CA")
	}
	signer, ok := pair.PrivateKey.(crypto.Signer)
	if !ok {
		return nil, errors.New("egress CA: the key cannot sign")
	}
	return &CA{Cert: cert, PEM: certPEM, key: signer, leaves: map[string]*tls.Certificate{}}, nil
}

func newCA() (certPEM, keyPEM []byte, err error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, err
	}
	host, _ := os.Hostname()
	tmpl := &x509.Certificate{
		SerialNumber:          serial(),
		Subject:               pkix.Name{CommonName: "cube egress CA " + host, Organization: []string{"cube"}},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(caValidity),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
		BasicConstraintsValid: true,
		IsCA:                  true,
		MaxPathLenZero:        true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, nil, err
	}
	kder, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return nil, nil, err
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kder}), nil
}

func serial() *big.Int {
	n, _ := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 120))
	return n
}

// Leaf returns a certificate for name signed by the CA (cached): what the
// proxy shows a sandbox for a host whose TLS it terminates.
func (ca *CA) Leaf(name string) (*tls.Certificate, error) {
	ca.mu.Lock()
	defer ca.mu.Unlock()
	if c := ca.leaves[name]; c != nil && time.Until(c.Leaf.NotAfter) > leafRenew {
		return c, nil
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial(),
		Subject:      pkix.Name{CommonName: name},
		DNSNames:     []string{name},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(leafValidity),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.Cert, &key.PublicKey, ca.key)
	if err != nil {
		return nil, err
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	c := &tls.Certificate{Certificate: [][]byte{der, ca.Cert.Raw}, PrivateKey: key, Leaf: leaf}
	if len(ca.leaves) > 4096 {
		clear(ca.leaves)
	}
	ca.leaves[name] = c
	return c, nil
}
