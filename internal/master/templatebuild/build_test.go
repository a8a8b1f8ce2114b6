package templatebuild_test

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	cubeletpb "github.com/cubesandbox/cube/api/cubelet/v1"
	pb "github.com/cubesandbox/cube/api/envd/process"
	"github.com/cubesandbox/cube/api/envd/process/processconnect"
	masterpb "github.com/cubesandbox/cube/api/master/v1"
	"github.com/cubesandbox/cube/internal/master"
	"github.com/cubesandbox/cube/internal/master/catalog"
	"github.com/cubesandbox/cube/internal/master/mastertest"
	"github.com/cubesandbox/cube/internal/master/templatebuild"
	"github.com/cubesandbox/cube/internal/template/baseimage"
	"github.com/cubesandbox/cube/internal/testenv"
)

type buildStatus struct {
	Status     string `json:"status"`
	LogEntries []struct {
		Level, Message, Step string
	} `json:"logEntries"`
	Reason *struct {
		Message, Step string
	} `json:"reason"`
}

// build drives E2B's build API as the SDK's Template builder does and
// returns the final status and the whole log.
func build(t *testing.T, api *mastertest.Client, name string, spec templatebuild.Spec, files map[string][]byte) (buildStatus, []string, time.Duration) {
	t.Helper()
	start := time.Now()
	var req struct{ TemplateID, BuildID string }
	if r := api.Do(t, "POST", "/v3/templates", map[string]any{"name": name}, &req); r.StatusCode != http.StatusAccepted {
		t.Fatalf("request build: %d %s", r.StatusCode, r.Body)
	}
	for _, st := range spec.Steps {
		if st.Type != "COPY" {
			continue
		}
		var link struct {
			Present bool
			URL     string
		}
		if r := api.Do(t, "GET", "/templates/"+req.TemplateID+"/files/"+st.FilesHash, nil, &link); r.StatusCode != http.StatusCreated {
			t.Fatalf("upload link: %d %s", r.StatusCode, r.Body)
		}
		if link.Present {
			continue
		}
		put, _ := http.NewRequest("PUT", link.URL, bytes.NewReader(files[st.FilesHash]))
		resp, err := http.DefaultClient.Do(put)
		if err != nil || resp.StatusCode != 200 {
			t.Fatalf("upload: %v %v", resp, err)
		}
		resp.Body.Close()
		// The token is for one upload.
		put, _ = http.NewRequest("PUT", link.URL, bytes.NewReader(files[st.FilesHash]))
		resp, err = http.DefaultClient.Do(put)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusForbidden {
			t.Fatalf("second upload with the same token: %d, want 403", resp.StatusCode)
		}
	}
	lastBuildID = req.BuildID
	if r := api.Do(t, "POST", "/v2/templates/"+req.TemplateID+"/builds/"+req.BuildID, spec, nil); r.StatusCode != http.StatusAccepted {
		t.Fatalf("start build: %d %s", r.StatusCode, r.Body)
	}
	var logs []string
	for {
		var st buildStatus
		if r := api.Do(t, "GET", "/templates/"+req.TemplateID+"/builds/"+req.BuildID+"/status?logsOffset="+itoa(len(logs)), nil, &st); r.StatusCode != 200 {
			t.Fatalf("status: %d %s", r.StatusCode, r.Body)
		}
		for _, l := range st.LogEntries {
			logs = append(logs, "["+l.Step+"] "+l.Message)
		}
		if st.Status == templatebuild.StatusReady || st.Status == templatebuild.StatusError {
			return st, logs, time.Since(start)
		}
		if time.Since(start) > 10*time.Minute {
			t.Fatalf("build still %s after 10m; log:\n%s", st.Status, strings.Join(logs, "\n"))
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// lastBuildID is the build build started last.
var lastBuildID string

func itoa(n int) string { return strconv.Itoa(n) }

func tarOf(t *testing.T, name string, data []byte) ([]byte, string) {
	var b bytes.Buffer
	tw := tar.NewWriter(&b)
	if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: name, Mode: 0o644, Size: int64(len(data))}); err != nil {
		t.Fatal(err)
	}
	_, _ = tw.Write(data)
	_ = tw.Close()
	h := sha256.Sum256(append([]byte(name+"\x00"), data...))
	return b.Bytes(), hex.EncodeToString(h[:])
}

// sh runs cmd in a sandbox through its agent and returns stdout.
func sh(t *testing.T, svc *master.Service, id, cmd string) string {
	t.Helper()
	ctx := master.WithTeam(context.Background(), catalog.DefaultTeam)
	hc, base, token, done, err := svc.AgentHTTP(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	defer done()
	req := connect.NewRequest(&pb.StartRequest{Process: &pb.ProcessConfig{Cmd: "/bin/sh", Args: []string{"-c", cmd}}})
	if token != "" {
		req.Header().Set("X-Access-Token", token)
	}
	stream, err := processconnect.NewProcessClient(hc, base).Start(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	defer stream.Close()
	var out bytes.Buffer
	for stream.Receive() {
		ev := stream.Msg().GetEvent()
		out.Write(ev.GetData().GetStdout())
		out.Write(ev.GetData().GetStderr())
		if end := ev.GetEnd(); end != nil {
			if end.GetExitCode() != 0 {
				t.Fatalf("%q in %s: %s: %s", cmd, id, end.GetStatus(), out.String())
			}
			return out.String()
		}
	}
	t.Fatalf("%q in %s: %v", cmd, id, stream.Err())
	return ""
}

// TestTemplateBuild builds a template from the Debian base through the
// E2B build API (steps of every kind, a start command with a ready
// check), creates a sandbox from it, builds it again (every step from the
// cache, the same image), and has a build fail: the failing step and its
// output are reported, and the build sandbox, its mounts and the
// engine's scratch files are gone. Only with CUBE_TEST_BASE=1 (the base
// image).
func TestTemplateBuild(t *testing.T) {
	if os.Getenv("CUBE_TEST_BASE") != "1" {
		t.Skip("set CUBE_TEST_BASE=1 to build templates from the base image")
	}
	testenv.RequireRoot(t, "a master, a node and runc sandboxes")
	cache := os.Getenv("CUBE_BASE_CACHE")
	if cache == "" {
		cache = "/var/cache/cube/base"
	}
	if _, err := baseimage.Build(context.Background(), baseimage.Options{Dir: cache}); err != nil {
		t.Fatal(err)
	}
	t.Setenv("CUBE_BASE_CACHE", cache)
	m := mastertest.StartMaster(t, "")
	n := mastertest.StartNode(t, m, "busybox")
	m.WaitHealthy(t, n)
	svc := m.Server.Service
	api := m.API(m.APIKey(t))
	api.HC.Timeout = 10 * time.Minute

	// Names a build may not take: the build bases', and a template this
	// team did not build (busybox, imported by the node).
	if r := api.Do(t, "POST", "/v3/templates", map[string]any{"name": "build-base-ffffffffffff"}, nil); r.StatusCode != http.StatusBadRequest {
		t.Errorf("build named like a build base: %d %s", r.StatusCode, r.Body)
	}
	mastertest.WaitFor(t, 30*time.Second, "busybox on the node", func() bool {
		_, err := svc.GetTemplate(context.Background(), "busybox")
		return err == nil
	})
	if r := api.Do(t, "POST", "/v3/templates", map[string]any{"name": "busybox"}, nil); r.StatusCode != http.StatusConflict {
		t.Errorf("build over a template the team did not build: %d %s", r.StatusCode, r.Body)
	}

	hello, helloHash := tarOf(t, "hello.txt", []byte("hello from the build\n"))
	spec := templatebuild.Spec{
		FromImage: "debian:stable",
		Steps: []templatebuild.Step{
			{Type: "RUN", Args: []string{"echo one > /opt/one && rm -f /etc/motd", "root"}},
			{Type: "ENV", Args: []string{"GREETING", "hi there"}},
			{Type: "WORKDIR", Args: []string{"/srv/app"}},
			{Type: "COPY", Args: []string{"hello.txt", "/srv/app/", "", ""}, FilesHash: helloHash},
			{Type: "RUN", Args: []string{`cat hello.txt > copied && echo "$GREETING" > env && pwd > cwd`}},
		},
		StartCmd: "python3 -m http.server 8000 --directory /srv/app",
		ReadyCmd: `python3 -c 'import urllib.request; urllib.request.urlopen("http://127.0.0.1:8000/copied")'`,
	}
	st, logs, first := build(t, api, "built", spec, map[string][]byte{helloHash: hello})
	t.Logf("first build: %s in %s\n%s", st.Status, first, strings.Join(logs, "\n"))
	if st.Status != "ready" {
		t.Fatalf("first build: %s %+v", st.Status, st.Reason)
	}
	var tmpl struct{ BuildID string }
	api.Do(t, "GET", "/templates/built", nil, &tmpl)
	digest := tmpl.BuildID

	// Uploads are per team: another team asking for the same files hash
	// must upload its own (what team A uploaded never reaches team B's
	// build); team A's own request, the control, finds it cached.
	if _, err := m.Admin.CreateTeam(context.Background(), &masterpb.CreateTeamRequest{Name: "other"}); err != nil {
		t.Fatal(err)
	}
	kb, err := m.Admin.CreateAPIKey(context.Background(), &masterpb.CreateAPIKeyRequest{Name: "other-key", Team: "other"})
	if err != nil {
		t.Fatal(err)
	}
	apiB := m.API(kb.Secret)
	for _, c := range []struct {
		who     string
		api     *mastertest.Client
		present bool
	}{{"team A (control)", api, true}, {"team B", apiB, false}} {
		var link struct{ Present bool }
		if r := c.api.Do(t, "GET", "/templates/any/files/"+helloHash, nil, &link); r.StatusCode != http.StatusCreated || link.Present != c.present {
			t.Errorf("%s: upload link for team A's files: %d %s, want present=%v", c.who, r.StatusCode, r.Body, c.present)
		}
		t.Logf("%s: files %s present=%v", c.who, helloHash[:12], c.present)
	}

	ctx := master.WithTeam(context.Background(), catalog.DefaultTeam)
	sb, err := svc.Create(ctx, master.CreateRequest{Template: "built"})
	if err != nil {
		t.Fatalf("create from the built template: %v", err)
	}
	t.Cleanup(func() { _ = svc.Kill(ctx, sb.ID) })
	for cmd, want := range map[string]string{
		"cat /opt/one":                   "one\n",
		"test -e /etc/motd || echo gone": "gone\n",
		"cat /srv/app/copied":            "hello from the build\n",
		"cat /srv/app/env":               "hi there\n",
		"cat /srv/app/cwd":               "/srv/app\n",
		// The service the template starts is serving.
		`python3 -c 'import urllib.request; print(urllib.request.urlopen("http://127.0.0.1:8000/env").read().decode(), end="")'`: "hi there\n",
		"test -e " + templatebuild.ScratchDir + " || echo clean":                                                                 "clean\n",
	} {
		if got := sh(t, svc, sb.ID, cmd); got != want {
			t.Errorf("%s: %q, want %q", cmd, got, want)
		}
	}

	// The log query of the last build: its error-level entries (none),
	// and the first two entries of the whole log.
	var logsResp struct {
		Logs []struct{ Level, Message string }
	}
	lastBuild := lastBuildID
	if r := api.Do(t, "GET", "/templates/built/builds/"+lastBuild+"/logs?limit=2", nil, &logsResp); r.StatusCode != 200 || len(logsResp.Logs) != 2 {
		t.Errorf("build logs: %d %s", r.StatusCode, r.Body)
	}
	if r := api.Do(t, "GET", "/templates/built/builds/"+lastBuild+"/logs?level=error", nil, &logsResp); r.StatusCode != 200 || len(logsResp.Logs) != 0 {
		t.Errorf("build logs at error level of a build that succeeded: %d %s", r.StatusCode, r.Body)
	}

	st, logs2, second := build(t, api, "built", spec, nil)
	t.Logf("second build: %s in %s (first %s)\n%s", st.Status, second, first, strings.Join(logs2, "\n"))
	if st.Status != "ready" {
		t.Fatalf("second build: %s %+v", st.Status, st.Reason)
	}
	cached := 0
	for _, l := range logs2 {
		if strings.Contains(l, "CACHED") {
			cached++
		}
		if strings.Contains(l, "Build sandbox") {
			t.Errorf("the second build ran a sandbox: %s", l)
		}
	}
	if cached != len(spec.Steps) {
		t.Errorf("second build: %d steps cached, want %d", cached, len(spec.Steps))
	}
	api.Do(t, "GET", "/templates/built", nil, &tmpl)
	if tmpl.BuildID != digest {
		t.Errorf("second build: image %s, the first made %s", tmpl.BuildID, digest)
	}

	// The last step changed: the first four come from the cache (their
	// layers replayed in the build sandbox, the whiteout too), the last
	// runs, and the template is replaced.
	if err := svc.Kill(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}
	changed := spec
	changed.Steps = append([]templatebuild.Step(nil), spec.Steps...)
	changed.Steps[4] = templatebuild.Step{Type: "RUN", Args: []string{`test ! -e /etc/motd && cat /opt/one hello.txt > copied`}}
	st, logs3, third := build(t, api, "built", changed, nil)
	t.Logf("third build (last step changed): %s in %s\n%s", st.Status, third, strings.Join(logs3, "\n"))
	if st.Status != "ready" {
		t.Fatalf("third build: %s %+v", st.Status, st.Reason)
	}
	if n := strings.Count(strings.Join(logs3, "\n"), "CACHED"); n != 4 {
		t.Errorf("third build: %d steps cached, want 4", n)
	}
	sb3, err := svc.Create(ctx, master.CreateRequest{Template: "built"})
	if err != nil {
		t.Fatalf("create from the rebuilt template: %v", err)
	}
	t.Cleanup(func() { _ = svc.Kill(ctx, sb3.ID) })
	if got := sh(t, svc, sb3.ID, "cat /srv/app/copied"); got != "one\nhello from the build\n" {
		t.Errorf("rebuilt template: copied = %q", got)
	}
	_ = svc.Kill(ctx, sb3.ID)

	// A failing step: the build says which and shows its output, and
	// leaves no sandbox, mount or file.
	failing := templatebuild.Spec{FromImage: "debian:stable", Steps: []templatebuild.Step{
		{Type: "RUN", Args: []string{"echo ok > /opt/ok"}},
		{Type: "RUN", Args: []string{"echo boom-output; echo boom-err >&2; exit 3"}},
	}}
	st, logs4, _ := build(t, api, "failing", failing, nil)
	t.Logf("failing build: %s %+v\n%s", st.Status, st.Reason, strings.Join(logs4, "\n"))
	if st.Status != "error" || st.Reason == nil || st.Reason.Step != "2" || !strings.Contains(st.Reason.Message, "exit status 3") {
		t.Fatalf("failing build: %s %+v", st.Status, st.Reason)
	}
	all := strings.Join(logs4, "\n")
	if !strings.Contains(all, "boom-output") || !strings.Contains(all, "boom-err") {
		t.Errorf("the failing step's output is not in the log")
	}
	idRE := regexp.MustCompile(`Build sandbox (\S+) `)
	mm := idRE.FindStringSubmatch(all)
	if mm == nil {
		t.Fatal("no build sandbox in the log")
	}
	boxID := mm[1]
	mastertest.WaitFor(t, 30*time.Second, "the build sandbox gone", func() bool {
		resp, err := n.Client.ListSandboxes(context.Background(), &cubeletpb.ListSandboxesRequest{})
		if err != nil {
			return false
		}
		for _, s := range resp.Sandboxes {
			if s.GetId() == boxID {
				return false
			}
		}
		return true
	})
	mounts, _ := os.ReadFile("/proc/self/mountinfo")
	if strings.Contains(string(mounts), boxID) {
		t.Errorf("a mount of build sandbox %s is left", boxID)
	}
	dir := filepath.Join(svc.TemplateStore().Dir(), "builds")
	for _, pat := range []string{".build-*", "layers/.tmp-*", "files/.tmp-*"} {
		if left, _ := filepath.Glob(filepath.Join(dir, pat)); len(left) > 0 {
			t.Errorf("left: %v", left)
		}
	}
	if r := api.Do(t, "GET", "/templates/failing", nil, nil); r.StatusCode != http.StatusNotFound {
		t.Errorf("failed build's template: %d %s", r.StatusCode, r.Body)
	}
	t.Logf("build sandbox %s removed; no mount or scratch file left", boxID)
}
