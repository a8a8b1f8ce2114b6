package cli_test

import (
	"bytes"
	"context"
	"log/slog"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/cubesandbox/cube/internal/cli"
	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
	"github.com/cubesandbox/cube/internal/cubeletapi"
	"github.com/cubesandbox/cube/internal/template/registrytest"
	"github.com/cubesandbox/cube/internal/testimage"
)

// TestTemplateImportFromRegistry drives `cubecli template import --image`
// against a cubelet and a password-protected loopback registry.
func TestTemplateImportFromRegistry(t *testing.T) {
	env := cubelettest.New(t, "")
	sock := filepath.Join(env.Dir, "cli.sock")
	env.Config.API.Socket = sock
	svc := env.Start(t)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = cubeletapi.Serve(ctx, svc, slog.Default()); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	for i := 0; ; i++ {
		if _, _, code := run(t, sock, "node", "info"); code == 0 {
			break
		} else if i > 100 {
			t.Fatal("cubelet API never came up")
		}
		time.Sleep(20 * time.Millisecond)
	}
	reg := registrytest.Start(t, registrytest.Options{Username: "ci", Password: "pw"})
	bb, _ := testimage.BusyboxImage()
	if _, err := reg.Push(context.Background(), "team/busybox:1", bb); err != nil {
		t.Fatal(err)
	}
	ref := reg.Ref("team/busybox:1")

	// Usage mistakes never reach cubelet.
	for _, args := range [][]string{
		{"template", "import", "x"},
		{"template", "import", "x", "/some/path", "--image", ref},
		{"template", "import", "x", "/some/path", "--insecure"},
		{"template", "import", "x", "--image", ref, "--password", "a", "--password-stdin"},
	} {
		if _, errOut, code := run(t, sock, args...); code != cli.ExitUsage {
			t.Errorf("%v: exit %d, want usage (%s)", args, code, errOut)
		}
	}

	// A wrong password is Unauthenticated, reported as such.
	_, errOut, code := run(t, sock, "template", "import", "priv", "--image", ref, "--insecure", "--username", "ci", "--password", "nope")
	if code != cli.ExitError || !strings.Contains(errOut, "Unauthenticated") {
		t.Fatalf("wrong password: exit %d\n%s", code, errOut)
	}

	// The password from stdin; progress lines on stderr.
	importStdin := func(id string) (string, string, error) {
		var out, errb bytes.Buffer
		root := cli.NewRoot(&out)
		root.SetArgs([]string{"--addr", sock, "template", "import", id, "--image", ref, "--insecure", "--username", "ci", "--password-stdin"})
		root.SetIn(strings.NewReader("pw\n"))
		root.SetOut(&out)
		root.SetErr(&errb)
		err := root.ExecuteContext(context.Background())
		return out.String(), errb.String(), err
	}
	out, errOut, err := importStdin("priv")
	if err != nil {
		t.Fatalf("import: %v\n%s", err, errOut)
	}
	if !strings.Contains(out, "priv") || !strings.Contains(out, ref) {
		t.Errorf("table:\n%s", out)
	}
	for _, want := range []string{"resolve", "extract layer 1/1", "mkfs", "done"} {
		if !strings.Contains(errOut, want) {
			t.Errorf("progress lacks %q:\n%s", want, errOut)
		}
	}
	// Again: the existing template, instantly.
	if _, errOut, err := importStdin("priv"); err != nil || strings.Contains(errOut, "extract") {
		t.Errorf("re-import: %v\n%s", err, errOut)
	}
	// The same digest under a new ID is reused.
	if _, errOut, err := importStdin("priv2"); err != nil || !strings.Contains(errOut, "reuse") {
		t.Errorf("dedupe: %v\n%s", err, errOut)
	}
	// The same ID from another image conflicts.
	tar := filepath.Join(env.Dir, "docker.tar")
	if err := testimage.BusyboxDockerTar(context.Background(), tar); err != nil {
		t.Fatal(err)
	}
	if _, errOut, code := run(t, sock, "template", "import", "priv", tar); code != cli.ExitAlreadyExists {
		t.Errorf("conflicting re-import: exit %d\n%s", code, errOut)
	}
	// The gRPC code itself, for API clients.
	_, _, err = importStdinWrong(sock, ref)
	if st, _ := status.FromError(err); st.Code() != codes.Unauthenticated {
		t.Errorf("gRPC code %v", err)
	}
}

func importStdinWrong(sock, ref string) (string, string, error) {
	var out, errb bytes.Buffer
	root := cli.NewRoot(&out)
	root.SetArgs([]string{"--addr", sock, "template", "import", "nope", "--image", ref, "--insecure", "--username", "ci", "--password-stdin"})
	root.SetIn(strings.NewReader("wrong\n"))
	root.SetOut(&out)
	root.SetErr(&errb)
	err := root.ExecuteContext(context.Background())
	return out.String(), errb.String(), err
}
