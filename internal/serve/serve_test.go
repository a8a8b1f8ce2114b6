package serve_test

import (
	"context"
	"net/http"
	"os"
	"path/filepath"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/cubesandbox/cube/internal/serve"
)

func TestGroup(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "run", "api.sock")
	if err := os.MkdirAll(filepath.Dir(sock), 0o755); err != nil {
		t.Fatal(err)
	}
	// A stale socket file of a killed daemon is replaced.
	if err := os.WriteFile(sock, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	g := &serve.Group{Grace: time.Second}
	ul, err := g.Unix(sock)
	if err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(sock); err != nil || fi.Mode().Perm() != 0o600 || fi.Mode()&os.ModeSocket == 0 {
		t.Fatalf("socket %v, %v: want a 0600 socket", fi.Mode(), err)
	}
	gs := grpc.NewServer()
	healthpb.RegisterHealthServer(gs, health.NewServer())
	g.GRPC("test API", gs, ul)
	tl, err := g.TCP("test.tcp", "test TLS", "127.0.0.1:0", nil)
	if err != nil {
		t.Fatal(err)
	}
	g.HTTP("test metrics", http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusTeapot) }), tl)

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- g.Run(ctx) }()

	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{}); err != nil {
		t.Fatalf("gRPC over the socket: %v", err)
	}
	resp, err := http.Get("http://" + tl.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusTeapot {
		t.Fatalf("HTTP status %d", resp.StatusCode)
	}

	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Run after cancel: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return after its context ended")
	}
	if _, err := os.Stat(sock); !os.IsNotExist(err) {
		t.Fatalf("socket left behind: %v", err)
	}
	if resp, err := http.Get("http://" + tl.Addr().String()); err == nil {
		resp.Body.Close()
		t.Fatal("HTTP listener still open after Run")
	}
}

func TestCloseBeforeRun(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "api.sock")
	g := &serve.Group{}
	l, err := g.Unix(sock)
	if err != nil {
		t.Fatal(err)
	}
	g.GRPC("test API", grpc.NewServer(), l)
	if _, err := g.TCP("test.tcp", "test TLS", "256.0.0.1:1", nil); err == nil {
		t.Fatal("listening on a bad address must fail")
	}
	g.Close()
	if _, err := os.Stat(sock); !os.IsNotExist(err) {
		t.Fatalf("Close left the socket: %v", err)
	}
}
