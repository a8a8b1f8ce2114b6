package cubeletapi_test

import (
	"context"
	"log/slog"
	"net"
	"net/http"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
	"github.com/cubesandbox/cube/internal/cubeletapi"
)

// TestPprofOnlyWhenConfigured: the metrics listener serves /debug/pprof/
// with [api] pprof = true and not otherwise.
func TestPprofOnlyWhenConfigured(t *testing.T) {
	env := cubelettest.New(t, "")
	svc := env.Start(t)
	for _, on := range []bool{false, true} {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		addr := l.Addr().String()
		l.Close()
		env.Config.API.Metrics, env.Config.API.Pprof = addr, on
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { _ = cubeletapi.Serve(ctx, svc, slog.Default()); close(done) }()
		code := 0
		for i := 0; i < 100; i++ {
			resp, err := http.Get("http://" + addr + "/debug/pprof/")
			if err == nil {
				code = resp.StatusCode
				resp.Body.Close()
				break
			}
			time.Sleep(20 * time.Millisecond)
		}
		cancel()
		<-done
		if want := map[bool]int{false: http.StatusNotFound, true: http.StatusOK}[on]; code != want {
			t.Errorf("pprof = %v: GET /debug/pprof/ = %d, want %d", on, code, want)
		}
	}
}
