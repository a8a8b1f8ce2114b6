package agenttest

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"testing"
	"time"

	"connectrpc.com/connect"

	pb "github.com/cubesandbox/cube/api/envd/process"
	"github.com/cubesandbox/cube/api/envd/process/processconnect"
)

// Shell runs `/bin/sh -c script` as root through the envd process API of
// the agent at baseURL and returns its stdout. The test fails unless the
// script exits 0 within 30 s. Sandbox tests of every runtime use it.
func Shell(ctx context.Context, t testing.TB, c *http.Client, baseURL, script string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	req := connect.NewRequest(&pb.StartRequest{Process: &pb.ProcessConfig{Cmd: "/bin/sh", Args: []string{"-c", script}}})
	req.Header().Set("Authorization", "Basic cm9vdDo=") // root:
	s, err := processconnect.NewProcessClient(c, baseURL).Start(ctx, req)
	if err != nil {
		t.Fatalf("start %q: %v", script, err)
	}
	defer s.Close()
	var out []byte
	var end *pb.ProcessEvent_EndEvent
	for s.Receive() {
		ev := s.Msg().GetEvent()
		out = append(out, ev.GetData().GetStdout()...)
		if e := ev.GetEnd(); e != nil {
			end = e
		}
	}
	if err := s.Err(); err != nil || end == nil || end.GetExitCode() != 0 {
		t.Fatalf("run %q: end %v, err %v, output %q", script, end, err, out)
	}
	return string(out)
}

// WaitHealthy polls baseURL's /health through c every 20 ms (each try
// bounded to 2 s) until it answers 2xx, limit passes or ctx ends, and
// returns the last failure otherwise.
func WaitHealthy(ctx context.Context, c *http.Client, baseURL string, limit time.Duration) error {
	deadline := time.Now().Add(limit)
	last := ctx.Err()
	for time.Now().Before(deadline) && ctx.Err() == nil {
		rctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		req, _ := http.NewRequestWithContext(rctx, http.MethodGet, baseURL+"/health", nil)
		resp, err := c.Do(req)
		cancel()
		if err == nil {
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode/100 == 2 {
				return nil
			}
			err = fmt.Errorf("status %d", resp.StatusCode)
		}
		last = err
		time.Sleep(20 * time.Millisecond)
	}
	return fmt.Errorf("not healthy within %v: %v", limit, last)
}
