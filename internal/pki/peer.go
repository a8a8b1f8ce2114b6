package pki

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"net/http"
	"slices"

	"github.com/cubesandbox/cube/internal/errdefs"
)

// CheckPeer says whether cert, a certificate the cluster CA signed,
// identifies one of roles and, when name is not empty, the component
// name (its common name).
func CheckPeer(cert *x509.Certificate, name string, roles ...Role) error {
	if cert == nil {
		return fmt.Errorf("no peer certificate: %w", errdefs.ErrPermissionDenied)
	}
	ou := cert.Subject.OrganizationalUnit
	if !slices.ContainsFunc(roles, func(r Role) bool { return slices.Contains(ou, string(r)) }) {
		return fmt.Errorf("peer certificate %q has role %v, want %v: %w", cert.Subject.CommonName, ou, roles, errdefs.ErrPermissionDenied)
	}
	if name != "" && cert.Subject.CommonName != name {
		return fmt.Errorf("peer certificate is %q (role %v), want %q: %w", cert.Subject.CommonName, ou, name, errdefs.ErrPermissionDenied)
	}
	return nil
}

// ExpectPeer is tc, a component's client TLS config
// (serve.TLSFiles.Client), that also requires the server to present a
// certificate of one of roles and, when name is not empty, of the
// component name: the CA signs every component's certificate for client
// and server use alike, so trusting the CA alone would let a node's
// certificate pass for the master's, or one node's for another's, to a
// client whose connection it intercepts. nil (no TLS) stays nil; tc is
// not changed.
func ExpectPeer(tc *tls.Config, name string, roles ...Role) *tls.Config {
	if tc == nil {
		return nil
	}
	c := tc.Clone()
	prev := c.VerifyConnection
	// VerifyConnection runs after the chain and the host name were
	// verified, on every handshake, resumed ones included.
	c.VerifyConnection = func(cs tls.ConnectionState) error {
		if prev != nil {
			if err := prev(cs); err != nil {
				return err
			}
		}
		var leaf *x509.Certificate
		if len(cs.PeerCertificates) > 0 {
			leaf = cs.PeerCertificates[0]
		}
		return CheckPeer(leaf, name, roles...)
	}
	return c
}

// RequirePeer serves h only to callers whose client certificate (mutual
// TLS) identifies one of roles; others get 403. A request that came
// without TLS (a loopback listener of a daemon without [tls]) passes: the
// listener's address is its bound there.
func RequirePeer(h http.Handler, roles ...Role) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.TLS != nil {
			var leaf *x509.Certificate
			if len(r.TLS.VerifiedChains) > 0 && len(r.TLS.VerifiedChains[0]) > 0 {
				leaf = r.TLS.VerifiedChains[0][0]
			}
			if err := CheckPeer(leaf, "", roles...); err != nil {
				http.Error(w, err.Error(), http.StatusForbidden)
				return
			}
		}
		h.ServeHTTP(w, r)
	})
}
