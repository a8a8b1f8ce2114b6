package e2bapi

import (
	"bufio"
	"fmt"
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/master"
	"github.com/cubesandbox/cube/internal/master/templatebuild"
)

// Template builds (E2B's build API as the SDKs' Template builder calls
// it): POST /v3/templates requests a build, GET
// /templates/{id}/files/{hash} hands out an upload URL for a COPY's files
// (a PUT to /template-files/... with a one-use token: the SDK sends no
// API key there), POST /v2/templates/{id}/builds/{buildID} starts it and
// GET .../status is polled for its status and log. The build itself is
// package templatebuild.

// buildRoutes registers the build routes (auth registers with the API
// key check).
func (h *Handler) buildRoutes(auth func(string, http.HandlerFunc)) {
	auth("POST /v3/templates", h.requestBuild)
	auth("GET /templates/{templateID}/files/{hash}", h.fileUploadLink)
	auth("POST /v2/templates/{templateID}/builds/{buildID}", h.startBuild)
	auth("GET /templates/{templateID}/builds/{buildID}/status", h.buildStatus)
	auth("GET /templates/{templateID}/builds/{buildID}/logs", h.buildLogs)
	// Authorized by its token, not a key: kept out of Routes (whose every
	// route but /health answers 401 without a key).
	h.mux.HandleFunc("PUT /template-files/{hash}", h.putFiles)
}

// newBuilds makes the build engine over the master (nil when the backend
// is not one: the route table alone).
func newBuilds(b Backend, log *slog.Logger) *templatebuild.Engine {
	svc, ok := b.(*master.Service)
	if !ok || svc == nil {
		return nil
	}
	o := buildOptions(filepath.Join(svc.TemplateStore().Dir(), "builds"))
	o.Log = log
	e, err := templatebuild.New(svc, o)
	if err != nil {
		log.Warn("template builds unavailable", "err", err)
		return nil
	}
	return e
}

// buildOptions are the engine's settings from the master's host: the base
// images it has (the Debian base of `go run ./hack/base-image`, cached in
// $CUBE_BASE_CACHE), the package mirrors the host reaches and the trust
// and proxy settings it reaches them with.
func buildOptions(dir string) templatebuild.Options {
	o := templatebuild.Options{Dir: dir, Images: map[string]string{}, StepEnv: map[string]string{}}
	cache := os.Getenv("CUBE_BASE_CACHE")
	if cache == "" {
		cache = "/var/cache/cube/base"
	}
	if base := filepath.Join(cache, "base-oci"); isDir(base) {
		for _, ref := range []string{"e2bdev/base", "e2bdev/base:latest", "debian", "debian:stable", "debian:bookworm", "debian:12", "debian:latest"} {
			o.Images[ref] = base
		}
	}
	o.AllowOut = []string{"deb.debian.org", "security.debian.org", "pypi.org", "files.pythonhosted.org"}
	for _, k := range []string{"HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL"} {
		v := os.Getenv(k)
		if v == "" {
			continue
		}
		o.StepEnv[k] = v
		if strings.Contains(strings.ToLower(k), "proxy") && !strings.HasPrefix(strings.ToLower(k), "no_") || strings.HasPrefix(k, "PIP_") {
			if u, err := url.Parse(v); err == nil && u.Hostname() != "" {
				o.AllowOut = append(o.AllowOut, u.Hostname())
			}
		}
	}
	o.CABundle = hostCABundle()
	return o
}

// hostCABundle is the CA bundle the host's pip uses (PIP_CERT, or cert in
// /etc/pip.conf), else the system bundle.
func hostCABundle() string {
	if p := os.Getenv("PIP_CERT"); p != "" && isFile(p) {
		return p
	}
	if f, err := os.Open("/etc/pip.conf"); err == nil {
		defer f.Close()
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			k, v, ok := strings.Cut(sc.Text(), "=")
			if ok && strings.TrimSpace(k) == "cert" && isFile(strings.TrimSpace(v)) {
				return strings.TrimSpace(v)
			}
		}
	}
	if p := "/etc/ssl/certs/ca-certificates.crt"; isFile(p) {
		return p
	}
	return ""
}

func isDir(p string) bool  { fi, err := os.Stat(p); return err == nil && fi.IsDir() }
func isFile(p string) bool { fi, err := os.Stat(p); return err == nil && fi.Mode().IsRegular() }

func (h *Handler) buildEngine() (*templatebuild.Engine, error) {
	if h.builds == nil {
		return nil, fmt.Errorf("template builds are not available on this master: %w", errdefs.ErrNotImplemented)
	}
	return h.builds, nil
}

type requestBuildBody struct {
	Name  string   `json:"name"`
	Alias string   `json:"alias"`
	Tags  []string `json:"tags"`
}

type requestBuildResponse struct {
	Aliases    []string `json:"aliases"`
	BuildID    string   `json:"buildID"`
	Names      []string `json:"names"`
	Public     bool     `json:"public"`
	Tags       []string `json:"tags"`
	TemplateID string   `json:"templateID"`
}

func (h *Handler) requestBuild(w http.ResponseWriter, r *http.Request) {
	var body requestBuildBody
	if err := decode(w, r, &body, true); err != nil {
		writeError(w, err)
		return
	}
	name := body.Name
	if name == "" {
		name = body.Alias
	}
	if name == "" {
		writeError(w, errdefs.FieldErrorf("name", "required"))
		return
	}
	e, err := h.buildEngine()
	if err != nil {
		writeError(w, err)
		return
	}
	id, tag, err := templatebuild.ParseName(name)
	if err != nil {
		writeError(w, err)
		return
	}
	tags := body.Tags
	if tag != "" {
		tags = append(tags, tag)
	}
	if len(tags) == 0 {
		tags = []string{"default"}
	}
	k := apiKey(r)
	b, err := e.Request(r.Context(), id, master.TeamOf(r.Context()), k != nil && k.Admin)
	if err != nil {
		writeError(w, err)
		return
	}
	writeJSON(w, http.StatusAccepted, requestBuildResponse{Aliases: []string{id}, BuildID: b.ID, Names: []string{id}, Tags: tags, TemplateID: id})
}

type fileUploadResponse struct {
	Present bool              `json:"present"`
	URL     string            `json:"url,omitempty"`
	Headers map[string]string `json:"headers,omitempty"`
}

func (h *Handler) fileUploadLink(w http.ResponseWriter, r *http.Request) {
	e, err := h.buildEngine()
	if err != nil {
		writeError(w, err)
		return
	}
	present, token, err := e.FileUpload(master.TeamOf(r.Context()), r.PathValue("hash"))
	if err != nil {
		writeError(w, err)
		return
	}
	resp := fileUploadResponse{Present: present}
	if !present {
		scheme := "http"
		if r.TLS != nil || r.Header.Get("X-Forwarded-Proto") == "https" {
			scheme = "https"
		}
		resp.URL = (&url.URL{Scheme: scheme, Host: r.Host, Path: "/template-files/" + r.PathValue("hash"), RawQuery: url.Values{"token": {token}}.Encode()}).String()
	}
	writeJSON(w, http.StatusCreated, resp)
}

func (h *Handler) putFiles(w http.ResponseWriter, r *http.Request) {
	e, err := h.buildEngine()
	if err != nil {
		writeError(w, err)
		return
	}
	if err := e.PutFile(r.PathValue("hash"), r.URL.Query().Get("token"), r.Body); err != nil {
		writeError(w, err)
		return
	}
	w.WriteHeader(http.StatusOK)
}

var buildIDRE = regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$`)

func (h *Handler) pathBuild(r *http.Request) (*templatebuild.Engine, *templatebuild.Build, error) {
	e, err := h.buildEngine()
	if err != nil {
		return nil, nil, err
	}
	bid := r.PathValue("buildID")
	if !buildIDRE.MatchString(bid) {
		return nil, nil, errdefs.FieldErrorf("buildID", "%q is not a build ID", bid)
	}
	b, err := e.Get(r.PathValue("templateID"), bid, master.TeamOf(r.Context()))
	return e, b, err
}

func (h *Handler) startBuild(w http.ResponseWriter, r *http.Request) {
	e, b, err := h.pathBuild(r)
	if err != nil {
		writeError(w, err)
		return
	}
	var spec templatebuild.Spec
	if err := decode(w, r, &spec, true); err != nil {
		writeError(w, err)
		return
	}
	if err := e.Start(r.Context(), b, spec); err != nil {
		writeError(w, err)
		return
	}
	w.WriteHeader(http.StatusAccepted)
}

type buildLogEntry struct {
	Level     string `json:"level"`
	Message   string `json:"message"`
	Step      string `json:"step,omitempty"`
	Timestamp string `json:"timestamp"`
}

type buildStatusReason struct {
	LogEntries []buildLogEntry `json:"logEntries"`
	Message    string          `json:"message"`
	Step       string          `json:"step,omitempty"`
}

type buildInfo struct {
	BuildID    string             `json:"buildID"`
	LogEntries []buildLogEntry    `json:"logEntries"`
	Logs       []string           `json:"logs"`
	Reason     *buildStatusReason `json:"reason,omitempty"`
	Status     string             `json:"status"`
	TemplateID string             `json:"templateID"`
}

func logEntries(ls []templatebuild.LogEntry) []buildLogEntry {
	out := make([]buildLogEntry, 0, len(ls))
	for _, l := range ls {
		out = append(out, buildLogEntry{Level: l.Level, Message: l.Message, Step: l.Step, Timestamp: timeJSON(l.Time)})
	}
	return out
}

func (h *Handler) buildStatus(w http.ResponseWriter, r *http.Request) {
	_, b, err := h.pathBuild(r)
	if err != nil {
		writeError(w, err)
		return
	}
	offset := 0
	if v := r.URL.Query().Get("logsOffset"); v != "" {
		if offset, err = strconv.Atoi(v); err != nil || offset < 0 {
			writeError(w, errdefs.FieldErrorf("logsOffset", "%q is not a non-negative integer", v))
			return
		}
	}
	status, logs, reason := b.Info(offset)
	info := buildInfo{BuildID: b.ID, TemplateID: b.TemplateID, Status: status, LogEntries: logEntries(logs), Logs: []string{}}
	if reason != nil {
		info.Reason = &buildStatusReason{Message: reason.Message, Step: reason.Step, LogEntries: logEntries(reason.Log)}
	}
	writeJSON(w, http.StatusOK, info)
}

var logLevels = map[string]int{"debug": 0, "info": 1, "warn": 2, "error": 3}

// buildLogs is E2B's build log query: entries from cursor (milliseconds;
// forward: at or after it, backward: at or before it, newest first), at
// level or above, at most limit (100 by default, 1000 at most).
func (h *Handler) buildLogs(w http.ResponseWriter, r *http.Request) {
	_, b, err := h.pathBuild(r)
	if err != nil {
		writeError(w, err)
		return
	}
	q := r.URL.Query()
	limit := 100
	if v := q.Get("limit"); v != "" {
		if limit, err = strconv.Atoi(v); err != nil || limit < 0 {
			writeError(w, errdefs.FieldErrorf("limit", "%q is not a non-negative integer", v))
			return
		}
		limit = min(limit, 1000)
	}
	var cursor int64
	if v := q.Get("cursor"); v != "" {
		if cursor, err = strconv.ParseInt(v, 10, 64); err != nil {
			writeError(w, errdefs.FieldErrorf("cursor", "%q is not a time in milliseconds", v))
			return
		}
	}
	dir := q.Get("direction")
	if dir != "" && dir != "forward" && dir != "backward" {
		writeError(w, errdefs.FieldErrorf("direction", "%q: want forward or backward", dir))
		return
	}
	minLevel := 0
	if v := q.Get("level"); v != "" {
		l, ok := logLevels[v]
		if !ok {
			writeError(w, errdefs.FieldErrorf("level", "%q: want debug, info, warn or error", v))
			return
		}
		minLevel = l
	}
	_, all, _ := b.Info(0)
	var out []templatebuild.LogEntry
	if dir == "backward" {
		for i := len(all) - 1; i >= 0 && len(out) < limit; i-- {
			if (cursor == 0 || all[i].Time.UnixMilli() <= cursor) && logLevels[all[i].Level] >= minLevel {
				out = append(out, all[i])
			}
		}
	} else {
		for _, l := range all {
			if len(out) >= limit {
				break
			}
			if l.Time.UnixMilli() >= cursor && logLevels[l.Level] >= minLevel {
				out = append(out, l)
			}
		}
	}
	writeJSON(w, http.StatusOK, map[string]any{"logs": logEntries(out)})
}
