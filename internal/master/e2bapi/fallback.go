package e2bapi

import (
	"fmt"
	"net/http"

	"github.com/cubesandbox/cube/internal/errdefs"
)

// The rest of the SDKs' OpenAPI (e2b JS 2.51.0 and Python 2.63.0; the
// list is testdata/sdk-openapi-paths.txt, which TestSDKPathsServed walks):
// every path the routes above do not serve is answered here, in E2B's
// error shape with what to do instead, or served where the meaning is
// plain (GET /teams, GET /v2/templates, GET /default-templates). These sit
// behind the main routes: a route registered there later takes the path
// over without a change here.

// fallbackRoute is one path of the SDKs' spec that the main routes lack:
// served by serve (behind the API key) or, when serve is nil, answered 501
// with msg.
type fallbackRoute struct {
	pattern string
	msg     string
	serve   http.HandlerFunc
}

const (
	msgBuilds = "this build flow (a Dockerfile pushed to a registry) is not served by this server; build with the SDK's Template builder (POST /v3/templates), or import templates with cubecli template import (docs/templates.md)"
	msgTags   = "template tags are not served by this server; a template is named by its ID or an alias (templates.aliases in the master's configuration)"
	msgVolume = "the volume content API is not served by this server; mount the volume into a sandbox (Sandbox.create volumeMounts) and use the sandbox's filesystem API"
	msgTeamM  = "team metrics are not recorded by this server; GET /sandboxes/metrics gives the team's running sandboxes' metrics"
	msgSecret = "this server's secrets are cube's named secrets: GET /secrets lists them, PUT /secrets/{name} replaces a value, DELETE /secrets/{name} removes one (E2B's versioned secret objects are not served)" //nolint:gosec // G101: a message naming the secrets API
)

func (h *Handler) fallbackRoutes() []fallbackRoute {
	return []fallbackRoute{
		{pattern: "GET /teams", serve: h.listTeams},
		{pattern: "GET /v2/templates", serve: h.listTemplates},
		// Every template of this server is available to every team.
		{pattern: "GET /default-templates", serve: h.listTemplates},
		{pattern: "GET /teams/{teamID}/metrics", msg: msgTeamM},
		{pattern: "GET /teams/{teamID}/metrics/max", msg: msgTeamM},
		{pattern: "GET /secrets/{secretID}", msg: msgSecret},
		{pattern: "POST /secrets/{secretID}", msg: msgSecret},
		{pattern: "PATCH /templates/{templateID}", msg: "templates are shared by every team of this server; there is nothing to update (public/private)"},
		{pattern: "PATCH /v2/templates/{templateID}", msg: "templates are shared by every team of this server; there is nothing to update (public/private)"},
		{pattern: "POST /v2/templates", msg: msgBuilds},
		{pattern: "POST /templates", msg: msgBuilds},
		{pattern: "GET /templates/{templateID}/tags", msg: msgTags},
		{pattern: "GET /templates/{templateID}/tags/count", msg: msgTags},
		{pattern: "GET /templates/{templateID}/tags/exists", msg: msgTags},
		{pattern: "GET /templates/{templateID}/tags/groups", msg: msgTags},
		{pattern: "GET /templates/{templateID}/tags/{tag}/assignments", msg: msgTags},
		{pattern: "POST /templates/tags", msg: msgTags},
		{pattern: "DELETE /templates/tags", msg: msgTags},
		// The volume content API authenticates with the volume's token,
		// not an API key: answered without one.
		{pattern: "GET /volumecontent/{volumeID}/dir", msg: msgVolume},
		{pattern: "POST /volumecontent/{volumeID}/dir", msg: msgVolume},
		{pattern: "GET /volumecontent/{volumeID}/file", msg: msgVolume},
		{pattern: "PUT /volumecontent/{volumeID}/file", msg: msgVolume},
		{pattern: "GET /volumecontent/{volumeID}/path", msg: msgVolume},
		{pattern: "PATCH /volumecontent/{volumeID}/path", msg: msgVolume},
		{pattern: "DELETE /volumecontent/{volumeID}/path", msg: msgVolume},
	}
}

// fallbackMux builds the mux the catch-all consults.
func (h *Handler) fallbackMux() *http.ServeMux {
	m := http.NewServeMux()
	for _, f := range h.fallbackRoutes() {
		if f.serve != nil {
			m.Handle(f.pattern, h.authenticated(f.serve))
			continue
		}
		msg := f.msg
		m.HandleFunc(f.pattern, func(w http.ResponseWriter, r *http.Request) {
			writeError(w, fmt.Errorf("%s %s: %s: %w", r.Method, r.URL.Path, msg, errdefs.ErrNotImplemented))
		})
	}
	return m
}

// notFound answers what no route serves: a path of the SDKs' spec from
// the fallback mux, anything else 404 in E2B's shape.
func (h *Handler) notFound(fallback *http.ServeMux) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if fh, pattern := fallback.Handler(r); pattern != "" {
			fh.ServeHTTP(w, r)
			return
		}
		writeError(w, fmt.Errorf("no route %s %s: %w", r.Method, r.URL.Path, errdefs.ErrNotFound))
	}
}

// teamJSON is components.schemas.Team. apiKey is the key the caller sent
// (the only one of the team this server can show: it keeps hashes).
type teamJSON struct {
	TeamID    string `json:"teamID"`
	Name      string `json:"name"`
	APIKey    string `json:"apiKey"`
	IsDefault bool   `json:"isDefault"`
}

// listTeams is GET /teams: the caller's key belongs to one team.
func (h *Handler) listTeams(w http.ResponseWriter, r *http.Request) {
	k := apiKey(r)
	if k == nil {
		writeError(w, fmt.Errorf("no API key: %w", errdefs.ErrInternal))
		return
	}
	writeJSON(w, http.StatusOK, []teamJSON{{TeamID: k.Team, Name: k.Team, APIKey: r.Header.Get("X-API-Key"), IsDefault: true}})
}
