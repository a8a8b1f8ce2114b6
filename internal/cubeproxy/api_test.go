package cubeproxy

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/cubesandbox/cube/internal/proxy"
)

// TestAPIHost: requests for api.<domain> go to the API, everything else
// (sandbox hosts, other domains, any host with the sandbox headers) to
// the route.
func TestAPIHost(t *testing.T) {
	tag := func(name string) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, name) })
	}
	h := apiHost{domain: "cube.test:8443", api: tag("api"), next: tag("route")}
	for _, tc := range []struct {
		host, header, want string
	}{
		{"api.cube.test:8443", "", "api"},
		{"api.cube.test", "", "api"},
		{"49983-abc.cube.test:8443", "", "route"},
		{"api.evil.test:8443", "", "route"},
		{"api.cube.test:8443", "abc", "route"},
	} {
		r := httptest.NewRequest("GET", "https://"+tc.host+"/health", nil)
		if tc.header != "" {
			r.Header.Set(proxy.HeaderSandboxID, tc.header)
		}
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		if got := w.Body.String(); got != tc.want {
			t.Errorf("%s (header %q): served by %s, want %s", tc.host, tc.header, got, tc.want)
		}
	}
}

// TestAPIUpstream: the standalone proxy passes api.<domain> requests on to
// the master's E2B API with method, path, query, body and key intact, and
// the answer back (status and body).
func TestAPIUpstream(t *testing.T) {
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, r.Method+" "+r.URL.RequestURI()+" "+r.Header.Get("X-API-Key")+" "+string(b))
	}))
	defer up.Close()
	api, err := APIUpstream(up.URL, nil)
	if err != nil {
		t.Fatal(err)
	}
	r := httptest.NewRequest("POST", "https://api.cube.test/v2/sandboxes?x=1", strings.NewReader(`{"templateID":"base"}`))
	r.Header.Set("X-API-Key", "k")
	w := httptest.NewRecorder()
	apiHost{domain: "cube.test", api: api, next: http.NotFoundHandler()}.ServeHTTP(w, r)
	if want := `POST /v2/sandboxes?x=1 k {"templateID":"base"}`; w.Code != http.StatusCreated || w.Body.String() != want {
		t.Fatalf("got %d %q, want 201 %q", w.Code, w.Body.String(), want)
	}
	for _, bad := range []string{"", "ftp://x", "http://"} {
		if _, err := APIUpstream(bad, nil); err == nil {
			t.Errorf("APIUpstream(%q) accepted", bad)
		}
	}
}
