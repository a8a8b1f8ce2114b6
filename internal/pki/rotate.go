package pki

import (
	"bytes"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
)

// A CA directory's ca.crt is the trust bundle every component's [tls] ca
// names; its first certificate is the signing CA's, whose key is ca.key.
// A CA rotation goes through three steps so that no component ever meets
// a certificate it does not trust yet, or loses trust in one still in use:
//
//  1. BeginRotation makes the next CA (ca-next.crt, ca-next.key) and
//     appends its certificate to the bundle: components trust both, the
//     old CA still signs.
//  2. PromoteRotation makes the next CA the signing one (ca.key, first in
//     the bundle); the bundle keeps the old CA, so certificates it signed
//     stay valid while the components' certificates are reissued.
//  3. FinishRotation drops the old CA from the bundle once the given
//     certificates are all the new CA's: a certificate of the old CA is
//     refused from then on.
//
// Components re-read their files when they change (internal/serve), so
// none restarts; on several machines the bundle is copied to every
// machine after steps 1 and 3, and each machine's certificates are
// reissued between 2 and 3.

// File names of the next CA during a rotation (between steps 1 and 2).
const (
	NextCACertFile = "ca-next.crt"
	NextCAKeyFile  = "ca-next.key"
)

// Bundle returns the certificates of dir's trust bundle (ca.crt), the
// signing CA's first.
func Bundle(dir string) ([]*x509.Certificate, error) {
	data, err := os.ReadFile(filepath.Join(dir, CACertFile))
	if err != nil {
		return nil, err
	}
	return ParseCertificates(data)
}

// ParseCertificates returns the certificates of PEM data (at least one).
func ParseCertificates(data []byte) ([]*x509.Certificate, error) {
	var out []*x509.Certificate
	for {
		var b *pem.Block
		b, data = pem.Decode(data)
		if b == nil {
			break
		}
		if b.Type != "CERTIFICATE" {
			continue
		}
		c, err := x509.ParseCertificate(b.Bytes)
		if err != nil {
			return nil, fmt.Errorf("CA bundle: %v: %w", err, errdefs.ErrFailedPrecondition)
		}
		out = append(out, c)
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("CA bundle: no certificate: %w", errdefs.ErrFailedPrecondition)
	}
	return out, nil
}

func certPEM(c *x509.Certificate) []byte {
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: c.Raw})
}

// LoadCA reads the CA in dir; NotFound when it has none.
func LoadCA(dir string) (*CA, error) {
	certPEM, err := os.ReadFile(filepath.Join(dir, CACertFile))
	if errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("no CA in %s: %w", dir, errdefs.ErrNotFound)
	}
	if err != nil {
		return nil, err
	}
	keyPEM, err := os.ReadFile(filepath.Join(dir, CAKeyFile))
	if err != nil {
		return nil, fmt.Errorf("CA key: %v: %w", err, errdefs.ErrFailedPrecondition)
	}
	return parseCA(certPEM, keyPEM)
}

func exists(path string) bool {
	_, err := os.Stat(path)
	return err == nil
}

// BeginRotation is step 1: it makes the next CA, named name (with the
// time it was made), and adds it to dir's bundle. Refused while a
// rotation is under way.
func BeginRotation(dir, name string) (*x509.Certificate, error) {
	if _, err := LoadCA(dir); err != nil {
		return nil, err
	}
	if exists(filepath.Join(dir, NextCAKeyFile)) {
		return nil, fmt.Errorf("a CA rotation is under way (%s exists): promote it: %w", NextCAKeyFile, errdefs.ErrFailedPrecondition)
	}
	bundle, err := Bundle(dir)
	if err != nil {
		return nil, err
	}
	if len(bundle) > 1 {
		return nil, fmt.Errorf("the bundle still holds %d CAs: finish the previous rotation first: %w", len(bundle), errdefs.ErrFailedPrecondition)
	}
	next, err := NewCA(name + " " + time.Now().UTC().Format("2006-01-02T15:04:05Z"))
	if err != nil {
		return nil, err
	}
	if err := writeKey(filepath.Join(dir, NextCAKeyFile), next); err != nil {
		return nil, err
	}
	if err := writeFile(filepath.Join(dir, NextCACertFile), next.CertPEM, 0o644); err != nil {
		return nil, err
	}
	if err := writeFile(filepath.Join(dir, CACertFile), append(certPEM(bundle[0]), next.CertPEM...), 0o644); err != nil {
		return nil, err
	}
	return next.Cert, nil
}

// PromoteRotation is step 2: the next CA becomes the one that signs; the
// bundle keeps the old one after it. It returns the CA to reissue the
// components' certificates with.
func PromoteRotation(dir string) (*CA, error) {
	nextCert, err := os.ReadFile(filepath.Join(dir, NextCACertFile))
	if errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("no CA rotation under way (no %s): begin one: %w", NextCACertFile, errdefs.ErrFailedPrecondition)
	}
	if err != nil {
		return nil, err
	}
	nextKey, err := os.ReadFile(filepath.Join(dir, NextCAKeyFile))
	if err != nil {
		return nil, fmt.Errorf("next CA key: %v: %w", err, errdefs.ErrFailedPrecondition)
	}
	next, err := parseCA(nextCert, nextKey)
	if err != nil {
		return nil, err
	}
	bundle, err := Bundle(dir)
	if err != nil {
		return nil, err
	}
	// The new bundle: the next CA first, then every other one it held.
	out := bytes.Clone(next.CertPEM)
	for _, c := range bundle {
		if !c.Equal(next.Cert) {
			out = append(out, certPEM(c)...)
		}
	}
	if err := writeKey(filepath.Join(dir, CAKeyFile), next); err != nil {
		return nil, err
	}
	if err := writeFile(filepath.Join(dir, CACertFile), out, 0o644); err != nil {
		return nil, err
	}
	for _, f := range []string{NextCAKeyFile, NextCACertFile} {
		if err := os.Remove(filepath.Join(dir, f)); err != nil && !errors.Is(err, os.ErrNotExist) {
			return nil, err
		}
	}
	return &CA{Cert: next.Cert, CertPEM: out, key: next.key}, nil
}

// FinishRotation is step 3: the bundle keeps only the signing CA. It is
// refused while one of leaves (certificate files) was not signed by it:
// that component would be refused by every other.
func FinishRotation(dir string, leaves ...string) error {
	if exists(filepath.Join(dir, NextCAKeyFile)) {
		return fmt.Errorf("the next CA is not signing yet (%s exists): promote it first: %w", NextCAKeyFile, errdefs.ErrFailedPrecondition)
	}
	ca, err := LoadCA(dir)
	if err != nil {
		return err
	}
	roots := x509.NewCertPool()
	roots.AddCert(ca.Cert)
	for _, path := range leaves {
		data, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		certs, err := ParseCertificates(data)
		if err != nil {
			return fmt.Errorf("%s: %w", path, err)
		}
		if _, err := certs[0].Verify(x509.VerifyOptions{Roots: roots, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}}); err != nil {
			return fmt.Errorf("%s (%s) is not signed by the signing CA (%v): reissue it first: %w", path, certs[0].Subject.CommonName, err, errdefs.ErrFailedPrecondition)
		}
	}
	return writeFile(filepath.Join(dir, CACertFile), certPEM(ca.Cert), 0o644)
}

func writeKey(path string, ca *CA) error {
	der, err := x509.MarshalECPrivateKey(ca.key)
	if err != nil {
		return err
	}
	return writeFile(path, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: der}), 0o600)
}
