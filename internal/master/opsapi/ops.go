// Package opsapi is CubeOps: the operators' API and the web console it
// serves, on cubemaster's api.ops listener. Two kinds of caller:
//
//   - the admin, logged in with a password (bcrypt hash in the config):
//     a session cookie (HttpOnly, SameSite=Strict) and a CSRF token the
//     console sends in X-CSRF-Token on every request that changes
//     something; the admin sees every team;
//   - a team user, with an API key: in X-API-Key (scripts; no cookie, so
//     no CSRF), or traded at login for a session scoped to the key's team
//     (the console); the key's team only, as on the E2B API.
//
// The console is plain HTML, CSS and JavaScript embedded in the binary
// (console/): no build step and no server-side rendering.
package opsapi

import (
	"context"
	"crypto/rand"
	"crypto/subtle"
	"embed"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"net/http"
	"sync"
	"time"

	"golang.org/x/crypto/bcrypt"

	"github.com/cubesandbox/cube/internal/clientlimit"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/master"
	"github.com/cubesandbox/cube/internal/master/apikey"
	"github.com/cubesandbox/cube/internal/master/catalog"
)

// Backend is the master as the ops API uses it.
type Backend interface {
	VerifyAPIKey(ctx context.Context, secret string) (*catalog.APIKey, error)
	Nodes(ctx context.Context) ([]master.NodeView, error)
	SetSchedulable(ctx context.Context, nodeID string, on bool) (master.NodeView, error)
	List(ctx context.Context, q catalog.Query) ([]*catalog.Sandbox, string, error)
	Get(ctx context.Context, id string) (*catalog.Sandbox, error)
	Create(ctx context.Context, req master.CreateRequest) (*catalog.Sandbox, error)
	Kill(ctx context.Context, id string) error
	Pause(ctx context.Context, id string) error
	Resume(ctx context.Context, id string, timeout time.Duration) (*catalog.Sandbox, error)
	Snapshot(ctx context.Context, id, name string) (*catalog.Snapshot, error)
	Fork(ctx context.Context, id string, count int, timeout time.Duration) ([]master.ForkResult, error)
	ListSnapshots(ctx context.Context, q catalog.SnapshotQuery) ([]*catalog.Snapshot, string, error)
	Metrics(ctx context.Context, id string, start, end time.Time) ([]master.Metric, error)
	SandboxLog(ctx context.Context, q catalog.EventQuery) ([]catalog.Event, error)
	Templates() []master.Template
	Audit(ctx context.Context, sandboxID, action string, key *catalog.APIKey)

	// Admin only, in the console.
	Drain(ctx context.Context, nodeID string, o master.DrainOptions, progress func(master.DrainEvent)) error
	ImportTemplate(ctx context.Context, req master.TemplateImport) (master.Template, error)
	ImportUpload(ctx context.Context, req master.TemplateImport, body io.Reader) (master.Template, error)
	WarmTemplate(ctx context.Context, name, runtime string, progress func(node string, err error)) (master.Template, error)
	DeleteTemplate(ctx context.Context, name string) ([]string, error)
	GetTemplate(ctx context.Context, name string) (master.Template, error)
	Keys() *apikey.Keys
	CreateTeam(ctx context.Context, name string, q catalog.Quota) (*catalog.Team, error)
	ListTeams(ctx context.Context) ([]*catalog.Team, map[string]catalog.TeamUsage, error)
	SetTeamQuota(ctx context.Context, name string, q catalog.Quota) error
	DeleteTeam(ctx context.Context, name string, force bool, by string) (*master.TeamDeleted, error)
}

var (
	_ Backend = (*master.Service)(nil)
	_ Agents  = (*master.Service)(nil)
)

// Config configures the ops API.
type Config struct {
	// AdminUser and AdminPasswordHash (bcrypt) admit the admin; an empty
	// hash disables the password login (API keys only).
	AdminUser, AdminPasswordHash string
	// SessionTTL is how long a login lasts; 12 h when 0.
	SessionTTL time.Duration
	// Secure marks the cookie Secure (the listener serves TLS).
	Secure bool
	// LiveInterval is how often the live stream looks for changes; 1 s
	// when 0.
	LiveInterval time.Duration
	// Done, when set, cancels the running jobs (drains, imports, warms)
	// once it is closed: the master is shutting down.
	Done <-chan struct{}
}

//go:embed console
var consoleFS embed.FS

// Handler serves the ops API and the console.
type Handler struct {
	b   Backend
	cfg Config
	log *slog.Logger
	mux *http.ServeMux

	mu       sync.Mutex
	sessions map[string]*session // by cookie value
	logins   *clientlimit.Limiter

	jobs    *jobs
	trail   *auditLog
	streams streams
}

type session struct {
	user    string
	csrf    string
	expires time.Time
	key     *catalog.APIKey // a team user's session; nil for the admin
	// secret is the team user's API key, verified again at each request
	// (through the key cache), so a revoked key ends its sessions.
	secret string
}

// caller is who a request acts as.
type caller struct {
	admin bool
	user  string
	key   *catalog.APIKey // team users
	sess  *session
}

type callerKey struct{}

// New returns the handler.
func New(b Backend, cfg Config, log *slog.Logger) *Handler {
	if log == nil {
		log = slog.Default()
	}
	if cfg.SessionTTL <= 0 {
		cfg.SessionTTL = 12 * time.Hour
	}
	if cfg.LiveInterval <= 0 {
		cfg.LiveInterval = time.Second
	}
	h := &Handler{b: b, cfg: cfg, log: log, mux: http.NewServeMux(), sessions: map[string]*session{}, logins: clientlimit.New(0.2, 10),
		jobs: newJobs(), trail: newAuditLog(auditKeep)}
	h.routes()
	return h
}

// ServeHTTP implements http.Handler.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	// The console is never framed (clickjacking) and loads nothing from
	// elsewhere.
	w.Header().Set("X-Frame-Options", "DENY")
	w.Header().Set("Content-Security-Policy", "default-src 'self'; style-src 'self' 'unsafe-inline'; frame-ancestors 'none'")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	start := time.Now()
	h.mux.ServeHTTP(w, r)
	h.log.Debug("ops", "method", r.Method, "path", r.URL.Path, "duration", time.Since(start))
}

func (h *Handler) routes() {
	m := h.mux
	sub, _ := fs.Sub(consoleFS, "console")
	m.Handle("GET /", http.FileServerFS(sub))
	m.HandleFunc("POST /ops/api/login", h.login)
	api := func(pattern string, admin bool, fn http.HandlerFunc) { m.Handle(pattern, h.authed(admin, fn)) }
	api("POST /ops/api/logout", false, h.logout)
	api("GET /ops/api/session", false, h.whoami)
	api("GET /ops/api/nodes", true, h.nodes)
	api("POST /ops/api/nodes/{nodeID}/cordon", true, h.cordon(false))
	api("POST /ops/api/nodes/{nodeID}/uncordon", true, h.cordon(true))
	api("GET /ops/api/sandboxes", false, h.sandboxes)
	api("POST /ops/api/sandboxes", false, h.create)
	api("GET /ops/api/sandboxes/{sandboxID}", false, h.sandbox)
	api("GET /ops/api/sandboxes/{sandboxID}/metrics", false, h.metrics)
	api("GET /ops/api/sandboxes/{sandboxID}/logs", false, h.logs)
	api("POST /ops/api/sandboxes/{sandboxID}/pause", false, h.verb("pause"))
	api("POST /ops/api/sandboxes/{sandboxID}/resume", false, h.verb("resume"))
	api("POST /ops/api/sandboxes/{sandboxID}/kill", false, h.verb("kill"))
	api("POST /ops/api/sandboxes/{sandboxID}/snapshot", false, h.snapshot)
	api("POST /ops/api/sandboxes/{sandboxID}/fork", false, h.fork)
	api("GET /ops/api/templates", false, h.templates)
	api("GET /ops/api/lineage", false, h.lineage)
	api("GET /ops/api/live", false, h.live)
	api("GET /ops/api/sandboxes/{sandboxID}/live", false, h.sandboxLive)
	api("GET /ops/api/sandboxes/{sandboxID}/terminal", false, h.terminal)
	api("GET /ops/api/sandboxes/{sandboxID}/files", false, h.listFiles)
	api("GET /ops/api/sandboxes/{sandboxID}/file", false, h.readFile)
	api("PUT /ops/api/sandboxes/{sandboxID}/file", false, h.writeFile)
	api("POST /ops/api/nodes/{nodeID}/drain", true, h.drain)
	api("POST /ops/api/templates", true, h.importTemplate)
	api("POST /ops/api/templates/{templateID}/warm", true, h.warmTemplate)
	api("PUT /ops/api/templates/{templateID}/upload", true, h.uploadTemplate)
	api("DELETE /ops/api/templates/{templateID}", true, h.deleteTemplate)
	api("GET /ops/api/keys", true, h.listKeys)
	api("POST /ops/api/keys", true, h.createKey)
	api("DELETE /ops/api/keys/{keyID}", true, h.deleteKey)
	api("GET /ops/api/teams", true, h.listTeams)
	api("POST /ops/api/teams", true, h.createTeam)
	api("PUT /ops/api/teams/{team}/quota", true, h.setQuota)
	api("DELETE /ops/api/teams/{team}", true, h.deleteTeam)
	api("GET /ops/api/jobs", false, h.listJobs)
	api("GET /ops/api/jobs/{jobID}", false, h.getJob)
	api("POST /ops/api/jobs/{jobID}/cancel", false, h.cancelJob)
	api("GET /ops/api/events", false, h.events)
}

func newToken() string {
	b := make([]byte, 32)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

const cookieName = "cube_ops_session"

// HashPassword is the bcrypt hash console.admin_password_hash holds.
func HashPassword(pw string) (string, error) {
	if len(pw) < 8 {
		return "", fmt.Errorf("a password of %d characters: want at least 8: %w", len(pw), errdefs.ErrInvalidArgument)
	}
	h, err := bcrypt.GenerateFromPassword([]byte(pw), bcrypt.DefaultCost)
	return string(h), err
}

// login starts a session: the admin's, with the password, or a team
// user's, with an API key (browsers cannot put the key on a live stream
// or a WebSocket, so the console trades it for a session scoped to the
// key's team).
func (h *Handler) login(w http.ResponseWriter, r *http.Request) {
	var body struct{ User, Password, Key string }
	if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, 4096)).Decode(&body); err != nil {
		writeError(w, fmt.Errorf("login body: %v: %w", err, errdefs.ErrInvalidArgument))
		return
	}
	// A client refused 10 times waits (one more try per 5 s) before the
	// key lookup or bcrypt runs again: online guessing is slow, and a
	// flood costs no CPU.
	client := clientlimit.ClientOf(r.RemoteAddr)
	if !h.logins.Take(client) {
		w.Header().Set("Retry-After", "5")
		writeJSON(w, http.StatusTooManyRequests, map[string]string{"message": "too many failed logins from this address; try again later"})
		return
	}
	if body.Key != "" {
		key, err := h.b.VerifyAPIKey(r.Context(), body.Key)
		if err != nil {
			h.log.Warn("ops: failed key login", "remote", r.RemoteAddr)
			h.trail.add(auditEntry{T: time.Now().UnixMilli(), By: "(API key)", Action: "login", Error: "unknown key", Remote: r.RemoteAddr})
			writeError(w, fmt.Errorf("%v: %w", err, errUnauthenticated))
			return
		}
		h.logins.Refund(client)
		s := h.startSession(w, &session{user: key.Name, key: key, secret: body.Key})
		h.trail.add(auditEntry{T: time.Now().UnixMilli(), By: key.Name, Team: key.Team, Action: "login", OK: true, Remote: r.RemoteAddr})
		writeJSON(w, http.StatusOK, map[string]any{"user": s.user, "admin": false, "team": key.Team, "csrf": s.csrf})
		return
	}
	ok := h.cfg.AdminPasswordHash != "" &&
		subtle.ConstantTimeCompare([]byte(body.User), []byte(h.cfg.AdminUser)) == 1
	// bcrypt runs whatever the user name, so a wrong name takes as long
	// as a wrong password.
	hash := h.cfg.AdminPasswordHash
	if hash == "" {
		hash = "$2a$10$invalidinvalidinvalidinvalidinvalidinvalidinvalidinva"
	}
	if bcrypt.CompareHashAndPassword([]byte(hash), []byte(body.Password)) != nil {
		ok = false
	}
	if !ok {
		h.log.Warn("ops: failed login", "user", body.User, "remote", r.RemoteAddr)
		h.trail.add(auditEntry{T: time.Now().UnixMilli(), By: body.User, Action: "login", Error: "wrong user or password", Remote: r.RemoteAddr})
		writeError(w, fmt.Errorf("wrong user or password: %w", errUnauthenticated))
		return
	}
	h.logins.Refund(client)
	s := h.startSession(w, &session{user: body.User})
	h.trail.add(auditEntry{T: time.Now().UnixMilli(), By: body.User, Admin: true, Action: "login", OK: true, Remote: r.RemoteAddr})
	h.log.Info("ops: admin logged in", "user", body.User, "remote", r.RemoteAddr)
	writeJSON(w, http.StatusOK, map[string]any{"user": s.user, "admin": true, "csrf": s.csrf})
}

// startSession records s with a fresh CSRF token and sets its cookie.
func (h *Handler) startSession(w http.ResponseWriter, s *session) *session {
	s.csrf, s.expires = newToken(), time.Now().Add(h.cfg.SessionTTL)
	tok := newToken()
	h.mu.Lock()
	now := time.Now()
	for k, old := range h.sessions { // expired ones go at each login
		if now.After(old.expires) {
			delete(h.sessions, k)
		}
	}
	h.sessions[tok] = s
	h.mu.Unlock()
	http.SetCookie(w, &http.Cookie{Name: cookieName, Value: tok, Path: "/", HttpOnly: true, Secure: h.cfg.Secure, //nolint:gosec // Secure follows the listener: a plaintext loopback console cannot set it
		SameSite: http.SameSiteStrictMode, Expires: s.expires})
	return s
}

func (h *Handler) logout(w http.ResponseWriter, r *http.Request) {
	if c, err := r.Cookie(cookieName); err == nil {
		h.mu.Lock()
		delete(h.sessions, c.Value)
		h.mu.Unlock()
	}
	http.SetCookie(w, &http.Cookie{Name: cookieName, Value: "", Path: "/", MaxAge: -1, HttpOnly: true, Secure: h.cfg.Secure, //nolint:gosec // Secure follows the listener: a plaintext loopback console cannot set it
		SameSite: http.SameSiteStrictMode})
	w.WriteHeader(http.StatusNoContent)
}

func (h *Handler) whoami(w http.ResponseWriter, r *http.Request) {
	c := callerOf(r)
	out := map[string]any{"user": c.user, "admin": c.admin}
	if c.sess != nil {
		out["csrf"] = c.sess.csrf
	}
	if c.key != nil {
		out["team"] = c.key.Team
	}
	writeJSON(w, http.StatusOK, out)
}

var (
	errUnauthenticated = errors.New("unauthenticated")
	errCSRF            = fmt.Errorf("missing or wrong X-CSRF-Token: %w", errdefs.ErrPermissionDenied)
)

// authed admits a session or an API key, checks CSRF for session
// requests that change something, and scopes team users to their team.
func (h *Handler) authed(adminOnly bool, next http.HandlerFunc) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var c caller
		ctx := r.Context()
		if k := r.Header.Get("X-API-Key"); k != "" {
			key, err := h.b.VerifyAPIKey(ctx, k)
			if err != nil {
				writeError(w, fmt.Errorf("%v: %w", err, errUnauthenticated))
				return
			}
			c = caller{user: key.Name, key: key}
			ctx = master.WithTeam(ctx, key.Team)
		} else if ck, err := r.Cookie(cookieName); err == nil {
			h.mu.Lock()
			s := h.sessions[ck.Value]
			h.mu.Unlock()
			if s == nil || time.Now().After(s.expires) {
				writeError(w, fmt.Errorf("session expired: %w", errUnauthenticated))
				return
			}
			if r.Method != http.MethodGet && r.Method != http.MethodHead &&
				subtle.ConstantTimeCompare([]byte(r.Header.Get("X-CSRF-Token")), []byte(s.csrf)) != 1 {
				writeError(w, errCSRF)
				return
			}
			c = caller{admin: s.key == nil, user: s.user, sess: s, key: s.key}
			if s.key != nil {
				key, err := h.b.VerifyAPIKey(ctx, s.secret)
				if err != nil {
					h.mu.Lock()
					delete(h.sessions, ck.Value)
					h.mu.Unlock()
					writeError(w, fmt.Errorf("the session's API key: %v: %w", err, errUnauthenticated))
					return
				}
				c.key = key
				ctx = master.WithTeam(ctx, key.Team)
			}
		} else {
			writeError(w, fmt.Errorf("log in or send X-API-Key: %w", errUnauthenticated))
			return
		}
		if adminOnly && !c.admin {
			writeError(w, fmt.Errorf("admins only: %w", errdefs.ErrPermissionDenied))
			return
		}
		next(w, r.WithContext(context.WithValue(ctx, callerKey{}, &c)))
	})
}

func callerOf(r *http.Request) *caller {
	c, _ := r.Context().Value(callerKey{}).(*caller)
	if c == nil {
		return &caller{}
	}
	return c
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(v)
}

func writeError(w http.ResponseWriter, err error) {
	code := http.StatusInternalServerError
	switch {
	case errors.Is(err, errUnauthenticated):
		code = http.StatusUnauthorized
	case errdefs.IsPermissionDenied(err):
		code = http.StatusForbidden
	case errors.Is(err, errTooLarge):
		code = http.StatusRequestEntityTooLarge
	case errdefs.IsInvalidArgument(err):
		code = http.StatusBadRequest
	case errdefs.IsNotFound(err):
		code = http.StatusNotFound
	case errdefs.IsFailedPrecondition(err), errdefs.IsAlreadyExists(err):
		code = http.StatusConflict
	case errdefs.IsUnavailable(err), errdefs.IsResourceExhausted(err):
		code = http.StatusServiceUnavailable
	case errdefs.IsNotImplemented(err):
		code = http.StatusNotImplemented
	}
	writeJSON(w, code, map[string]any{"code": code, "message": err.Error()})
}
