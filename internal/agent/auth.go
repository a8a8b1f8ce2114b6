package agent

import (
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	"connectrpc.com/connect"

	"github.com/cubesandbox/cube/internal/agent/identity"
	"github.com/cubesandbox/cube/internal/agent/rpcerr"
	"github.com/cubesandbox/cube/internal/agentproto"
	"github.com/cubesandbox/cube/internal/errdefs"
)

// AccessTokenHeader carries the sandbox's access token (envd's name).
const AccessTokenHeader = agentproto.AccessTokenHeader

// withAuth is the one gate in front of every route:
//
//   - Once the sandbox has an access token (from its create spec, as a
//     verifier the agent starts with: Config.TokenHash; or set by /init
//     or a reinit), every request must carry it in X-Access-Token, except
//     GET /health, and /files, which may instead carry a signature made
//     with it (envd's signed upload/download URLs).
//   - Routes that act as a user (the Connect services and /files) get the
//     user in their context: the Basic-auth username (for /files the
//     username query parameter), or the default user.
//
// Errors on Connect routes are written in the Connect protocol, so the
// SDKs see a proper code; elsewhere as envd's JSON error.
func (a *Server) withAuth(next http.Handler) http.Handler {
	ew := connect.NewErrorWriter()
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		path := r.URL.Path
		files := path == "/files"
		rpc := strings.HasPrefix(path, "/process.Process/") || strings.HasPrefix(path, "/filesystem.Filesystem/")
		fail := func(w http.ResponseWriter, r *http.Request, err error) {
			if rpc && ew.IsSupported(r) {
				_ = ew.Write(w, r, rpcerr.ToConnect(err))
				return
			}
			rpcerr.WriteHTTP(w, err)
		}
		if required, _ := a.state.tokenRequired(); required && !(r.Method == http.MethodGet && path == "/health") {
			var err error
			if files {
				err = a.checkSignature(r)
			} else if !a.state.checkToken(r.Header.Get(AccessTokenHeader)) {
				err = fmt.Errorf("unauthorized access, please provide a valid access token: %w", errdefs.ErrUnauthenticated)
			}
			if err != nil {
				fail(w, r, err)
				return
			}
		}
		if files || rpc {
			u, err := a.actingUser(r, files)
			if err != nil {
				fail(w, r, err)
				return
			}
			r = r.WithContext(identity.WithUser(r.Context(), u))
		}
		next.ServeHTTP(w, r)
	})
}

// actingUser picks the request's Linux user.
func (a *Server) actingUser(r *http.Request, files bool) (*identity.User, error) {
	name, explicit := "", false
	if files && r.URL.Query().Has("username") {
		name, explicit = r.URL.Query().Get("username"), true
	} else if u, _, ok := r.BasicAuth(); ok && u != "" {
		name, explicit = u, true
	}
	if !explicit {
		name = a.state.defaultUser()
	}
	u, err := a.users.Lookup(name)
	if err == nil {
		return u, nil
	}
	if !explicit && errdefs.IsNotFound(err) {
		// A template without the default user: act as root rather than
		// refuse every request that names nobody.
		if root, rerr := a.users.Lookup("root"); rerr == nil {
			return root, nil
		}
	}
	return nil, fmt.Errorf("invalid username %q: %v: %w", name, err, errdefs.ErrUnauthenticated)
}

// checkSignature accepts /files when the header token matches or when the
// query carries envd's signature: "v1_" + base64(sha256(path:operation:
// username:token[:expiration])) without padding, not yet expired.
func (a *Server) checkSignature(r *http.Request) error {
	if h := r.Header.Get(AccessTokenHeader); h != "" {
		if a.state.checkToken(h) {
			return nil
		}
		return fmt.Errorf("access token present in header but does not match: %w", errdefs.ErrUnauthenticated)
	}
	_, token := a.state.tokenRequired()
	if token == "" {
		// Only the verifier so far: a signature cannot be checked
		// against it. The first request with the token (cubelet's or
		// the control plane's, before the sandbox is handed out)
		// teaches the agent the token.
		return fmt.Errorf("signed URLs are accepted once the agent has seen its access token: %w", errdefs.ErrUnauthenticated)
	}
	q := r.URL.Query()
	sig := q.Get("signature")
	if sig == "" {
		return fmt.Errorf("missing signature query parameter (or %s header): %w", AccessTokenHeader, errdefs.ErrUnauthenticated)
	}
	op := "read"
	if r.Method == http.MethodPost {
		op = "write"
	}
	parts := []string{q.Get("path"), op, q.Get("username"), token}
	var exp int64
	if v := q.Get("signature_expiration"); v != "" {
		var err error
		if exp, err = strconv.ParseInt(v, 10, 64); err != nil {
			return fmt.Errorf("signature_expiration %q: %w", v, errdefs.ErrUnauthenticated)
		}
		parts = append(parts, v)
	}
	if !equal(sig, Signature(parts...)) {
		return fmt.Errorf("invalid signature: %w", errdefs.ErrUnauthenticated)
	}
	if exp != 0 && exp < time.Now().Unix() {
		return errors.Join(errors.New("signature is already expired"), errdefs.ErrUnauthenticated)
	}
	return nil
}

// Signature computes envd's v1 signature over its colon-joined parts.
func Signature(parts ...string) string {
	sum := sha256.Sum256([]byte(strings.Join(parts, ":")))
	return "v1_" + base64.RawStdEncoding.EncodeToString(sum[:])
}

func equal(a, b string) bool {
	return subtle.ConstantTimeCompare([]byte(a), []byte(b)) == 1
}
