package master

import (
	"context"
	"crypto"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/network/egress"
	"github.com/cubesandbox/cube/internal/pki"
)

// Joining: a compute-only node obtains its node certificate with a
// one-time token an operator made (cubecli node join-token), so that
// adding a node never copies the CA key to it. The token is
//
//	cjt1.<id>.<secret>.<sha256 of the CA certificate, hex>
//
// The catalog keeps the id and the secret's SHA-256 only; the CA hash lets
// the node check it talks to this cluster's master before it sends the
// token (the join listener's certificate is signed by that CA and sent
// with it).

// JoinTokenPrefix starts every join token.
const JoinTokenPrefix = "cjt1"

// DefaultJoinTokenTTL is a token's life when none is asked for.
const DefaultJoinTokenTTL = time.Hour

// joinCA is the CA joins are signed with, loaded from join.ca_dir.
func loadJoinCA(dir string) (*pki.CA, error) {
	if dir == "" {
		return nil, nil
	}
	ca, err := pki.LoadCA(dir)
	if err != nil {
		return nil, fmt.Errorf("join.ca_dir: %w", err)
	}
	return ca, nil
}

// egressCA is the cluster's egress CA: the CA every node's egress proxy
// signs the certificates of the hosts whose TLS it terminates with, and
// that every sandbox trusts. One per cluster, so a sandbox moved, cloned
// or restored onto another node still trusts the proxy there. It lives
// beside the cluster CA in join.ca_dir (egress-ca.pem, egress-ca-key.pem
// 0600, the files network-agent's [egress] ca_dir holds), made at the
// master's first start when absent, and a join hands it to the node with
// its certificate.
type egressCA struct {
	certPEM, keyPEM []byte
}

// loadEgressCA reads (or makes) the egress CA in dir; nil when dir is ""
// (joins are off), or when dir has neither file and cannot take them (a
// read-only mount of the cluster CA): joins then hand no egress CA and
// each node keeps its own, as the warning says.
func loadEgressCA(dir string, log *slog.Logger) (*egressCA, error) {
	if dir == "" {
		return nil, nil
	}
	_, cerr := os.Stat(filepath.Join(dir, egress.CACertFile))
	_, kerr := os.Stat(filepath.Join(dir, egress.CAKeyFile))
	absent := errors.Is(cerr, os.ErrNotExist) && errors.Is(kerr, os.ErrNotExist)
	// egress.LoadOrCreateCA makes the pair only when neither file
	// exists, and checks that the two belong together.
	if _, err := egress.LoadOrCreateCA(dir); err != nil {
		if absent {
			log.Warn("join.ca_dir holds no egress CA and cannot take one: joined nodes keep their own (docs/network.md, \"The egress CA\")",
				"dir", dir, "err", err)
			return nil, nil
		}
		return nil, fmt.Errorf("join.ca_dir: %w", err)
	}
	certPEM, err := os.ReadFile(filepath.Join(dir, egress.CACertFile))
	if err != nil {
		return nil, fmt.Errorf("join.ca_dir: %w", err)
	}
	keyPEM, err := os.ReadFile(filepath.Join(dir, egress.CAKeyFile))
	if err != nil {
		return nil, fmt.Errorf("join.ca_dir: %w", err)
	}
	if _, err := egress.ParseCA(certPEM, keyPEM); err != nil {
		return nil, fmt.Errorf("join.ca_dir: %w", err)
	}
	return &egressCA{certPEM: certPEM, keyPEM: keyPEM}, nil
}

// EgressCA is the cluster's egress CA, certificate and key (PEM), that a
// join hands the node for its network-agent; nil when joins are off.
func (s *Service) EgressCA() (certPEM, keyPEM []byte) {
	if s.egressCA == nil {
		return nil, nil
	}
	return s.egressCA.certPEM, s.egressCA.keyPEM
}

// JoinCA is the CA joining nodes' certificates are signed with; nil when
// joins are off (no join.ca_dir).
func (s *Service) JoinCA() *pki.CA { return s.joinCA }

// CAHash is the pin of a CA certificate in join tokens.
func CAHash(ca *pki.CA) string {
	sum := sha256.Sum256(ca.Cert.Raw)
	return hex.EncodeToString(sum[:])
}

// CreateJoinToken makes a one-time join token, valid for ttl (an hour
// when 0), for node nodeID ("" = any ID not registered yet).
func (s *Service) CreateJoinToken(ctx context.Context, nodeID string, ttl time.Duration) (string, time.Time, error) {
	if s.joinCA == nil {
		return "", time.Time{}, fmt.Errorf("joins are off: set join.ca_dir (and join.listen): %w", errdefs.ErrFailedPrecondition)
	}
	if nodeID != "" && !nodeIDRE.MatchString(nodeID) {
		return "", time.Time{}, fmt.Errorf("node id %q: 1-64 letters, digits, '.', '_' or '-': %w", nodeID, errdefs.ErrInvalidArgument)
	}
	if ttl == 0 {
		ttl = DefaultJoinTokenTTL
	}
	if ttl < 0 || ttl > 7*24*time.Hour {
		return "", time.Time{}, fmt.Errorf("join token ttl %s: between 0 and a week: %w", ttl, errdefs.ErrInvalidArgument)
	}
	id, secret := randomHex(8), randomHex(32)
	if err := s.cat.CreateJoinToken(ctx, id, hashHex(secret), nodeID, ttl); err != nil {
		return "", time.Time{}, err
	}
	s.log.Info("join token created", "token_id", id, "node_id", nodeID, "ttl", ttl)
	return strings.Join([]string{JoinTokenPrefix, id, secret, CAHash(s.joinCA)}, "."), time.Now().Add(ttl), nil
}

// Join spends token for node nodeID and signs a node certificate for pub,
// the key the node made, valid for hosts (the addresses its api.tcp and
// api.data are dialled at). A registered node's ID needs a token made for
// that ID: a token for any node must not mint a second certificate for a
// node that exists. It returns the certificate and the CA (PEM).
func (s *Service) Join(ctx context.Context, token, nodeID string, pub crypto.PublicKey, hosts []string) (certPEM, caPEM []byte, err error) {
	if s.joinCA == nil {
		return nil, nil, fmt.Errorf("joins are off: %w", errdefs.ErrFailedPrecondition)
	}
	if !nodeIDRE.MatchString(nodeID) {
		return nil, nil, fmt.Errorf("node id %q: 1-64 letters, digits, '.', '_' or '-': %w", nodeID, errdefs.ErrInvalidArgument)
	}
	if len(hosts) > 16 {
		return nil, nil, fmt.Errorf("at most 16 hosts: %w", errdefs.ErrInvalidArgument)
	}
	parts := strings.Split(token, ".")
	if len(parts) != 4 || parts[0] != JoinTokenPrefix {
		return nil, nil, fmt.Errorf("not a join token: %w", errdefs.ErrUnauthenticated)
	}
	known := true
	if _, err := s.cat.GetNode(ctx, nodeID); errdefs.IsNotFound(err) {
		known = false
	} else if err != nil {
		return nil, nil, err
	}
	if err := s.cat.UseJoinToken(ctx, parts[1], hashHex(parts[2]), nodeID, known); err != nil {
		s.log.Warn("join refused", "token_id", parts[1], "node_id", nodeID, "err", err)
		return nil, nil, err
	}
	certPEM, err = s.joinCA.Sign(pub, nodeID, pki.RoleNode, hosts...)
	if err != nil {
		return nil, nil, err
	}
	s.log.Info("node joined: certificate issued", "token_id", parts[1], "node_id", nodeID, "hosts", hosts)
	return certPEM, s.joinCA.CertPEM, nil
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

func hashHex(s string) string {
	sum := sha256.Sum256([]byte(s))
	return hex.EncodeToString(sum[:])
}
