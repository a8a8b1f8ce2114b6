package agent

import (
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
	mu      sync.RWMutex
	env     map[string]string
	token   string // "" = no X-Access-Token required
	user    string
	workdir string
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

func (s *state) accessToken() string {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.token
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
		a.state.token = *req.AccessToken
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
