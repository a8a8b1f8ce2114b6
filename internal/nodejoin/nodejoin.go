// Package nodejoin is a new node's side of joining a cluster (cube join):
// with a one-time token an operator made on the master, it makes a key
// here, has the master's join listener sign a node certificate for it,
// and writes the key, the certificate and the cluster CA where cubelet's
// [tls] names them. The CA key never leaves the master.
//
// The token ends with the SHA-256 of the cluster CA's certificate: the
// node sends the token only to a listener whose certificate chains to
// that CA and has the master role, so a listener in the way can neither
// learn the token nor hand the node a CA of its own.
package nodejoin

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/pki"
)

// Path is the join listener's one route.
const Path = "/v1/join"

// Request is what a joining node sends.
type Request struct {
	Token  string `json:"token"`
	NodeID string `json:"nodeId"`
	// PublicKey is the node's key, PEM "PUBLIC KEY" (PKIX).
	PublicKey string `json:"publicKey"`
	// Hosts are the addresses (IPs or DNS names) the node is dialled at.
	Hosts []string `json:"hosts"`
}

// Response is the master's answer: the node's certificate and the CA, PEM,
// and the cluster's egress CA (certificate and key, PEM) for the node's
// network-agent.
type Response struct {
	Certificate string `json:"certificate"`
	CA          string `json:"ca"`
	EgressCA    string `json:"egressCA,omitempty"`
	EgressCAKey string `json:"egressCAKey,omitempty"`
}

// Files are what Join writes into a directory.
const (
	CertFile = "node.crt"
	KeyFile  = "node.key"
	CAFile   = "ca.crt"
	// EgressDir is the subdirectory (0700) with the cluster's egress CA,
	// what network-agent's [egress] ca_dir names: the file names are
	// the ones network-agent reads there (package egress).
	EgressDir     = "egress"
	EgressCAFile  = "egress-ca.pem"
	EgressKeyFile = "egress-ca-key.pem"
)

// Join obtains a node certificate for nodeID from the join listener at
// addr (host:port) with token, valid for hosts, and writes it, its key
// (made here, 0600) and the CA into dir. It returns the three paths.
// When the master hands the cluster's egress CA too, Join writes it into
// dir/egress (the key 0600) for network-agent's [egress] ca_dir.
func Join(ctx context.Context, addr, token, nodeID string, hosts []string, dir string) (cert, key, ca string, err error) {
	parts := strings.Split(token, ".")
	if len(parts) != 4 || len(parts[3]) != 64 {
		return "", "", "", fmt.Errorf("not a join token (cjt1.<id>.<secret>.<CA hash>): %w", errdefs.ErrInvalidArgument)
	}
	pin, err := hex.DecodeString(parts[3])
	if err != nil {
		return "", "", "", fmt.Errorf("join token: CA hash: %v: %w", err, errdefs.ErrInvalidArgument)
	}
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return "", "", "", err
	}
	pubDER, err := x509.MarshalPKIXPublicKey(&k.PublicKey)
	if err != nil {
		return "", "", "", err
	}
	body, _ := json.Marshal(Request{Token: token, NodeID: nodeID, Hosts: hosts,
		PublicKey: string(pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: pubDER}))})
	hc := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{TLSClientConfig: PinnedConfig(pin)}}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "https://"+addr+Path, bytes.NewReader(body))
	if err != nil {
		return "", "", "", err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := hc.Do(req)
	if err != nil {
		return "", "", "", fmt.Errorf("join %s: %v: %w", addr, err, errdefs.ErrUnavailable)
	}
	defer resp.Body.Close()
	data, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if resp.StatusCode != http.StatusOK {
		kind := errdefs.ErrUnavailable
		switch resp.StatusCode {
		case http.StatusUnauthorized:
			kind = errdefs.ErrUnauthenticated
		case http.StatusBadRequest:
			kind = errdefs.ErrInvalidArgument
		case http.StatusConflict:
			kind = errdefs.ErrFailedPrecondition
		case http.StatusTooManyRequests:
			kind = errdefs.ErrResourceExhausted
		}
		return "", "", "", fmt.Errorf("join %s: %s: %s: %w", addr, resp.Status, bytes.TrimSpace(data), kind)
	}
	var out Response
	if err := json.Unmarshal(data, &out); err != nil {
		return "", "", "", fmt.Errorf("join %s: answer: %w", addr, err)
	}
	// What came back must be what was asked: a node certificate for
	// nodeID, for this key, from the pinned CA.
	caBlock, _ := pem.Decode([]byte(out.CA))
	certBlock, _ := pem.Decode([]byte(out.Certificate))
	if caBlock == nil || certBlock == nil {
		return "", "", "", fmt.Errorf("join %s: answer without PEM: %w", addr, errdefs.ErrUnavailable)
	}
	if sum := sha256.Sum256(caBlock.Bytes); !bytes.Equal(sum[:], pin) {
		return "", "", "", fmt.Errorf("join %s: the CA returned is not the one the token names: %w", addr, errdefs.ErrPermissionDenied)
	}
	caCert, err := x509.ParseCertificate(caBlock.Bytes)
	if err != nil {
		return "", "", "", err
	}
	leaf, err := x509.ParseCertificate(certBlock.Bytes)
	if err != nil {
		return "", "", "", err
	}
	roots := x509.NewCertPool()
	roots.AddCert(caCert)
	if _, err := leaf.Verify(x509.VerifyOptions{Roots: roots, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}); err != nil {
		return "", "", "", fmt.Errorf("join %s: certificate: %w", addr, err)
	}
	if err := pki.CheckPeer(leaf, nodeID, pki.RoleNode); err != nil {
		return "", "", "", fmt.Errorf("join %s: certificate: %w", addr, err)
	}
	if !k.PublicKey.Equal(leaf.PublicKey) {
		return "", "", "", fmt.Errorf("join %s: the certificate is for another key: %w", addr, errdefs.ErrPermissionDenied)
	}
	if out.EgressCA != "" || out.EgressCAKey != "" {
		if err := checkEgressCA(out.EgressCA, out.EgressCAKey); err != nil {
			return "", "", "", fmt.Errorf("join %s: egress CA: %w", addr, err)
		}
	}
	kder, err := x509.MarshalECPrivateKey(k)
	if err != nil {
		return "", "", "", err
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", "", "", err
	}
	if out.EgressCA != "" {
		ed := filepath.Join(dir, EgressDir)
		if err := os.MkdirAll(ed, 0o700); err != nil {
			return "", "", "", err
		}
		if err := writeFile(filepath.Join(ed, EgressKeyFile), []byte(out.EgressCAKey), 0o600); err != nil {
			return "", "", "", err
		}
		if err := writeFile(filepath.Join(ed, EgressCAFile), []byte(out.EgressCA), 0o644); err != nil {
			return "", "", "", err
		}
	}
	cert, key, ca = filepath.Join(dir, CertFile), filepath.Join(dir, KeyFile), filepath.Join(dir, CAFile)
	for _, f := range []struct {
		path string
		data []byte
		mode os.FileMode
	}{
		{key, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kder}), 0o600},
		{cert, []byte(out.Certificate), 0o644},
		{ca, []byte(out.CA), 0o644},
	} {
		if err := writeFile(f.path, f.data, f.mode); err != nil {
			return "", "", "", err
		}
	}
	return cert, key, ca, nil
}

// checkEgressCA: the pair must be a CA certificate and its key.
func checkEgressCA(certPEM, keyPEM string) error {
	pair, err := tls.X509KeyPair([]byte(certPEM), []byte(keyPEM))
	if err != nil {
		return fmt.Errorf("%v: %w", err, errdefs.ErrInvalidArgument)
	}
	c, err := x509.ParseCertificate(pair.Certificate[0])
	if err != nil {
		return fmt.Errorf("%v: %w", err, errdefs.ErrInvalidArgument)
	}
	if !c.IsCA {
		return fmt.Errorf("not a CA certificate: %w", errdefs.ErrInvalidArgument)
	}
	return nil
}

// PinnedConfig is a client TLS config that accepts only a server whose
// certificate chains to a CA certificate (sent with it) whose SHA-256 is
// pin, and whose role is master. No system roots, no host name: the pin
// is the trust.
func PinnedConfig(pin []byte) *tls.Config {
	return &tls.Config{
		MinVersion: tls.VersionTLS13,
		// The chain is checked below against the pinned CA instead of
		// system roots (the listener's address may be any name).
		InsecureSkipVerify: true, //nolint:gosec // G402: verified in VerifyConnection against the pinned CA
		VerifyConnection: func(cs tls.ConnectionState) error {
			if len(cs.PeerCertificates) < 2 {
				return fmt.Errorf("join listener sent no CA certificate with its own: %w", errdefs.ErrPermissionDenied)
			}
			var root *x509.Certificate
			for _, c := range cs.PeerCertificates[1:] {
				if sum := sha256.Sum256(c.Raw); bytes.Equal(sum[:], pin) {
					root = c
				}
			}
			if root == nil {
				return fmt.Errorf("join listener's CA is not the one the token names: %w", errdefs.ErrPermissionDenied)
			}
			roots := x509.NewCertPool()
			roots.AddCert(root)
			if _, err := cs.PeerCertificates[0].Verify(x509.VerifyOptions{Roots: roots, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}); err != nil {
				return fmt.Errorf("join listener's certificate: %v: %w", err, errdefs.ErrPermissionDenied)
			}
			return pki.CheckPeer(cs.PeerCertificates[0], "", pki.RoleMaster)
		},
	}
}

func writeFile(path string, data []byte, mode os.FileMode) error {
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, data, mode); err != nil {
		return err
	}
	if err := os.Chmod(tmp, mode); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}
