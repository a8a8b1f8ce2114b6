package agenttest

import (
	"bytes"
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	pb "github.com/cubesandbox/cube/api/envd/process"
)

func (h *harness) testAdmin(t *testing.T) {
	code, b, _ := h.do(t, h.h1, "GET", "/metrics", nil, nil)
	var m struct {
		Ts          int64   `json:"ts"`
		CPUCount    int     `json:"cpu_count"`
		CPUUsedPct  float64 `json:"cpu_used_pct"`
		MemTotal    uint64  `json:"mem_total"`
		MemUsed     uint64  `json:"mem_used"`
		MemTotalMiB uint64  `json:"mem_total_mib"`
		DiskUsed    uint64  `json:"disk_used"`
		DiskTotal   uint64  `json:"disk_total"`
	}
	if code != http.StatusOK || json.Unmarshal(b, &m) != nil {
		t.Fatalf("metrics: %d %s", code, b)
	}
	if m.CPUCount < 1 || m.MemTotal == 0 || m.MemUsed == 0 || m.MemUsed > m.MemTotal || m.MemTotalMiB != m.MemTotal>>20 ||
		m.DiskTotal == 0 || m.DiskUsed > m.DiskTotal || m.CPUUsedPct < 0 || m.CPUUsedPct > 100 ||
		time.Since(time.Unix(m.Ts, 0)).Abs() > time.Minute {
		t.Errorf("metrics implausible: %s", b)
	}
	if h.tg.Sandbox && m.MemTotal > 1<<40 {
		t.Errorf("sandbox memory total %d is not its cgroup limit", m.MemTotal)
	}

	code, b, _ = h.do(t, h.h1, "GET", "/_cube/info", nil, nil)
	var info struct {
		EnvdVersion string `json:"envdVersion"`
		PID         int    `json:"pid"`
	}
	if code != http.StatusOK || json.Unmarshal(b, &info) != nil || info.EnvdVersion != "0.6.4" {
		t.Errorf("info: %d %s", code, b)
	}
	if h.tg.Sandbox && info.PID != 1 {
		t.Errorf("agent is pid %d in its sandbox, want 1", info.PID)
	}

	// A sync to "now" is a no-op everywhere.
	body := fmt.Sprintf(`{"timestamp":%q}`, time.Now().UTC().Format(time.RFC3339Nano))
	code, b, _ = h.do(t, h.h1, "POST", "/_cube/clock", strings.NewReader(body), nil)
	if code != http.StatusOK || !strings.Contains(string(b), `"adjusted":false`) {
		t.Errorf("clock sync to now: %d %s", code, b)
	}
	code, b, _ = h.do(t, h.h1, "POST", "/_cube/clock", strings.NewReader(`{}`), nil)
	if code != http.StatusBadRequest {
		t.Errorf("clock without timestamp: %d %s", code, b)
	}
	code, b, _ = h.do(t, h.h1, "POST", "/_cube/fsthaw", nil, nil)
	if code != http.StatusPreconditionFailed {
		t.Errorf("thaw when not frozen: %d %s", code, b)
	}
	code, b, _ = h.do(t, h.h1, "POST", "/_cube/fsfreeze", strings.NewReader(`{"timeout_ms": -5}`), nil)
	if code != http.StatusBadRequest {
		t.Errorf("freeze with a bad timeout: %d %s", code, b)
	}
	if h.tg.Sandbox {
		// runc sandboxes have neither CAP_SYS_TIME nor CAP_SYS_ADMIN:
		// both fail cleanly, saying why, and change nothing.
		far := fmt.Sprintf(`{"timestamp":%q}`, time.Now().Add(time.Hour).UTC().Format(time.RFC3339Nano))
		code, b, _ = h.do(t, h.h1, "POST", "/_cube/clock", strings.NewReader(far), nil)
		if code != http.StatusPreconditionFailed || !strings.Contains(string(b), "CAP_SYS_TIME") {
			t.Errorf("clock set in a container: %d %s", code, b)
		}
		code, b, _ = h.do(t, h.h1, "POST", "/_cube/fsfreeze", nil, nil)
		if code != http.StatusPreconditionFailed || !strings.Contains(string(b), "CAP_SYS_ADMIN") {
			t.Errorf("fsfreeze in a runc sandbox: %d %s", code, b)
		}
		h.upload(t, "user", h.tg.UserHome+"/not-frozen.txt", []byte("writes still work"))
	}
}

// envelope frames one Connect streaming message.
func envelope(flags byte, payload []byte) []byte {
	b := make([]byte, 5+len(payload))
	b[0] = flags
	binary.BigEndian.PutUint32(b[1:], uint32(len(payload)))
	copy(b[5:], payload)
	return b
}

func (h *harness) testBadInput(t *testing.T) {
	stream := map[string]string{"Content-Type": "application/connect+json"}
	// Garbage where a streaming envelope should be.
	code, b, _ := h.do(t, h.h1, "POST", "/process.Process/Start", strings.NewReader("\xff\xff not an envelope"), stream)
	if code == http.StatusOK && !strings.Contains(string(b), `"error"`) {
		t.Errorf("garbage envelope: %d %q", code, b)
	}
	// An envelope announcing more bytes than it carries.
	short := envelope(0, []byte(`{"process":{"cmd":"true"}}`))
	binary.BigEndian.PutUint32(short[1:], 1<<20)
	code, b, _ = h.do(t, h.h1, "POST", "/process.Process/Start", bytes.NewReader(short), stream)
	if code == http.StatusOK && !strings.Contains(string(b), `"error"`) {
		t.Errorf("truncated envelope: %d %q", code, b)
	}
	// A well-framed message that is not the right JSON.
	code, b, _ = h.do(t, h.h1, "POST", "/process.Process/Start", bytes.NewReader(envelope(0, []byte(`{"process":{"cmd":42}}`))), stream)
	if !strings.Contains(string(b), "invalid_argument") {
		t.Errorf("bad message JSON: %d %q", code, b)
	}
	// Unary with malformed JSON and with an unknown content type.
	code, b, _ = h.do(t, h.h1, "POST", "/process.Process/List", strings.NewReader("{nope"), map[string]string{"Content-Type": "application/json"})
	if code != http.StatusBadRequest || !strings.Contains(string(b), "invalid_argument") {
		t.Errorf("malformed unary JSON: %d %q", code, b)
	}
	code, _, _ = h.do(t, h.h1, "POST", "/process.Process/List", strings.NewReader("{}"), map[string]string{"Content-Type": "text/plain"})
	if code != http.StatusUnsupportedMediaType {
		t.Errorf("unknown codec: %d", code)
	}
	// Unknown RPCs and services.
	for _, p := range []string{"/process.Process/Nope", "/filesystem.Filesystem/Nope", "/nosuch.Service/Call"} {
		code, _, _ := h.do(t, h.h1, "POST", p, strings.NewReader("{}"), map[string]string{"Content-Type": "application/json"})
		if code != http.StatusNotFound {
			t.Errorf("unknown RPC %s: %d, want 404", p, code)
		}
	}
	// A message over the agent's limit.
	big := envelope(0, []byte(`{"process":{"cmd":"`+strings.Repeat("a", 17<<20)+`"}}`))
	_, b, _ = h.do(t, h.h1, "POST", "/process.Process/Start", bytes.NewReader(big), stream)
	if !strings.Contains(string(b), "resource_exhausted") {
		t.Errorf("oversized message: %.200q", b)
	}
	h.healthy(t)
	// And real work still works.
	r, err := h.run(ctxT(t), h.proc, as(h, "", sh("echo alive")))
	if err != nil || r.stdout != "alive\n" {
		t.Fatalf("after bad input: %q %v", r.stdout, err)
	}
}

func (h *harness) testInitAndAuth(t *testing.T) {
	ctx := ctxT(t)
	post := func(body string) (int, []byte) {
		t.Helper()
		code, b, _ := h.do(t, h.h1, "POST", "/init", strings.NewReader(body), map[string]string{"Content-Type": "application/json"})
		return code, b
	}
	if code, b := post(`{"envVars":{"CUBE_A":"1","CUBE_B":"two words"},"defaultUser":"root","defaultWorkdir":"/tmp"}`); code != http.StatusNoContent {
		t.Fatalf("init: %d %s", code, b)
	}
	t.Cleanup(func() {
		h.token = ""
		if code, b := post(`{"defaultUser":"user","defaultWorkdir":""}`); code != http.StatusNoContent {
			t.Errorf("restore init: %d %s", code, b)
		}
	})
	code, b, _ := h.do(t, h.h1, "GET", "/envs", nil, nil)
	var envs map[string]string
	if code != http.StatusOK || json.Unmarshal(b, &envs) != nil || envs["CUBE_A"] != "1" || envs["CUBE_B"] != "two words" {
		t.Errorf("envs: %d %s", code, b)
	}
	r, err := h.run(ctx, h.proc, as(h, "", sh(`echo "$CUBE_B|$(id -u)|$PWD"`)))
	if err != nil || r.stdout != "two words|0|/tmp\n" {
		t.Errorf("after init: %q %v", r.stdout, err)
	}
	// The request's own envs win over /init's.
	req := sh(`echo $CUBE_A`)
	req.Process.Envs = map[string]string{"CUBE_A": "mine"}
	if r, err := h.run(ctx, h.proc, as(h, "", req)); err != nil || r.stdout != "mine\n" {
		t.Errorf("request env override: %q %v", r.stdout, err)
	}
	for _, bad := range []string{`{"defaultUser":"ghost"}`, `{"defaultWorkdir":"relative"}`, `{"envVars":{"A=B":"x"}}`, `{not json`} {
		if code, b := post(bad); code != http.StatusBadRequest {
			t.Errorf("init %s: %d %s", bad, code, b)
		}
	}

	// Access token: set it, then every route but /health needs it.
	const token = "s3cret-token"
	if code, b := post(`{"accessToken":"` + token + `"}`); code != http.StatusNoContent {
		t.Fatalf("init token: %d %s", code, b)
	}
	_, err = h.proc.List(ctx, as(h, "", &pb.ListRequest{}))
	wantCode(t, "list without token", err, connect.CodeUnauthenticated)
	_, err = h.run(ctx, h.proc, as(h, "", sh("true")))
	wantCode(t, "start without token", err, connect.CodeUnauthenticated)
	h.healthy(t)
	for _, p := range []string{"/envs", "/metrics", "/_cube/info"} {
		if code, _, _ := h.do(t, h.h1, "GET", p, nil, nil); code != http.StatusUnauthorized {
			t.Errorf("GET %s without token: %d", p, code)
		}
	}
	if code, _ := post(`{"accessToken":"stolen"}`); code != http.StatusUnauthorized {
		t.Errorf("re-init without the token: %d", code)
	}
	h.token = token
	if _, err := h.proc.List(ctx, as(h, "", &pb.ListRequest{})); err != nil {
		t.Errorf("list with token: %v", err)
	}
	// /files also takes envd's signed URLs instead of the header.
	dir := h.scratch(t)
	h.upload(t, "user", dir+"/signed.txt", []byte("signed"))
	h.token = ""
	sig := func(path, op, user, exp string) string {
		parts := []string{path, op, user, token}
		if exp != "" {
			parts = append(parts, exp)
		}
		sum := sha256.Sum256([]byte(strings.Join(parts, ":")))
		// Query-escaped: base64 has '+' and '/'.
		return urlQuery("v1_" + base64.RawStdEncoding.EncodeToString(sum[:]))
	}
	p := dir + "/signed.txt"
	get := func(q string) int {
		code, _, _ := h.do(t, h.h1, "GET", "/files?"+q, nil, nil)
		return code
	}
	if c := get("path=" + urlQuery(p) + "&username=user&signature=" + sig(p, "read", "user", "")); c != http.StatusOK {
		t.Errorf("signed download: %d", c)
	}
	future := fmt.Sprint(time.Now().Add(time.Hour).Unix())
	if c := get("path=" + urlQuery(p) + "&signature=" + sig(p, "read", "", future) + "&signature_expiration=" + future); c != http.StatusOK {
		t.Errorf("signed download with expiration: %d", c)
	}
	past := fmt.Sprint(time.Now().Add(-time.Hour).Unix())
	for name, q := range map[string]string{
		"no signature":      "path=" + urlQuery(p),
		"wrong signature":   "path=" + urlQuery(p) + "&signature=v1_AAAA",
		"write sig on read": "path=" + urlQuery(p) + "&username=user&signature=" + sig(p, "write", "user", ""),
		"expired":           "path=" + urlQuery(p) + "&signature=" + sig(p, "read", "", past) + "&signature_expiration=" + past,
	} {
		if c := get(q); c != http.StatusUnauthorized {
			t.Errorf("%s: %d, want 401", name, c)
		}
	}
	wq := "/files?path=" + urlQuery(dir+"/w.txt") + "&username=user&signature=" + sig(dir+"/w.txt", "write", "user", "")
	if code, b, _ := h.do(t, h.h1, "POST", wq, strings.NewReader("w"), map[string]string{"Content-Type": "application/octet-stream"}); code != http.StatusOK {
		t.Errorf("signed upload: %d %s", code, b)
	}
	// The holder of the token may clear it.
	h.token = token
	if code, b := post(`{"accessToken":""}`); code != http.StatusNoContent {
		t.Fatalf("clear token: %d %s", code, b)
	}
	h.token = ""
	if _, err := h.proc.List(ctx, as(h, "", &pb.ListRequest{})); err != nil {
		t.Errorf("list after clearing the token: %v", err)
	}
}
