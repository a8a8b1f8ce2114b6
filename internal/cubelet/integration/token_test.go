package integration

import (
	"context"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/cubesandbox/cube/internal/agent/agenttest"
	"github.com/cubesandbox/cube/internal/agentproto"
	"github.com/cubesandbox/cube/internal/cubelet"
	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/lifecycle"
	"github.com/cubesandbox/cube/internal/network/nettest"
)

// tokenTransport adds an access token to every request.
type tokenTransport struct {
	token string
	base  http.RoundTripper
}

func (t tokenTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set(agentproto.AccessTokenHeader, t.token)
	return t.base.RoundTrip(r)
}

func tokenClient(token string) *http.Client {
	c := agentClient()
	if token != "" {
		c.Transport = tokenTransport{token: token, base: c.Transport}
	}
	return c
}

// probe calls path on sandbox id's agent at its slot address (where the
// host and the route reach it) with token ("" = none) and returns the
// status.
func probe(t *testing.T, svc *cubelet.Service, id, method, path, token string) int {
	t.Helper()
	c := tokenClient(token)
	defer c.CloseIdleConnections()
	var body io.Reader
	if method == http.MethodPost {
		body = strings.NewReader(`{"envVars":{"PROBE":"1"}}`)
	}
	req, _ := http.NewRequest(method, agentURL(t, svc, id, path), body)
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatalf("%s %s on %s: %v", method, path, id, err)
	}
	resp.Body.Close()
	return resp.StatusCode
}

// wantRefused: every probe without the token (or with another) is 401.
func wantRefused(t *testing.T, svc *cubelet.Service, id string, tokens ...string) {
	t.Helper()
	for _, tok := range tokens {
		for _, p := range [][2]string{{"GET", agentproto.PathInfo}, {"POST", "/init"}, {"GET", "/envs"}, {"POST", agentproto.PathQuiesce}} {
			if code := probe(t, svc, id, p[0], p[1], tok); code != http.StatusUnauthorized {
				t.Fatalf("%s %s on %s with token %q = %d, want 401", p[0], p[1], id, tok, code)
			}
		}
	}
	t.Logf("%s: GET %s, POST /init, GET /envs, POST %s with tokens %q: 401", id, agentproto.PathInfo, agentproto.PathQuiesce, tokens)
}

func wantServed(t *testing.T, svc *cubelet.Service, id, token string) {
	t.Helper()
	if code := probe(t, svc, id, "GET", agentproto.PathInfo, token); code != http.StatusOK {
		t.Fatalf("GET %s on %s with token %q = %d, want 200", agentproto.PathInfo, id, token, code)
	}
}

// TestAgentAccessToken: a sandbox created with an access token has an
// agent that refuses every request without it from the moment create
// returns, before anything called /init, at the slot address any host
// process can reach; the token reaches processes in the sandbox only as
// nothing (the verifier is not inherited). Snapshots of it work
// (cubelet's quiesce carries the token), and a clone answers its own
// token, never the snapshot's. The control is the same probes on a
// sandbox created without a token, which succeed.
func TestAgentAccessToken(t *testing.T) {
	cubelettest.RequireRoot(t)
	for _, rt := range []string{"runc", "gvisor", "vm"} {
		t.Run(rt, func(t *testing.T) {
			var env *cubelettest.Env
			var svc *cubelet.Service
			switch rt {
			case "vm":
				env, svc = vmEnv(t, "")
			case "gvisor":
				requireRunsc(t)
				fallthrough
			default:
				env = cubelettest.New(t, "")
				env.StartNetworkAgent(t, nettest.Options{PoolSize: 3})
				svc = env.Start(t)
				env.ImportBusybox(t, svc, "busybox")
			}
			ctx := context.Background()
			defer func() {
				for _, sb := range mustList(t, svc) {
					if _, err := svc.Delete(ctx, sb.ID); err != nil {
						t.Error(err)
					}
				}
				for _, sn := range listSnaps(t, svc, "") {
					_ = svc.DeleteSnapshot(ctx, sn)
				}
				env.AssertNoLeaks(t)
			}()
			const tokA, tokC = "token-of-a-0123456789", "token-of-the-clone-0123"
			a := mustCreate(t, svc, cubelet.CreateRequest{SandboxID: "tok-a", Runtime: rt, AccessToken: tokA})
			// Right after create, before any /init.
			wantRefused(t, svc, a.ID, "", "wrong", tokA+"x")
			wantServed(t, svc, a.ID, tokA)
			for _, bad := range []string{"has space", "line\nbreak", strings.Repeat("x", 513)} {
				if _, err := svc.Create(ctx, cubelet.CreateRequest{TemplateID: "busybox", Runtime: rt, AccessToken: bad}); !errdefs.IsInvalidArgument(err) {
					t.Fatalf("create with access token %.20q = %v, want InvalidArgument", bad, err)
				}
			}
			if rt != "vm" {
				// Control: no token in the spec, the same probe succeeds.
				b := mustCreate(t, svc, cubelet.CreateRequest{SandboxID: "tok-b", Runtime: rt})
				wantServed(t, svc, b.ID, "")
				t.Logf("control: tokenless GET %s on %s (created without a token) = 200", agentproto.PathInfo, b.ID)
				if _, err := svc.Delete(ctx, b.ID); err != nil {
					t.Fatal(err)
				}
			}
			// Nothing the agent starts inherits the token or its verifier.
			hc := tokenClient(tokA)
			out := agenttest.Shell(ctx, t, hc, agentURL(t, svc, a.ID, ""), "env; cat /proc/self/environ")
			hc.CloseIdleConnections()
			if strings.Contains(out, agentproto.TokenHashEnv) || strings.Contains(out, tokA) {
				t.Fatalf("a process in the sandbox sees the token or its verifier:\n%s", out)
			}

			// A snapshot (memory where the runtime has it: gVisor's quiesce
			// needs the token) and a clone under its own token.
			sn := mustSnapshot(t, svc, cubelet.SnapshotRequest{SandboxID: a.ID, SnapshotID: "tok-snap"})
			t.Logf("snapshot of %s: memory %v", a.ID, sn.HasMemory)
			mustState(t, svc, a.ID, lifecycle.Running)
			wantServed(t, svc, a.ID, tokA)
			res, err := svc.Clone(ctx, cubelet.CloneRequest{SnapshotID: sn.ID, Count: 1, SandboxIDs: []string{"tok-c"}, AccessTokens: []string{tokC}})
			if err != nil {
				t.Fatalf("clone: %v", err)
			}
			c := res.Sandboxes[0]
			wantRefused(t, svc, c.ID, "", tokA)
			wantServed(t, svc, c.ID, tokC)
			wantServed(t, svc, a.ID, tokA)
		})
	}
}
