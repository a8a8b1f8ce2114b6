package template

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
	"runtime"
	"time"

	"github.com/docker/cli/cli/config"
	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/remote/transport"

	"github.com/cubesandbox/cube/internal/errdefs"
)

// Registry names an image in an OCI/Docker registry.
//
// Credentials, in order: Username with Password or Token (HTTP Basic, the
// token standing in for a password as GHCR and GitLab personal tokens do);
// Token alone (sent as a bearer registry token); else the entry for the
// registry in AuthFile (a docker config.json, credential helpers included);
// else anonymous.
type Registry struct {
	Ref      string // host/repo:tag or host/repo@sha256:<hex> (pinned)
	Username string
	Password string
	Token    string
	// Insecure allows plain HTTP. Without it every request must be HTTPS,
	// loopback registries included (go-containerregistry would otherwise
	// fall back to HTTP for them silently).
	Insecure bool
	AuthFile string
}

// validate reports request mistakes before any network traffic.
func (r Registry) validate() (name.Reference, error) {
	switch {
	case r.Ref == "":
		return nil, invalid("image reference is required")
	case r.Password != "" && r.Username == "":
		return nil, invalid("a registry password needs a username")
	case r.Password != "" && r.Token != "":
		return nil, invalid("give a registry password or a token, not both")
	case r.Username != "" && r.Password == "" && r.Token == "":
		return nil, invalid("registry username %q given without a password or token", r.Username)
	}
	var opts []name.Option
	if r.Insecure {
		opts = append(opts, name.Insecure)
	}
	ref, err := name.ParseReference(r.Ref, opts...)
	if err != nil {
		return nil, invalid("image reference %q: %v", r.Ref, err)
	}
	return ref, nil
}

func (r Registry) authOption() remote.Option {
	switch {
	case r.Username != "":
		pw := r.Password
		if pw == "" {
			pw = r.Token
		}
		return remote.WithAuth(&authn.Basic{Username: r.Username, Password: pw})
	case r.Token != "":
		return remote.WithAuth(authn.FromConfig(authn.AuthConfig{RegistryToken: r.Token}))
	case r.AuthFile != "":
		return remote.WithAuthFromKeychain(fileKeychain{path: r.AuthFile})
	}
	return remote.WithAuth(authn.Anonymous)
}

// openRegistry resolves the reference to the image for this platform
// (linux/GOARCH; an index is narrowed to that child). Only the manifest
// and config are fetched here; layers stream later, bounded by ctx.
func openRegistry(ctx context.Context, r Registry) (v1.Image, error) {
	ref, err := r.validate()
	if err != nil {
		return nil, err
	}
	if r.AuthFile != "" && r.Username == "" && r.Token == "" {
		// The node's configuration, not the request, is wrong.
		if _, err := os.Stat(r.AuthFile); err != nil {
			return nil, fmt.Errorf("template: registry auth file: %w: %w", err, errdefs.ErrFailedPrecondition)
		}
	}
	base := http.DefaultTransport.(*http.Transport).Clone()
	base.ResponseHeaderTimeout = 60 * time.Second
	img, err := remote.Image(ref,
		remote.WithContext(ctx),
		remote.WithTransport(&schemeGuard{base: base, allowHTTP: r.Insecure}),
		r.authOption(),
		remote.WithPlatform(v1.Platform{OS: "linux", Architecture: runtime.GOARCH}),
		remote.WithUserAgent("cube-cubelet"),
		// A registry that is down should fail an import in seconds, not
		// after the library's default minute of backoff.
		remote.WithRetryBackoff(remote.Backoff{Duration: 250 * time.Millisecond, Factor: 2, Jitter: 0.1, Steps: 3}),
	)
	if err != nil {
		return nil, registryErr(r.Ref, err)
	}
	return img, nil
}

// errPlainHTTP is what schemeGuard answers a plain-HTTP request with.
var errPlainHTTP = errors.New("plain HTTP refused")

// schemeGuard refuses plain-HTTP requests unless the import allowed them:
// the registry, its token service and any blob redirect must all be HTTPS.
type schemeGuard struct {
	base      http.RoundTripper
	allowHTTP bool
}

func (g *schemeGuard) RoundTrip(req *http.Request) (*http.Response, error) {
	if req.URL.Scheme != "https" && !g.allowHTTP {
		return nil, fmt.Errorf("%w: %s", errPlainHTTP, req.URL.Redacted())
	}
	return g.base.RoundTrip(req)
}

// registryErr classifies a pull failure into the errdefs vocabulary.
func registryErr(ref string, err error) error {
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return err
	}
	wrap := func(kind error) error {
		return fmt.Errorf("template: registry image %s: %w: %w", ref, err, kind)
	}
	if errors.Is(err, errPlainHTTP) {
		return fmt.Errorf("template: registry image %s: the registry only answers plain HTTP; import with insecure to allow it: %w",
			ref, errdefs.ErrInvalidArgument)
	}
	var te *transport.Error
	if errors.As(err, &te) {
		for _, d := range te.Errors {
			switch d.Code {
			case transport.UnauthorizedErrorCode:
				return wrap(errdefs.ErrUnauthenticated)
			case transport.DeniedErrorCode:
				return wrap(errdefs.ErrPermissionDenied)
			case transport.ManifestUnknownErrorCode, transport.NameUnknownErrorCode, transport.BlobUnknownErrorCode:
				return wrap(errdefs.ErrNotFound)
			case transport.TooManyRequestsErrorCode:
				return wrap(errdefs.ErrResourceExhausted)
			}
		}
		switch {
		case te.StatusCode == http.StatusUnauthorized:
			return wrap(errdefs.ErrUnauthenticated)
		case te.StatusCode == http.StatusForbidden:
			return wrap(errdefs.ErrPermissionDenied)
		case te.StatusCode == http.StatusNotFound:
			return wrap(errdefs.ErrNotFound)
		case te.StatusCode == http.StatusTooManyRequests:
			return wrap(errdefs.ErrResourceExhausted)
		case te.StatusCode >= 500:
			return wrap(errdefs.ErrUnavailable)
		}
		return wrap(errdefs.ErrInvalidArgument)
	}
	var ne net.Error
	var ue *url.Error
	if errors.As(err, &ne) || errors.As(err, &ue) {
		return wrap(errdefs.ErrUnavailable)
	}
	// What is left is the image itself: an unknown media type, an index
	// without a linux/GOARCH child, a manifest that does not parse.
	return wrap(errdefs.ErrInvalidArgument)
}

// fileKeychain reads a docker config.json on every lookup, so an operator
// can rotate credentials without restarting cubelet.
type fileKeychain struct{ path string }

func (k fileKeychain) Resolve(target authn.Resource) (authn.Authenticator, error) {
	f, err := os.Open(k.path)
	if err != nil {
		return nil, fmt.Errorf("registry auth file: %w", err)
	}
	defer f.Close()
	cf, err := config.LoadFromReader(f)
	if err != nil {
		return nil, fmt.Errorf("registry auth file %s: %w", k.path, err)
	}
	// Keys as docker writes them: the repository, then the registry host,
	// with Docker Hub under its historical URL.
	for _, key := range []string{target.String(), target.RegistryStr()} {
		if key == name.DefaultRegistry {
			key = authn.DefaultAuthKey
		}
		ac, err := cf.GetAuthConfig(key)
		if err != nil {
			return nil, fmt.Errorf("registry auth file %s: %w", k.path, err)
		}
		if ac.Username == "" && ac.Password == "" && ac.Auth == "" && ac.IdentityToken == "" && ac.RegistryToken == "" {
			continue
		}
		return authn.FromConfig(authn.AuthConfig{
			Username: ac.Username, Password: ac.Password, Auth: ac.Auth,
			IdentityToken: ac.IdentityToken, RegistryToken: ac.RegistryToken,
		}), nil
	}
	return authn.Anonymous, nil
}
