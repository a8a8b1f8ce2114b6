package e2bapi_test

import (
	"bufio"
	"encoding/json"
	"net/http"
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/cubesandbox/cube/internal/master/mastertest"
)

// TestSDKPathsServed sends every operation of the OpenAPI the SDKs bundle
// (testdata/sdk-openapi-paths.txt) to a running master's API with a valid
// key and a body of {}: none may be 405 or the catch-all's "no route"
// 404, and every error must be E2B's {"code", "message"} with code equal
// to the status. What an operation does with made-up IDs (404 sandbox
// not found, 400 for a missing field, 501 with what to do instead) is the
// route's own answer. The control row is a path of no spec, which must be
// the "no route" 404 the walk looks for.
func TestSDKPathsServed(t *testing.T) {
	ops := readSDKPaths(t)
	m := mastertest.StartMaster(t, "")
	c := m.API(m.APIKey(t))
	param := regexp.MustCompile(`\{[^}]+\}`)
	check := func(t *testing.T, method, path string) (int, errBody) {
		t.Helper()
		var body any
		if method == "POST" || method == "PUT" || method == "PATCH" {
			body = "{}"
		}
		r := c.Do(t, method, path, body, nil)
		var eb errBody
		if r.StatusCode >= 400 {
			if err := json.Unmarshal(r.Body, &eb); err != nil || eb.Message == "" || eb.Code != r.StatusCode {
				t.Errorf("%s %s: %d with a body not in E2B's error shape: %s", method, path, r.StatusCode, r.Body)
			}
		}
		return r.StatusCode, eb
	}
	t.Run("control: a path of no spec is the catch-all's 404", func(t *testing.T) {
		code, eb := check(t, "GET", "/no-such-path/x")
		t.Logf("GET /no-such-path/x: %d %s", code, eb.Message)
		if code != http.StatusNotFound || !strings.HasPrefix(eb.Message, "no route") {
			t.Fatalf("got %d %q, want the no-route 404", code, eb.Message)
		}
	})
	for _, op := range ops {
		path := param.ReplaceAllStringFunc(op.path, func(p string) string {
			switch p {
			case "{sandboxID}":
				return "isdkwalknosuchsandbx"
			case "{volumeID}":
				return "vol-nosuchvolume"
			}
			return "sdkwalk-" + strings.Trim(p, "{}")
		})
		code, eb := check(t, op.method, path)
		t.Logf("%-6s %-50s %d %s  [%s]", op.method, op.path, code, eb.Message, op.sdks)
		switch {
		case code == http.StatusMethodNotAllowed:
			t.Errorf("%s %s (%s): 405", op.method, op.path, op.sdks)
		case code == http.StatusNotFound && strings.HasPrefix(eb.Message, "no route"):
			t.Errorf("%s %s (%s): not routed: %s", op.method, op.path, op.sdks, eb.Message)
		}
	}
}

type errBody struct {
	Code    int    `json:"code"`
	Message string `json:"message"`
}

type sdkOp struct{ method, path, sdks string }

func readSDKPaths(t *testing.T) []sdkOp {
	t.Helper()
	f, err := os.Open("testdata/sdk-openapi-paths.txt")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var out []sdkOp
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		fs := strings.Fields(line)
		if len(fs) != 3 {
			t.Fatalf("bad line %q", line)
		}
		out = append(out, sdkOp{fs[0], fs[1], fs[2]})
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	if len(out) < 40 {
		t.Fatalf("only %d operations: the list is cut", len(out))
	}
	return out
}
