package agent

import (
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"

	"github.com/cubesandbox/cube/internal/agentproto"
)

// TestTokenFromTheFirstRequest: an agent started with a token's verifier
// (what cubelet puts in the create spec) refuses every request without
// the token from the first one, with envd's 401; with the token the same
// requests succeed, and /health stays open. The control is an agent
// started without a verifier, where the same tokenless probes succeed:
// the verifier alone is what refuses them.
func TestTokenFromTheFirstRequest(t *testing.T) {
	const token = "0123456789abcdef0123456789abcdef"
	h, err := ParseTokenHash(agentproto.TokenHash(token))
	if err != nil {
		t.Fatal(err)
	}
	probes := []struct{ method, path, body string }{
		{"GET", agentproto.PathInfo, ""},
		{"GET", "/envs", ""},
		{"POST", "/init", `{"accessToken":"mine"}`},
		{"POST", agentproto.PathReinit, `{"access_token":"mine"}`},
		{"POST", agentproto.PathPrepare, ""},
		{"POST", agentproto.PathQuiesce, `{}`},
		{"GET", "/files?path=/etc/hostname", ""},
		{"POST", "/process.Process/List", `{}`},
	}
	do := func(t *testing.T, ts *httptest.Server, method, path, body, tok string) (int, string) {
		t.Helper()
		req, _ := http.NewRequest(method, ts.URL+path, strings.NewReader(body))
		if body != "" {
			req.Header.Set("Content-Type", "application/json")
		}
		if tok != "" {
			req.Header.Set(AccessTokenHeader, tok)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}

	t.Run("control: no verifier", func(t *testing.T) {
		ts := httptest.NewServer(New(Config{}).Handler())
		t.Cleanup(ts.Close)
		code, body := do(t, ts, "GET", agentproto.PathInfo, "", "")
		if code != http.StatusOK {
			t.Fatalf("tokenless GET %s on an agent without a verifier = %d %s, want 200", agentproto.PathInfo, code, body)
		}
		t.Logf("control: tokenless GET %s = %d", agentproto.PathInfo, code)
	})

	t.Run("verifier", func(t *testing.T) {
		ts := httptest.NewServer(New(Config{TokenHash: &h}).Handler())
		t.Cleanup(ts.Close)
		for _, p := range probes {
			for _, tok := range []string{"", "wrong", token[:len(token)-1]} {
				code, body := do(t, ts, p.method, p.path, p.body, tok)
				if code != http.StatusUnauthorized {
					t.Fatalf("%s %s with token %q = %d %s, want 401", p.method, p.path, tok, code, body)
				}
				if !strings.HasPrefix(p.path, "/process.") {
					var e struct {
						Code    int    `json:"code"`
						Message string `json:"message"`
					}
					if err := json.Unmarshal([]byte(body), &e); err != nil || e.Code != 401 || e.Message == "" {
						t.Fatalf("%s %s: 401 body %q is not envd's {code, message}", p.method, p.path, body)
					}
				}
			}
			t.Logf("%s %s without, with a wrong and with a truncated token: 401", p.method, p.path)
		}
		if code, _ := do(t, ts, "GET", "/health", "", ""); code != http.StatusNoContent {
			t.Fatalf("GET /health without a token = %d, want 204", code)
		}
		// A signature cannot be checked against a verifier: refused until
		// the agent has seen the token.
		sig := url.Values{"path": {"/etc/hostname"}, "username": {"root"}, "signature": {Signature("/etc/hostname", "read", "root", token)}}
		if code, body := do(t, ts, "GET", "/files?"+sig.Encode(), "", ""); code != http.StatusUnauthorized {
			t.Fatalf("signed download before the agent saw its token = %d %s, want 401", code, body)
		}
		if code, body := do(t, ts, "GET", agentproto.PathInfo, "", token); code != http.StatusOK {
			t.Fatalf("GET %s with the token = %d %s, want 200", agentproto.PathInfo, code, body)
		}
		// Now it knows the token: a signature made with it passes the
		// gate (the file itself may be missing: anything but 401).
		if code, body := do(t, ts, "GET", "/files?"+sig.Encode(), "", ""); code == http.StatusUnauthorized {
			t.Fatalf("signed download after the agent saw its token = 401 %s", body)
		}
		// A reinit carrying the token hands the agent a new one: the old
		// one is refused from then on.
		if code, body := do(t, ts, "POST", agentproto.PathReinit, `{"access_token":"next-token"}`, token); code != http.StatusOK {
			t.Fatalf("reinit with the token = %d %s", code, body)
		}
		if code, _ := do(t, ts, "GET", agentproto.PathInfo, "", token); code != http.StatusUnauthorized {
			t.Fatalf("the replaced token = %d, want 401", code)
		}
		if code, _ := do(t, ts, "GET", agentproto.PathInfo, "", "next-token"); code != http.StatusOK {
			t.Fatalf("the new token = %d, want 200", code)
		}
	})

	t.Run("bad verifier", func(t *testing.T) {
		for _, v := range []string{"", "xyz", agentproto.TokenHash(token)[:62], agentproto.TokenHash(token) + "00"} {
			if _, err := ParseTokenHash(v); err == nil {
				t.Errorf("ParseTokenHash(%q) = nil error", v)
			}
		}
	})
}
