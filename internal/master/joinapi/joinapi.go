// Package joinapi is the master's join listener (join.listen): one HTTPS
// route, POST /v1/join, where a new node spends a one-time token for a
// node certificate (package nodejoin is the node's side). It asks for no
// client certificate, since the joining node has none yet: the token
// authenticates the call, and the node authenticates the listener by the
// CA hash in the token, so the listener presents a certificate of the
// cluster CA with the CA's own certificate behind it.
package joinapi

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"time"

	"github.com/cubesandbox/cube/internal/clientlimit"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/master"
	"github.com/cubesandbox/cube/internal/nodejoin"
	"github.com/cubesandbox/cube/internal/pki"
)

// TLSConfig is the join listener's: a key made now and a master
// certificate for it signed by ca, valid for hosts, sent with ca's
// certificate.
func TLSConfig(ca *pki.CA, hosts ...string) (*tls.Config, error) {
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	certPEM, err := ca.Sign(&k.PublicKey, "cubemaster", pki.RoleMaster, hosts...)
	if err != nil {
		return nil, err
	}
	b, _ := pem.Decode(certPEM)
	return &tls.Config{
		MinVersion:   tls.VersionTLS13,
		Certificates: []tls.Certificate{{Certificate: [][]byte{b.Bytes, ca.Cert.Raw}, PrivateKey: k}},
		NextProtos:   []string{"http/1.1"},
	}, nil
}

// Refused joins a client may make (refusedBurst, refilled at refusedRate
// a second) before the listener answers it 429 without reading the
// catalog: every request costs a catalog read and write before its token
// is known to be good, and a guesser must not get to try many.
const (
	refusedRate  = 0.2
	refusedBurst = 10.0
)

// Handler serves POST /v1/join.
func Handler(svc *master.Service, log *slog.Logger) http.Handler {
	limit := clientlimit.New(refusedRate, refusedBurst)
	mux := http.NewServeMux()
	mux.HandleFunc("POST "+nodejoin.Path, func(w http.ResponseWriter, r *http.Request) {
		client := clientlimit.ClientOf(r.RemoteAddr)
		// A token is taken before the catalog is read and given back on
		// success, so parallel guesses cannot all pass the check.
		if !limit.Take(client) {
			log.Warn("join refused: too many refused joins from this client", "remote", r.RemoteAddr)
			w.Header().Set("Retry-After", strconv.Itoa(int(1/refusedRate)))
			http.Error(w, "too many refused joins from this address; try again later", http.StatusTooManyRequests)
			return
		}
		var req nodejoin.Request
		if err := json.NewDecoder(io.LimitReader(r.Body, 64<<10)).Decode(&req); err != nil {
			http.Error(w, "bad request: "+err.Error(), http.StatusBadRequest)
			return
		}
		b, _ := pem.Decode([]byte(req.PublicKey))
		if b == nil {
			http.Error(w, "publicKey: no PEM block", http.StatusBadRequest)
			return
		}
		pub, err := x509.ParsePKIXPublicKey(b.Bytes)
		if err != nil {
			http.Error(w, "publicKey: "+err.Error(), http.StatusBadRequest)
			return
		}
		certPEM, caPEM, err := svc.Join(r.Context(), req.Token, req.NodeID, pub, req.Hosts)
		if err != nil {
			code := http.StatusInternalServerError
			switch {
			case errdefs.IsUnauthenticated(err):
				code = http.StatusUnauthorized
				err = errors.New("join token refused") // nothing for a guesser to learn
			case errdefs.IsInvalidArgument(err):
				code = http.StatusBadRequest
			case errdefs.IsFailedPrecondition(err):
				code = http.StatusConflict
			}
			log.Warn("join refused", "remote", r.RemoteAddr, "node_id", req.NodeID, "err", err)
			msg := err.Error()
			if code == http.StatusInternalServerError {
				// The caller has not proven anything yet: the
				// master's own failures stay in its log.
				msg = "join failed on the master; its log says why"
			}
			http.Error(w, msg, code)
			return
		}
		limit.Refund(client)
		w.Header().Set("Content-Type", "application/json")
		// The cluster's egress CA rides the same answer: the caller has
		// just proven the token, and the node's network-agent needs the
		// key to sign for the hosts whose TLS it terminates.
		egressCert, egressKey := svc.EgressCA()
		_ = json.NewEncoder(w).Encode(nodejoin.Response{Certificate: string(certPEM), CA: string(caPEM),
			EgressCA: string(egressCert), EgressCAKey: string(egressKey)})
	})
	return mux
}

// Serve serves the join listener on ln (already TLS) until ctx ends.
func Serve(ctx context.Context, svc *master.Service, ln net.Listener, log *slog.Logger) error {
	// Callers are unauthenticated until their token checks out: bounded
	// reads, so a slow body cannot hold a connection.
	srv := &http.Server{Handler: Handler(svc, log), ReadHeaderTimeout: 10 * time.Second, ReadTimeout: 30 * time.Second,
		ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelDebug)}
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	select {
	case err := <-errc:
		if errors.Is(err, http.ErrServerClosed) {
			return nil
		}
		return fmt.Errorf("join listener: %w", err)
	case <-ctx.Done():
	}
	_ = srv.Close()
	return nil
}
