package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"strings"
	"time"

	"connectrpc.com/connect"

	pb "github.com/cubesandbox/cube/api/envd/process"
	"github.com/cubesandbox/cube/api/envd/process/processconnect"
	masterpb "github.com/cubesandbox/cube/api/master/v1"
	"github.com/cubesandbox/cube/internal/cubeproxy"
	"github.com/cubesandbox/cube/internal/pki"
	"github.com/cubesandbox/cube/internal/proxy"
)

// smoke is the chart's helm test: everything a user does first, through
// the Services the chart made. An API key is made for the run through the
// admin API (an admin certificate from the cluster CA) and removed after.
func smoke(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("smoke", flag.ExitOnError)
	api := fs.String("api", "", "the E2B API, http(s)://host:port")
	route := fs.String("proxy", "", "the sandbox route (cubeproxy), http(s)://host:port")
	admin := fs.String("admin", "", "cubemaster's admin API, host:port (mutual TLS)")
	token := fs.String("admin-token", os.Getenv("CUBEMASTER_TOKEN"), "cubemaster's api.admin_token")
	caDir := fs.String("ca-dir", "/etc/cube/ca", "the cluster CA (an admin certificate is issued from it)")
	tmpl := fs.String("template", "base", "template to create from")
	insecureRoute := fs.Bool("proxy-insecure", false, "accept the route's certificate unchecked (self-signed TLS)")
	timeout := fs.Duration("timeout", 4*time.Minute, "the whole test")
	_ = fs.Parse(args)
	if *api == "" || *route == "" || *admin == "" {
		return fmt.Errorf("smoke: --api, --proxy and --admin are required")
	}
	ctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	began := time.Now()
	step := func(what string, t0 time.Time) {
		fmt.Printf("ok  %-34s %s\n", what, time.Since(t0).Round(time.Millisecond))
	}

	// The admin API: a certificate of role admin, then a key for the run.
	dir, err := os.MkdirTemp("", "cube-smoke-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	ca, err := pki.LoadCA(*caDir)
	if err != nil {
		return fmt.Errorf("the cluster CA: %w", err)
	}
	files, err := ca.Issue(dir, "admin", "helm-test", pki.RoleAdmin)
	if err != nil {
		return err
	}
	tc, err := files.Client("smoke admin TLS")
	if err != nil {
		return err
	}
	conn, err := cubeproxy.DialMaster(*admin, *token, tc)
	if err != nil {
		return err
	}
	defer conn.Close()
	ac := masterpb.NewAdminServiceClient(conn)
	t0 := time.Now()
	var key *masterpb.CreateAPIKeyResponse
	for {
		key, err = ac.CreateAPIKey(ctx, &masterpb.CreateAPIKeyRequest{Name: "helm-test-" + randHex(4)})
		if err == nil || ctx.Err() != nil {
			break
		}
		time.Sleep(2 * time.Second)
	}
	if err != nil {
		return fmt.Errorf("create an API key: %w", err)
	}
	defer func() {
		dctx, dcancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer dcancel()
		_, _ = ac.DeleteAPIKey(dctx, &masterpb.DeleteAPIKeyRequest{Key: key.Key.GetId()})
	}()
	step("API key through the admin API", t0)

	e2b := &e2bClient{base: strings.TrimRight(*api, "/"), key: key.Secret, hc: &http.Client{Timeout: time.Minute}}
	rt := &http.Transport{TLSClientConfig: &tls.Config{MinVersion: tls.VersionTLS12, InsecureSkipVerify: *insecureRoute}} //nolint:gosec // only with --proxy-insecure (self-signed route)
	if pool, err := x509.SystemCertPool(); err == nil {
		rt.TLSClientConfig.RootCAs = pool
	}

	// Create: placement may wait for the first node to register.
	t0 = time.Now()
	var sb struct {
		SandboxID       string `json:"sandboxID"`
		EnvdAccessToken string `json:"envdAccessToken"`
	}
	for {
		code, body, err := e2b.do(ctx, http.MethodPost, "/sandboxes", fmt.Sprintf(`{"templateID":%q,"timeout":300}`, *tmpl), &sb)
		if err == nil && code == http.StatusCreated {
			break
		}
		if ctx.Err() != nil {
			return fmt.Errorf("create: %d %s %v", code, body, err)
		}
		fmt.Printf("..  create: %d %s %v (retrying)\n", code, strings.TrimSpace(body), err)
		time.Sleep(3 * time.Second)
	}
	step("create "+sb.SandboxID, t0)
	killed := false
	defer func() {
		if !killed {
			_, _, _ = e2b.do(context.Background(), http.MethodDelete, "/sandboxes/"+sb.SandboxID, "", nil)
		}
	}()
	to := func(port string) *http.Client {
		return &http.Client{Timeout: time.Minute, Transport: headerRT{id: sb.SandboxID, port: port, token: sb.EnvdAccessToken, rt: rt}}
	}
	envd := processconnect.NewProcessClient(to("49983"), strings.TrimRight(*route, "/"))

	t0 = time.Now()
	if out, err := run(ctx, envd, "echo hello from $(hostname)"); err != nil || !strings.Contains(out, "hello from") {
		return fmt.Errorf("run a command: %q %v", out, err)
	}
	step("command through the route", t0)

	t0 = time.Now()
	content := "written by helm test " + randHex(8)
	if err := putFile(ctx, to("49983"), *route, "/tmp/helm-test.txt", content); err != nil {
		return err
	}
	if got, err := getFile(ctx, to("49983"), *route, "/tmp/helm-test.txt"); err != nil || got != content {
		return fmt.Errorf("read the file back: %q %v", got, err)
	}
	step("file written and read", t0)

	t0 = time.Now()
	if err := startWeb(ctx, envd); err != nil {
		return err
	}
	if err := getPort(ctx, to("8000"), *route, sb.SandboxID); err != nil {
		return err
	}
	step("port 8000 through the route", t0)

	t0 = time.Now()
	if code, body, err := e2b.do(ctx, http.MethodPost, "/sandboxes/"+sb.SandboxID+"/pause", "", nil); err != nil || code != http.StatusNoContent {
		return fmt.Errorf("pause: %d %s %v", code, body, err)
	}
	step("pause", t0)
	t0 = time.Now()
	if code, body, err := e2b.do(ctx, http.MethodPost, "/sandboxes/"+sb.SandboxID+"/resume", `{"timeout":300}`, nil); err != nil || code/100 != 2 {
		return fmt.Errorf("resume: %d %s %v", code, body, err)
	}
	if got, err := getFile(ctx, to("49983"), *route, "/tmp/helm-test.txt"); err != nil || got != content {
		return fmt.Errorf("the file after resume: %q %v", got, err)
	}
	step("resume (file kept)", t0)

	t0 = time.Now()
	if code, body, err := e2b.do(ctx, http.MethodDelete, "/sandboxes/"+sb.SandboxID, "", nil); err != nil || code != http.StatusNoContent {
		return fmt.Errorf("kill: %d %s %v", code, body, err)
	}
	killed = true
	if code, _, _ := e2b.do(ctx, http.MethodGet, "/sandboxes/"+sb.SandboxID, "", nil); code != http.StatusNotFound {
		return fmt.Errorf("after kill, GET /sandboxes/%s answered %d, want 404", sb.SandboxID, code)
	}
	step("kill", t0)
	fmt.Printf("PASS helm test in %s\n", time.Since(began).Round(time.Millisecond))
	return nil
}

type e2bClient struct {
	base, key string
	hc        *http.Client
}

func (c *e2bClient) do(ctx context.Context, method, path, body string, out any) (int, string, error) {
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, method, c.base+path, rd)
	if err != nil {
		return 0, "", err
	}
	req.Header.Set("X-API-Key", c.key)
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if out != nil && resp.StatusCode/100 == 2 {
		if err := json.Unmarshal(b, out); err != nil {
			return resp.StatusCode, string(b), err
		}
	}
	return resp.StatusCode, string(b), nil
}

// headerRT addresses a sandbox's port by headers, as the SDKs do when the
// route is reached by an address rather than <port>-<id>.<domain>.
type headerRT struct {
	id, port, token string
	rt              http.RoundTripper
}

func (h headerRT) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set(proxy.HeaderSandboxID, h.id)
	r.Header.Set(proxy.HeaderSandboxPort, h.port)
	if h.token != "" {
		r.Header.Set(proxy.HeaderEnvdToken, h.token)
	}
	return h.rt.RoundTrip(r)
}

func run(ctx context.Context, c processconnect.ProcessClient, script string) (string, error) {
	s, err := c.Start(ctx, connect.NewRequest(&pb.StartRequest{Process: &pb.ProcessConfig{Cmd: "/bin/sh", Args: []string{"-c", script}}}))
	if err != nil {
		return "", err
	}
	defer s.Close()
	var out bytes.Buffer
	for s.Receive() {
		ev := s.Msg().GetEvent()
		if d := ev.GetData(); d != nil {
			out.Write(d.GetStdout())
			out.Write(d.GetStderr())
		}
		if e := ev.GetEnd(); e != nil && e.GetExitCode() != 0 {
			return out.String(), fmt.Errorf("exit %d", e.GetExitCode())
		}
	}
	return out.String(), s.Err()
}

const webScript = `cr=$(printf '\r')
while IFS= read -r l; do case "$l" in "$cr"|"") break;; esac; done
printf 'HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 10\r\nConnection: close\r\n\r\nhelm-test\n'`

// startWeb starts a tiny web server on port 8000 in the sandbox (busybox
// nc); the process keeps running after the stream is closed.
func startWeb(ctx context.Context, c processconnect.ProcessClient) error {
	_, err := run(ctx, c, "cat > /tmp/web.sh <<'EOF'\n"+webScript+"\nEOF\n(nc -ll -p 8000 -e /bin/sh /tmp/web.sh >/dev/null 2>&1 &) ; echo started")
	return err
}

func getPort(ctx context.Context, hc *http.Client, route, id string) error {
	var last string
	for i := 0; i < 30; i++ {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, strings.TrimRight(route, "/")+"/", nil)
		resp, err := hc.Do(req)
		if err == nil {
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK && strings.TrimSpace(string(b)) == "helm-test" {
				return nil
			}
			last = fmt.Sprintf("%s %q", resp.Status, b)
		} else {
			last = err.Error()
		}
		time.Sleep(500 * time.Millisecond)
	}
	return fmt.Errorf("port 8000 of %s through the route: %s", id, last)
}

func putFile(ctx context.Context, hc *http.Client, route, path, content string) error {
	u := strings.TrimRight(route, "/") + "/files?" + url.Values{"path": {path}}.Encode()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, u, strings.NewReader(content))
	req.Header.Set("Content-Type", "application/octet-stream")
	resp, err := hc.Do(req)
	if err != nil {
		return fmt.Errorf("write a file: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		b, _ := io.ReadAll(resp.Body)
		return fmt.Errorf("write a file: %s %s", resp.Status, b)
	}
	return nil
}

func getFile(ctx context.Context, hc *http.Client, route, path string) (string, error) {
	u := strings.TrimRight(route, "/") + "/files?" + url.Values{"path": {path}}.Encode()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	resp, err := hc.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("%s %s", resp.Status, b)
	}
	return string(b), nil
}

func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}
