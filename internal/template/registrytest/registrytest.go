// Package registrytest runs a real OCI registry on loopback for tests:
// Debian's docker-registry (github.com/docker/distribution), with
// filesystem storage in a private directory and, optionally, htpasswd
// authentication. Tests skip when the package is not installed (hack/deps.sh
// installs it).
package registrytest

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/testenv"
	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"golang.org/x/crypto/bcrypt"

	"github.com/cubesandbox/cube/internal/forkthread"
)

// Binary is the registry Debian's docker-registry package installs.
const Binary = "/usr/bin/docker-registry"

// Registry is one running registry.
type Registry struct {
	Host     string // 127.0.0.1:port
	Dir      string // storage root (docker/registry/v2/... below it)
	Username string // empty when the registry is open
	Password string
}

// Options configure Start.
type Options struct {
	Username, Password string // both set: htpasswd auth with this one user
}

// Start runs a registry until the test ends. It skips t when the binary is
// missing.
func Start(t testing.TB, opts Options) *Registry {
	t.Helper()
	if _, err := os.Stat(Binary); err != nil {
		testenv.Missing(t, "%s missing (apt-get install docker-registry, or bash hack/deps.sh): %v", Binary, err)
	}
	dir := t.TempDir()
	r := &Registry{Dir: filepath.Join(dir, "storage"), Username: opts.Username, Password: opts.Password}
	auth := ""
	if opts.Username != "" {
		hash, err := bcrypt.GenerateFromPassword([]byte(opts.Password), bcrypt.MinCost)
		if err != nil {
			t.Fatal(err)
		}
		htpasswd := filepath.Join(dir, "htpasswd")
		if err := os.WriteFile(htpasswd, []byte(opts.Username+":"+string(hash)+"\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		auth = fmt.Sprintf("auth:\n  htpasswd:\n    realm: cube-test\n    path: %s\n", htpasswd)
	}
	// The port is picked by binding :0 and releasing it; another process
	// can take it in between, so a failed start is retried on a new one.
	var lastErr error
	for attempt := 0; attempt < 5; attempt++ {
		port, err := freePort()
		if err != nil {
			t.Fatal(err)
		}
		r.Host = fmt.Sprintf("127.0.0.1:%d", port)
		cfg := filepath.Join(dir, "config.yml")
		body := fmt.Sprintf(`version: 0.1
log:
  level: error
  accesslog:
    disabled: true
storage:
  filesystem:
    rootdirectory: %s
  delete:
    enabled: true
  maintenance:
    uploadpurging:
      enabled: false
http:
  addr: %s
%s`, r.Dir, r.Host, auth)
		if err := os.WriteFile(cfg, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
		if lastErr = r.run(t, cfg); lastErr == nil {
			return r
		}
	}
	t.Fatalf("start registry: %v", lastErr)
	return nil
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

func (r *Registry) run(t testing.TB, cfg string) error {
	var out strings.Builder
	cmd := exec.Command(Binary, "serve", cfg)
	cmd.Stdout, cmd.Stderr = &out, &out
	// Its own process group, so stopping it cannot touch the test.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := forkthread.Start(cmd); err != nil {
		return err
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	stop := func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-exited: //nolint:errcheck // its exit status after SIGTERM says nothing
		case <-time.After(5 * time.Second):
			_ = cmd.Process.Kill()
			<-exited //nolint:errcheck // killed: the status is the signal
		}
	}
	deadline := time.Now().Add(15 * time.Second)
	for time.Now().Before(deadline) {
		select {
		case err := <-exited:
			return fmt.Errorf("registry exited: %v: %s", err, out.String())
		default:
		}
		resp, err := http.Get("http://" + r.Host + "/v2/")
		if err == nil {
			resp.Body.Close()
			// 401 is ready too: auth is on.
			if resp.StatusCode == http.StatusOK || resp.StatusCode == http.StatusUnauthorized {
				t.Cleanup(stop)
				return nil
			}
		}
		time.Sleep(50 * time.Millisecond)
	}
	stop()
	return fmt.Errorf("registry on %s not ready: %s", r.Host, out.String())
}

// Ref is the reference of repo:tag in this registry.
func (r *Registry) Ref(repoTag string) string { return r.Host + "/" + repoTag }

// Push writes img as repoTag and returns its pinned reference
// (host/repo@sha256:...).
func (r *Registry) Push(ctx context.Context, repoTag string, img v1.Image) (string, error) {
	ref, err := name.ParseReference(r.Ref(repoTag), name.Insecure)
	if err != nil {
		return "", err
	}
	if err := remote.Write(ref, img, remote.WithContext(ctx), remote.WithAuth(r.auth())); err != nil {
		return "", err
	}
	d, err := img.Digest()
	if err != nil {
		return "", err
	}
	return ref.Context().Digest(d.String()).String(), nil
}

// PushIndex writes an image index as repoTag.
func (r *Registry) PushIndex(ctx context.Context, repoTag string, idx v1.ImageIndex) error {
	ref, err := name.ParseReference(r.Ref(repoTag), name.Insecure)
	if err != nil {
		return err
	}
	return remote.WriteIndex(ref, idx, remote.WithContext(ctx), remote.WithAuth(r.auth()))
}

func (r *Registry) auth() authn.Authenticator {
	if r.Username == "" {
		return authn.Anonymous
	}
	return &authn.Basic{Username: r.Username, Password: r.Password}
}

// BlobPath is where the registry keeps the blob with digest d.
func (r *Registry) BlobPath(d v1.Hash) string {
	return filepath.Join(r.Dir, "docker", "registry", "v2", "blobs", d.Algorithm, d.Hex[:2], d.Hex, "data")
}
