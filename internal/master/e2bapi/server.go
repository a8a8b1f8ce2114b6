// Package e2bapi is cubemaster's E2B-compatible REST API: the paths,
// bodies, status codes and error shapes the unmodified `e2b` SDKs use
// (checked against e2b@2.51.0's bundled OpenAPI types), over master.Service.
//
// Every path but GET /health needs a key in X-API-Key (cubecli apikey
// create), and every call is scoped to the key's team (master.WithTeam):
// another team's sandbox or snapshot is 404, as one that does not exist.
// Errors are {"code": <status>, "message": "..."} with 400 for bad
// input, 401 for a missing or unknown key, 404 for an unknown sandbox or
// template, 409 for a verb the sandbox's state forbids, 429 (with
// Retry-After) when every node refused for lack of room, 429 (without:
// waiting does not help) when a create would take the team over a quota, 501 for what the
// nodes cannot do yet, 503 when no node can be reached, 500 otherwise.
package e2bapi

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/master"
	"github.com/cubesandbox/cube/internal/master/apikey"
	"github.com/cubesandbox/cube/internal/master/catalog"
	"github.com/cubesandbox/cube/internal/master/scheduler"
	"github.com/cubesandbox/cube/internal/master/templatebuild"
	"github.com/cubesandbox/cube/internal/sandboxid"
)

// Backend is what the API needs from cubemaster.
type Backend interface {
	VerifyAPIKey(ctx context.Context, secret string) (*catalog.APIKey, error)
	Ping(ctx context.Context) error
	Create(ctx context.Context, req master.CreateRequest) (*catalog.Sandbox, error)
	Get(ctx context.Context, id string) (*catalog.Sandbox, error)
	List(ctx context.Context, q catalog.Query) ([]*catalog.Sandbox, string, error)
	Kill(ctx context.Context, id string) error
	Pause(ctx context.Context, id string) error
	Resume(ctx context.Context, id string, timeout time.Duration) (*catalog.Sandbox, error)
	Connect(ctx context.Context, id string, timeout time.Duration) (*catalog.Sandbox, bool, error)
	SetTimeout(ctx context.Context, id string, timeout time.Duration) error
	Refresh(ctx context.Context, id string, d time.Duration) error
	UpdateNetwork(ctx context.Context, id string, n catalog.Network) error
	Snapshot(ctx context.Context, id, name string) (*catalog.Snapshot, error)
	ListSnapshots(ctx context.Context, q catalog.SnapshotQuery) ([]*catalog.Snapshot, string, error)
	Fork(ctx context.Context, id string, count int, timeout time.Duration) ([]master.ForkResult, error)
	Metrics(ctx context.Context, id string, start, end time.Time) ([]master.Metric, error)
	Events(ctx context.Context, q catalog.EventQuery) ([]catalog.Event, error)
	// SandboxLog is Events merged with the log of what ran in the sandbox.
	SandboxLog(ctx context.Context, q catalog.EventQuery) ([]catalog.Event, error)
	Templates() []master.Template
	GetTemplate(ctx context.Context, name string) (master.Template, error)
	DeleteFromAPI(ctx context.Context, name string, admin bool) ([]string, error)
	Audit(ctx context.Context, sandboxID, action string, key *catalog.APIKey)
	PutSecret(ctx context.Context, name, value string, replace bool) (*master.SecretMeta, error)
	ListSecrets(ctx context.Context) ([]master.SecretMeta, error)
	DeleteSecret(ctx context.Context, name string) error
	CreateVolume(ctx context.Context, name string, sizeMiB int64) (*catalog.Volume, error)
	ListVolumes(ctx context.Context) ([]*catalog.Volume, error)
	GetVolume(ctx context.Context, id string) (*catalog.Volume, error)
	DeleteVolume(ctx context.Context, id string) error
	SandboxVolumes(ctx context.Context, id string) ([]master.VolumeMount, error)
}

var _ Backend = (*master.Service)(nil)

// Config is what the API reports about sandboxes beyond the catalog.
type Config struct {
	// Domain is returned as the sandbox domain (<port>-<id>.<domain>).
	Domain string
	// EnvdVersion is reported for rows that have none recorded.
	EnvdVersion string
	// V1DefaultTimeout is the time to live of a POST /sandboxes without
	// one (E2B's older default; /v2 creates default to the master's).
	V1DefaultTimeout time.Duration
	// Defaults for templates (which carry no resources yet).
	MilliCPU, MemoryMiB int64
}

// Handler serves the API.
type Handler struct {
	b   Backend
	cfg Config
	log *slog.Logger
	mux *http.ServeMux
	// patterns are the routes as registered ("METHOD /path"), for Routes.
	patterns []string
	// builds runs template builds (builds.go); nil without a master.
	builds *templatebuild.Engine
}

// New returns the API handler.
func New(b Backend, cfg Config, log *slog.Logger) *Handler {
	if log == nil {
		log = slog.Default()
	}
	h := &Handler{b: b, cfg: cfg, log: log, mux: http.NewServeMux(), builds: newBuilds(b, log)}
	h.routes()
	return h
}

func (h *Handler) routes() {
	m := h.mux
	m.HandleFunc("GET /health", h.health)
	h.patterns = append(h.patterns, "GET /health")
	auth := func(pattern string, fn http.HandlerFunc) {
		m.Handle(pattern, h.authenticated(fn))
		h.patterns = append(h.patterns, pattern)
	}
	// Verbs on a sandbox leave an audit event in its log when they
	// succeed (who did what); creates record theirs in create.
	audited := func(pattern, action string, fn http.HandlerFunc) { auth(pattern, h.audited(action, fn)) }
	auth("POST /sandboxes", h.createV1)
	auth("POST /v2/sandboxes", h.createV2)
	auth("GET /sandboxes", h.listV1)
	auth("GET /v2/sandboxes", h.listV2)
	auth("GET /sandboxes/metrics", h.metricsMany)
	auth("GET /sandboxes/{sandboxID}", h.get)
	audited("DELETE /sandboxes/{sandboxID}", "kill", h.kill)
	audited("POST /sandboxes/{sandboxID}/pause", "pause", h.pause)
	audited("POST /sandboxes/{sandboxID}/resume", "resume", h.resume)
	audited("POST /sandboxes/{sandboxID}/connect", "connect", h.connectV1)
	audited("POST /v2/sandboxes/{sandboxID}/connect", "connect", h.connectV2)
	audited("POST /sandboxes/{sandboxID}/timeout", "set timeout", h.setTimeout)
	audited("POST /sandboxes/{sandboxID}/refreshes", "refresh", h.refresh)
	audited("PUT /sandboxes/{sandboxID}/network", "update network", h.network)
	audited("POST /sandboxes/{sandboxID}/snapshots", "snapshot", h.snapshot)
	audited("POST /sandboxes/{sandboxID}/fork", "fork", h.fork)
	auth("GET /sandboxes/{sandboxID}/metrics", h.metrics)
	auth("GET /sandboxes/{sandboxID}/logs", h.logsV1)
	auth("GET /v2/sandboxes/{sandboxID}/logs", h.logsV2)
	auth("GET /snapshots", h.listSnapshots)
	auth("GET /templates", h.listTemplates)
	auth("GET /templates/{templateID}", h.getTemplate)
	auth("DELETE /templates/{templateID}", h.deleteTemplate)
	auth("GET /templates/aliases/{alias}", h.templateAlias)
	h.buildRoutes(auth)
	auth("POST /secrets", h.createSecret)
	auth("GET /secrets", h.listSecrets)
	auth("PUT /secrets/{name}", h.replaceSecret)
	auth("DELETE /secrets/{name}", h.deleteSecret)
	auth("POST /volumes", h.createVolume)
	auth("GET /volumes", h.listVolumes)
	auth("GET /volumes/{volumeID}", h.getVolume)
	auth("DELETE /volumes/{volumeID}", h.deleteVolume)
	// What the routes above lack of the SDKs' spec (fallback.go), else
	// 404. DELETE /templates/tags is named here: DELETE
	// /templates/{templateID} would take it otherwise.
	fallback := h.fallbackMux()
	m.Handle("DELETE /templates/tags", fallback)
	m.HandleFunc("/", h.notFound(fallback))
}

// Routes are the API's routes ("METHOD /path/{param}") in the order they
// were registered, GET /health (the only one without a key) first: the
// listener matrix (internal/launcher) calls each, so a new route is
// probed without a change there.
func (h *Handler) Routes() []string { return slices.Clone(h.patterns) }

// statusWriter records the status for the access log.
type statusWriter struct {
	http.ResponseWriter
	code int
}

func (s *statusWriter) WriteHeader(code int) {
	s.code = code
	s.ResponseWriter.WriteHeader(code)
}

// ServeHTTP implements http.Handler, with an access log line per request.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	start := time.Now()
	sw := &statusWriter{ResponseWriter: w, code: http.StatusOK}
	h.mux.ServeHTTP(sw, r)
	level := slog.LevelDebug
	if sw.code >= 500 {
		level = slog.LevelWarn
	}
	h.log.Log(r.Context(), level, "api", "method", r.Method, "path", r.URL.Path, "status", sw.code,
		"sandbox_id", r.PathValue("sandboxID"), "duration", time.Since(start))
}

type keyCtx struct{}

func (h *Handler) authenticated(next http.HandlerFunc) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key, err := h.b.VerifyAPIKey(r.Context(), r.Header.Get("X-API-Key"))
		if err != nil {
			writeError(w, err)
			return
		}
		// Every call is scoped to the key's team: the master answers
		// another team's sandboxes and snapshots as not found.
		ctx := master.WithTeam(context.WithValue(r.Context(), keyCtx{}, key), key.Team)
		next(w, r.WithContext(ctx))
	})
}

// audited runs fn and, when it succeeded (2xx), records who did action to
// the sandbox of the path.
func (h *Handler) audited(action string, fn http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		sw := &statusWriter{ResponseWriter: w, code: http.StatusOK}
		fn(sw, r)
		if sw.code >= 200 && sw.code < 300 {
			h.b.Audit(r.Context(), r.PathValue("sandboxID"), action, apiKey(r))
		}
	}
}

func apiKey(r *http.Request) *catalog.APIKey {
	k, _ := r.Context().Value(keyCtx{}).(*catalog.APIKey)
	return k
}

func apiKeyID(r *http.Request) string {
	if k, ok := r.Context().Value(keyCtx{}).(*catalog.APIKey); ok {
		return k.ID
	}
	return ""
}

// Serve serves h on ln until ctx ends.
func Serve(ctx context.Context, h http.Handler, ln net.Listener) error {
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second, IdleTimeout: 2 * time.Minute}
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil {
		_ = srv.Close()
	}
	return nil
}

// statusOf maps an error to its HTTP status, once, here.
func statusOf(err error) (int, string) {
	var nn *scheduler.NoNodeError
	isNoNode := errors.As(err, &nn)
	var qe *catalog.QuotaError
	switch {
	case errors.As(err, &qe):
		return http.StatusTooManyRequests, "team_quota_exceeded"
	case errors.Is(err, apikey.ErrUnauthenticated):
		return http.StatusUnauthorized, ""
	case errdefs.IsPermissionDenied(err):
		return http.StatusForbidden, ""
	case errdefs.IsInvalidArgument(err):
		return http.StatusBadRequest, ""
	case errdefs.IsNotFound(err):
		return http.StatusNotFound, ""
	case errdefs.IsAlreadyExists(err), errdefs.IsFailedPrecondition(err), errors.Is(err, errdefs.ErrAborted):
		if isNoNode {
			return http.StatusServiceUnavailable, "sandbox_no_compatible_node"
		}
		return http.StatusConflict, ""
	case errdefs.IsNoSpace(err):
		// A full disk does not pass by retrying (a 429 would have the
		// SDKs retry): 507, with the message naming the filesystem.
		return http.StatusInsufficientStorage, "insufficient_storage"
	case errdefs.IsResourceExhausted(err):
		return http.StatusTooManyRequests, "sandbox_capacity_unavailable"
	case errdefs.IsUnavailable(err):
		if isNoNode {
			return http.StatusServiceUnavailable, "sandbox_capacity_unavailable"
		}
		return http.StatusServiceUnavailable, ""
	case errdefs.IsNotImplemented(err):
		return http.StatusNotImplemented, ""
	case errors.Is(err, context.DeadlineExceeded):
		return http.StatusGatewayTimeout, "sandbox_placement_timeout"
	}
	return http.StatusInternalServerError, "internal_server_error"
}

func writeError(w http.ResponseWriter, err error) {
	code, ecode := statusOf(err)
	if code == http.StatusTooManyRequests && ecode != "team_quota_exceeded" {
		// The SDKs retry a 429 that says when; a team over its quota
		// stays over it until one of its sandboxes goes, so that 429
		// names no time and the SDK raises RateLimitError at once.
		w.Header().Set("Retry-After", "1")
	}
	writeJSON(w, code, errorBody{Code: code, Message: err.Error(), ErrorCode: ecode})
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(v)
}

// maxBody bounds request bodies (metadata, env vars, network rules).
const maxBody = 1 << 20

// decode reads an optional JSON body into v; required makes an empty body
// a 400.
func decode(w http.ResponseWriter, r *http.Request, v any, required bool) error {
	data, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxBody))
	if err != nil {
		return fmt.Errorf("request body: %v: %w", err, errdefs.ErrInvalidArgument)
	}
	if len(strings.TrimSpace(string(data))) == 0 {
		if required {
			return fmt.Errorf("request body required: %w", errdefs.ErrInvalidArgument)
		}
		return nil
	}
	if err := json.Unmarshal(data, v); err != nil {
		return fmt.Errorf("request body is not valid JSON for this endpoint: %v: %w", err, errdefs.ErrInvalidArgument)
	}
	return nil
}

// pathID reads and checks the sandbox ID in the path.
func pathID(r *http.Request) (string, error) {
	id := r.PathValue("sandboxID")
	if err := sandboxid.Validate("sandbox", id); err != nil {
		return "", err
	}
	return id, nil
}

// seconds turns an optional JSON seconds field into a duration (0 when
// absent); negative values are a 400.
func seconds(field string, v *int64) (time.Duration, error) {
	if v == nil {
		return 0, nil
	}
	if *v < 0 {
		return 0, fmt.Errorf("%s: must not be negative: %w", field, errdefs.ErrInvalidArgument)
	}
	if *v > 1<<31 {
		return 0, fmt.Errorf("%s: %d is out of range: %w", field, *v, errdefs.ErrInvalidArgument)
	}
	return time.Duration(*v) * time.Second, nil
}

func (h *Handler) health(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), 2*time.Second)
	defer cancel()
	if err := h.b.Ping(ctx); err != nil {
		writeError(w, fmt.Errorf("catalog: %v: %w", err, errdefs.ErrUnavailable))
		return
	}
	writeJSON(w, http.StatusOK, map[string]string{"message": "Health check successful"})
}
