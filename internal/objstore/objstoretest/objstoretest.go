// Package objstoretest starts a real S3-compatible object store for tests:
// SeaweedFS's all-in-one `weed mini`, built by hack/s3/weed.sh at the
// version pinned in hack/s3/go.mod and cached outside the clone. Each
// server listens on its own loopback address (127.x.y.z, chosen per
// server), so several run side by side on the fixed ports weed uses
// without colliding, and keeps its data in the test's temporary directory.
package objstoretest

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"

	"github.com/cubesandbox/cube/internal/testenv"

	"github.com/cubesandbox/cube/internal/forkthread"
)

// Version is the SeaweedFS module version hack/s3/go.mod pins; the binary
// is looked up under it.
const Version = "v0.0.0-20261109003541-7506e5f91cd6"

// Bucket is the bucket every server starts with.
const Bucket = "cube"

// s3Port is weed's S3 port (its default), on the server's own address.
const s3Port = 8333

// Binary returns weed's path: $CUBE_WEED when set, else the cache
// hack/s3/weed.sh fills ($CUBE_WEED_CACHE/<Version>/weed, by default
// under /var/cache/cube/weed). It calls testenv.Missing when there is none.
func Binary(t testing.TB) string {
	t.Helper()
	p, ok := Lookup()
	if !ok {
		testenv.Missing(t, "needs SeaweedFS's weed at %s (build it with hack/s3/weed.sh)", p)
	}
	return p
}

// Lookup is Binary without a test: weed's path, and whether it is there.
func Lookup() (string, bool) {
	if p := os.Getenv("CUBE_WEED"); p != "" {
		return p, true
	}
	cache := os.Getenv("CUBE_WEED_CACHE")
	if cache == "" {
		cache = "/var/cache/cube/weed"
	}
	p := filepath.Join(cache, Version, "weed")
	_, err := os.Stat(p)
	return p, err == nil
}

// Server is one running store.
type Server struct {
	// Endpoint is host:port of the S3 API.
	Endpoint  string
	AccessKey string
	SecretKey string
	Bucket    string
	// AccessKeyFile and SecretKeyFile hold the keys, for configs that
	// read them from files.
	AccessKeyFile, SecretKeyFile string

	t   testing.TB
	bin string
	ip  string
	// netns: the namespace it runs in ("" = the test's).
	netns string
	// grpcBase is the first of its five gRPC ports; sockDir holds its
	// HTTP sockets.
	grpcBase int
	sockDir  string
	dir      string
	log      *os.File
	mu       sync.Mutex
	cmd      *exec.Cmd
	done     chan struct{}
}

// Start starts a server with an empty bucket Bucket and stops it when the
// test ends.
func Start(t testing.TB) *Server { return StartWith(t, Options{}) }

// Options place a server elsewhere than on a loopback address of its own.
type Options struct {
	// IP is the address it listens on; "" = a loopback address of its
	// own (127.x.y.z).
	IP string
	// NetNS is the network namespace (a path, /run/netns/NAME) it runs
	// in, where IP is; "" = the test's own.
	NetNS string
}

// StartWith is Start with o.
func StartWith(t testing.TB, o Options) *Server {
	t.Helper()
	bin := Binary(t)
	dir := t.TempDir()
	s := &Server{t: t, bin: bin, dir: dir, Bucket: Bucket, AccessKey: "cube" + randHex(4), SecretKey: randHex(20), ip: o.IP, netns: o.NetNS}
	// Its own sockets' directory, short for unix socket paths.
	sd, err := os.MkdirTemp("", "weed")
	must(t, err)
	s.sockDir = sd
	t.Cleanup(func() { os.RemoveAll(sd) })
	// Its own gRPC ports (see Restart): 5 from a random base, above
	// weed's defaults (18333-19340) and below the ephemeral range (32768
	// on), where an outbound connection could take one first.
	pb := make([]byte, 2)
	_, _ = rand.Read(pb)
	s.grpcBase = 20000 + (int(pb[0])<<8|int(pb[1]))%12000
	if s.ip == "" {
		// 127.0.0.0/8 is all loopback; one address per server keeps
		// weed's fixed ports (master, volume, filer, S3 and their gRPC
		// ports) apart.
		b := make([]byte, 2)
		_, _ = rand.Read(b)
		s.ip = fmt.Sprintf("127.%d.%d.%d", 100+int(b[0])%100, b[1], 2+int(b[0])%200)
	}
	s.Endpoint = net.JoinHostPort(s.ip, strconv.Itoa(s3Port))
	s.AccessKeyFile = filepath.Join(dir, "access_key")
	s.SecretKeyFile = filepath.Join(dir, "secret_key")
	must(t, os.WriteFile(s.AccessKeyFile, []byte(s.AccessKey+"\n"), 0o600))
	must(t, os.WriteFile(s.SecretKeyFile, []byte(s.SecretKey+"\n"), 0o600))
	cfg := map[string]any{"identities": []any{map[string]any{
		"name":        "cube",
		"credentials": []any{map[string]string{"accessKey": s.AccessKey, "secretKey": s.SecretKey}},
		"actions":     []string{"Admin", "Read", "Write", "List", "Tagging"},
	}}}
	cb, _ := json.Marshal(cfg)
	must(t, os.WriteFile(filepath.Join(dir, "s3.json"), cb, 0o600))
	must(t, os.MkdirAll(filepath.Join(dir, "data"), 0o700))
	lf, err := os.Create(filepath.Join(dir, "weed.log"))
	must(t, err)
	s.log = lf
	t.Cleanup(func() {
		s.Kill()
		_ = lf.Close()
		if t.Failed() {
			if b, err := os.ReadFile(lf.Name()); err == nil && len(b) > 0 {
				if len(b) > 8000 {
					b = b[len(b)-8000:]
				}
				t.Logf("weed log (tail):\n%s", b)
			}
		}
	})
	s.Restart()
	return s
}

// Restart starts the server process (again, after Kill) on the same data
// and waits until the bucket answers.
func (s *Server) Restart() {
	t := s.t
	t.Helper()
	args := []string{s.bin, "mini",
		"-ip=" + s.ip, "-ip.bind=" + s.ip, "-dir=" + filepath.Join(s.dir, "data"),
		"-s3.config=" + filepath.Join(s.dir, "s3.json"), "-bucket=" + s.Bucket,
		"-webdav=false", "-admin.ui=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
		"-admin.port.legacy=0",
		// weed mini's parts reach one another's gRPC through unix
		// sockets at fixed paths named by port (/tmp/seaweedfs-master-
		// grpc-<port>.sock, ...): servers on the same gRPC ports, even on
		// other addresses or in other network namespaces, would take
		// over each other's sockets and talk to each other's parts.
		// Ports of this server's own keep them apart.
		fmt.Sprintf("-master.port.grpc=%d", s.grpcBase), fmt.Sprintf("-volume.port.grpc=%d", s.grpcBase+1),
		fmt.Sprintf("-filer.port.grpc=%d", s.grpcBase+2), fmt.Sprintf("-s3.port.grpc=%d", s.grpcBase+3),
		fmt.Sprintf("-admin.port.grpc=%d", s.grpcBase+4),
		// Likewise the filer's and the S3 gateway's HTTP sockets (the
		// gateway reaches the filer through its socket).
		"-filer.localSocket=" + filepath.Join(s.sockDir, "filer.sock"),
		"-s3.localSocket=" + filepath.Join(s.sockDir, "s3.sock")}
	if s.netns != "" {
		// nsenter execs weed: the process (and its group) stays ours.
		args = append([]string{"nsenter", "--net=" + s.netns, "--"}, args...)
	}
	cmd := exec.Command(args[0], args[1:]...)
	cmd.Stdout, cmd.Stderr = s.log, s.log
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	cmd.Env = append(os.Environ(), "HOME="+s.dir, "TMPDIR="+s.dir)
	cmd.Dir = s.dir
	must(t, forkthread.Start(cmd))
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	s.mu.Lock()
	s.cmd, s.done = cmd, done
	s.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	c, err := minio.New(s.Endpoint, &minio.Options{Creds: credentials.NewStaticV4(s.AccessKey, s.SecretKey, "")})
	must(t, err)
	for {
		// Ready when the bucket answers a signed request (weed's master,
		// volume, filer and S3 parts all up); weed makes the bucket at
		// start, and the helper makes it if weed has not yet.
		ok, err := c.BucketExists(ctx, s.Bucket)
		if err == nil && !ok {
			err = c.MakeBucket(ctx, s.Bucket, minio.MakeBucketOptions{})
			ok = err == nil
		}
		if ok {
			s.warm(ctx, c, done)
			return
		}
		select {
		case <-done:
			t.Fatalf("weed exited before serving S3 (log: %s)", s.log.Name())
		case <-ctx.Done():
			t.Fatalf("weed did not serve S3 on %s within 90s (last: %v)", s.Endpoint, err)
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// warm writes until a write succeeds: a fresh weed grows its first
// volumes on the first writes, and parallel writes racing that growth
// fail ("volume 2 not found") although the bucket answers.
func (s *Server) warm(ctx context.Context, c *minio.Client, done chan struct{}) {
	t := s.t
	t.Helper()
	body := bytes.Repeat([]byte("w"), 64<<10)
	var err error
	for {
		if _, err = c.PutObject(ctx, s.Bucket, ".warm", bytes.NewReader(body), int64(len(body)), minio.PutObjectOptions{}); err == nil {
			must(t, c.RemoveObject(ctx, s.Bucket, ".warm", minio.RemoveObjectOptions{}))
			return
		}
		select {
		case <-done:
			t.Fatalf("weed exited before storing an object (log: %s)", s.log.Name())
		case <-ctx.Done():
			t.Fatalf("weed did not store an object within 90s (last: %v)", err)
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// Kill stops the server at once (SIGKILL to its process group), as a
// crash or a network cut would; nothing is flushed.
func (s *Server) Kill() {
	s.mu.Lock()
	cmd, done := s.cmd, s.done
	s.cmd = nil
	s.mu.Unlock()
	if cmd == nil {
		return
	}
	_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
	<-done
}

// CPU is the processor time (user and system) the server's process has
// used since it started; 0 when it is not running.
func (s *Server) CPU() time.Duration {
	s.mu.Lock()
	cmd := s.cmd
	s.mu.Unlock()
	if cmd == nil {
		return 0
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", cmd.Process.Pid))
	if err != nil {
		return 0
	}
	// Fields after the command name (which may hold spaces): utime and
	// stime are the 12th and 13th, in clock ticks (100 a second).
	f := strings.Fields(string(b[bytes.LastIndexByte(b, ')')+1:]))
	if len(f) < 13 {
		return 0
	}
	u, _ := strconv.ParseInt(f[11], 10, 64)
	st, _ := strconv.ParseInt(f[12], 10, 64)
	return time.Duration(u+st) * 10 * time.Millisecond
}

// DataDir is where the server keeps its data.
func (s *Server) DataDir() string { return filepath.Join(s.dir, "data") }

func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}
