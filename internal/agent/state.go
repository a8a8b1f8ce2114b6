package agent

import (
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/http"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/cubesandbox/cube/internal/agent/rpcerr"
	"github.com/cubesandbox/cube/internal/errdefs"
)

// state is what POST /init sets and every request reads: sandbox-wide
// environment variables, the access token, the default user and working
// directory. It lives as long as the agent (and, in a VM, is restored with
// its memory on resume).
type state struct {
	mu  sync.RWMutex
	env map[string]string
	// The access token: required when tokenSet. hash is always its
	// SHA-256; token is the token itself once known ("" while the agent
	// holds only the verifier it started with).
	tokenSet bool
	hash     [sha256.Size]byte
	token    string
	user     string
	workdir  string
}

// setToken makes token the one every request needs ("" = none).
// Callers hold mu.
func (s *state) setToken(token string) {
	s.tokenSet, s.token, s.hash = token != "", token, sha256.Sum256([]byte(token))
}

// checkToken says whether presented is the access token (always true
// when none is set). An agent that started with only the verifier
// learns the token from the first request that presents it, so that it
// can check signed URLs from then on.
func (s *state) checkToken(presented string) bool {
	s.mu.RLock()
	set, token, hash := s.tokenSet, s.token, s.hash
	s.mu.RUnlock()
	if !set {
		return true
	}
	if token != "" {
		return equal(presented, token)
	}
	sum := sha256.Sum256([]byte(presented))
	if subtle.ConstantTimeCompare(sum[:], hash[:]) != 1 {
		return false
	}
	s.mu.Lock()
	if s.tokenSet && s.token == "" && s.hash == sum {
		s.token = presented
	}
	s.mu.Unlock()
	return true
}

// ParseTokenHash reads the verifier a sandbox's agent starts with
// (agentproto.TokenHashEnv, agentproto.TokenHashParam): 64 hex digits.
func ParseTokenHash(v string) ([sha256.Size]byte, error) {
	var h [sha256.Size]byte
	b, err := hex.DecodeString(v)
	if err != nil || len(b) != len(h) {
		return h, fmt.Errorf("access token verifier %q: want %d hex digits: %w", v, 2*len(h), errdefs.ErrInvalidArgument)
	}
	copy(h[:], b)
	return h, nil
}

func (s *state) EnvVars() map[string]string {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return maps.Clone(s.env)
}

func (s *state) Workdir() string {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.workdir
}

// tokenRequired says whether requests need the access token, and
// returns the token itself when the agent knows it ("" while it holds
// only the verifier).
func (s *state) tokenRequired() (bool, string) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.tokenSet, s.token
}

func (s *state) defaultUser() string {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.user
}

// InitRequest is POST /init's body, in envd's field names. Every field is
// optional; absent fields leave the current setting alone.
type InitRequest struct {
	EnvVars        map[string]string `json:"envVars,omitempty"`
	AccessToken    *string           `json:"accessToken,omitempty"`
	Timestamp      *time.Time        `json:"timestamp,omitempty"`
	DefaultUser    *string           `json:"defaultUser,omitempty"`
	DefaultWorkdir *string           `json:"defaultWorkdir,omitempty"`
}

// maxInitBody bounds /init: env vars, a token and a few names.
const maxInitBody = 1 << 20

// handleInit applies an InitRequest. cubelet calls it when the sandbox
// starts, and again after a restore or clone (with the new clock and,
// for a clone, a new token). Once a token is set, /init itself needs it
// (the auth layer checks), so only its holder can re-initialise.
func (a *Server) handleInit(w http.ResponseWriter, r *http.Request) {
	var req InitRequest
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxInitBody))
	if err != nil {
		rpcerr.WriteHTTPStatus(w, http.StatusBadRequest, "read init body: "+err.Error())
		return
	}
	if len(strings.TrimSpace(string(body))) > 0 {
		if err := json.Unmarshal(body, &req); err != nil {
			rpcerr.WriteHTTPStatus(w, http.StatusBadRequest, "init body is not valid JSON: "+err.Error())
			return
		}
	}
	if err := a.validateInit(&req); err != nil {
		rpcerr.WriteHTTP(w, err)
		return
	}
	if req.Timestamp != nil {
		if _, err := a.syncClock(*req.Timestamp); err != nil {
			// Not fatal: a container shares the host clock and cannot set
			// it; the rest of /init still applies.
			a.log.Warn("init: clock not synced", "error", err)
		}
	}
	a.state.mu.Lock()
	if a.state.env == nil {
		a.state.env = map[string]string{}
	}
	maps.Copy(a.state.env, req.EnvVars)
	if req.AccessToken != nil {
		a.state.setToken(*req.AccessToken)
	}
	if req.DefaultUser != nil {
		a.state.user = *req.DefaultUser
	}
	if req.DefaultWorkdir != nil {
		a.state.workdir = *req.DefaultWorkdir
	}
	a.state.mu.Unlock()
	a.log.Info("initialized", "env_vars", len(req.EnvVars), "token", req.AccessToken != nil,
		"default_user", req.DefaultUser != nil, "default_workdir", req.DefaultWorkdir != nil)
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(http.StatusNoContent)
}

func (a *Server) validateInit(req *InitRequest) error {
	var errs []error
	for k, v := range req.EnvVars {
		if k == "" || strings.ContainsAny(k, "=\x00") || strings.ContainsRune(v, 0) {
			errs = append(errs, fmt.Errorf("env var %q: names must be non-empty without '=' or NUL, values without NUL", k))
		}
	}
	if req.DefaultUser != nil {
		if _, err := a.users.Lookup(*req.DefaultUser); err != nil {
			errs = append(errs, fmt.Errorf("default user: %w", err))
		}
	}
	if req.DefaultWorkdir != nil && *req.DefaultWorkdir != "" && !filepath.IsAbs(*req.DefaultWorkdir) {
		errs = append(errs, fmt.Errorf("default workdir %q must be absolute", *req.DefaultWorkdir))
	}
	if req.AccessToken != nil && strings.ContainsAny(*req.AccessToken, "\r\n") {
		errs = append(errs, errors.New("access token must be one line"))
	}
	if len(errs) > 0 {
		return fmt.Errorf("init: %w: %w", errors.Join(errs...), errdefs.ErrInvalidArgument)
	}
	return nil
}

// handleEnvs answers GET /envs: the variables /init set, as a JSON object.
func (a *Server) handleEnvs(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	env := a.state.EnvVars()
	if env == nil {
		env = map[string]string{}
	}
	_ = json.NewEncoder(w).Encode(env)
}

func (a *Server) handleMetrics(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	_ = json.NewEncoder(w).Encode(a.sampler.Collect())
}
