package cubeproxy

import (
	"crypto/tls"
	"fmt"
	"net/http"
	"net/http/httputil"
	"net/url"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/proxy"
)

// apiHost sends requests for api.<domain> to the E2B API and the rest to
// the route: an SDK configured by E2B_DOMAIN alone calls
// https://api.<domain> for the API and https://<port>-<id>.<domain> for
// sandboxes, and domain mode serves both on one listener with one
// *.<domain> certificate.
type apiHost struct {
	domain    string
	api, next http.Handler
}

func (a apiHost) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	// A request that names its sandbox by header is the route's whatever
	// host it came to (E2B_SANDBOX_URL pointed at this listener).
	if r.Header.Get(proxy.HeaderSandboxID) == "" && proxy.IsAPIHost(r.Host, a.domain) {
		a.api.ServeHTTP(w, r)
		return
	}
	a.next.ServeHTTP(w, r)
}

// APIUpstream returns a handler that passes requests on to the E2B API at
// rawURL (a master's api.e2b, http or https), streaming both ways (build
// logs). rootCAs, when set, is what an https upstream is verified against
// (the system's roots when nil).
func APIUpstream(rawURL string, rootCAs *tls.Config) (http.Handler, error) {
	u, err := url.Parse(rawURL)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("E2B API upstream %q: want http://host:port or https://host:port: %w", rawURL, errdefs.ErrInvalidArgument)
	}
	t := http.DefaultTransport.(*http.Transport).Clone()
	if rootCAs != nil && rootCAs.RootCAs != nil {
		t.TLSClientConfig = &tls.Config{RootCAs: rootCAs.RootCAs, MinVersion: tls.VersionTLS12}
	}
	return &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(u)
			pr.SetXForwarded()
		},
		Transport:     t,
		FlushInterval: -1,
	}, nil
}
