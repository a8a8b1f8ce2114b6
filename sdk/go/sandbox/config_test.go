package sandbox

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"testing"

	"connectrpc.com/connect"
)

// The environment fills what Config leaves empty, as in E2B's SDKs.
func TestConfigFromEnvironment(t *testing.T) {
	for _, v := range []string{"E2B_API_KEY", "E2B_DOMAIN", "E2B_API_URL", "E2B_SANDBOX_URL", "E2B_DEBUG"} {
		t.Setenv(v, "")
	}
	if _, err := NewClient(Config{}); !errors.Is(err, ErrAuth) {
		t.Errorf("no key: %v, want ErrAuth", err)
	}

	t.Setenv("E2B_API_KEY", "e2b_k")
	t.Setenv("E2B_DOMAIN", "sb.example.com")
	c, err := NewClient(Config{})
	if err != nil {
		t.Fatal(err)
	}
	cfg := c.Config()
	if cfg.APIKey != "e2b_k" || cfg.APIURL != "https://api.sb.example.com" || cfg.RequestTimeout != DefaultRequestTimeout {
		t.Errorf("from E2B_DOMAIN: %+v", cfg)
	}
	if base, named := cfg.sandboxBase("abc", "", EnvdPort); base != "https://49983-abc.sb.example.com" || named {
		t.Errorf("domain mode: %s %v", base, named)
	}
	if base, _ := cfg.sandboxBase("abc", "other.example", 8080); base != "https://8080-abc.other.example" {
		t.Errorf("the sandbox's own domain: %s", base)
	}

	t.Setenv("E2B_API_URL", "http://127.0.0.1:3000/")
	t.Setenv("E2B_SANDBOX_URL", "http://127.0.0.1:8081")
	c, err = NewClient(Config{APIKey: "explicit"})
	if err != nil {
		t.Fatal(err)
	}
	cfg = c.Config()
	if cfg.APIKey != "explicit" || cfg.APIURL != "http://127.0.0.1:3000" {
		t.Errorf("explicit key and E2B_API_URL: %+v", cfg)
	}
	if base, named := cfg.sandboxBase("abc", "sb.example.com", EnvdPort); base != "http://127.0.0.1:8081" || !named {
		t.Errorf("E2B_SANDBOX_URL: %s %v", base, named)
	}
}

// Each failure matches exactly its kind, and keeps its details.
func TestErrorKinds(t *testing.T) {
	kinds := []error{ErrNotFound, ErrAuth, ErrRateLimit, ErrTimeout, ErrInvalidArgument, ErrConflict, ErrNotImplemented, ErrUnavailable}
	only := func(t *testing.T, err, want error) {
		t.Helper()
		for _, k := range kinds {
			if errors.Is(err, k) != (k == want) {
				t.Errorf("%v: errors.Is(%v) = %v", err, k, !(k == want))
			}
		}
	}
	for status, want := range map[int]error{404: ErrNotFound, 401: ErrAuth, 403: ErrAuth, 429: ErrRateLimit, 400: ErrInvalidArgument,
		409: ErrConflict, 501: ErrNotImplemented, 503: ErrUnavailable} {
		only(t, fmt.Errorf("op: %w", &APIError{StatusCode: status, Message: "m"}), want)
	}
	only(t, fmt.Errorf("op: %w", &APIError{StatusCode: 500}), nil)

	err := classify("start command", connect.NewError(connect.CodeUnauthenticated, errors.New("bad token")))
	only(t, err, ErrAuth)
	if connect.CodeOf(err) != connect.CodeUnauthenticated {
		t.Errorf("the Connect error is lost: %v", err)
	}
	err = classify("read", &url.Error{Op: "Get", URL: "http://x", Err: context.DeadlineExceeded})
	only(t, err, ErrTimeout)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("%v is not context.DeadlineExceeded", err)
	}
	only(t, classify("x", connect.NewError(connect.CodeNotFound, errors.New("gone"))), ErrNotFound)
	if classify("x", nil) != nil {
		t.Error("classify(nil) is not nil")
	}
}

// The metadata filter is encoded twice, as E2B's SDKs send it: the API
// decodes the query, then each key and value.
func TestMetadataQuery(t *testing.T) {
	in := map[string]string{"b": "x&y=z", "a key": "1%"}
	got := metadataQuery(in)
	if want := "a%2Bkey=1%2525&b=x%2526y%253Dz"; got != want {
		t.Errorf("metadataQuery = %q, want %q", got, want)
	}
	q, err := url.ParseQuery(got)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]string{}
	for k, vs := range q {
		key, err1 := url.QueryUnescape(k)
		val, err2 := url.QueryUnescape(vs[0])
		if err1 != nil || err2 != nil {
			t.Fatal(err1, err2)
		}
		out[key] = val
	}
	if fmt.Sprint(out) != fmt.Sprint(in) {
		t.Errorf("decoded as the API does: %v, want %v", out, in)
	}
}
