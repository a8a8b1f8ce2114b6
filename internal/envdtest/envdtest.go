// Package envdtest holds checks of the agent's (envd's) API that tests of
// several layers make through whatever stands between them and a sandbox
// (the route, a node's tunnel, another host).
package envdtest

import (
	"context"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	pb "github.com/cubesandbox/cube/api/envd/process"
	"github.com/cubesandbox/cube/api/envd/process/processconnect"
)

// Sh is a Start request running script with /bin/sh -c.
func Sh(script string) *connect.Request[pb.StartRequest] {
	return connect.NewRequest(&pb.StartRequest{Process: &pb.ProcessConfig{Cmd: "/bin/sh", Args: []string{"-c", script}}})
}

// Unbuffered runs `echo first; sleep 2; echo second` through c and fails
// t unless the first output arrives well before the end (within 1.5 s,
// the end after 2 s): a hop that buffers the stream fails it. It returns
// when the first event and the end arrived, counted from the call.
func Unbuffered(t testing.TB, c processconnect.ProcessClient) (first, end time.Duration) {
	t.Helper()
	start := time.Now()
	s, err := c.Start(context.Background(), Sh("echo first; sleep 2; echo second"))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	for s.Receive() {
		ev := s.Msg().GetEvent()
		if d := ev.GetData(); d != nil && strings.Contains(string(d.GetStdout()), "first") && first == 0 {
			first = time.Since(start)
		}
		if ev.GetEnd() != nil {
			end = time.Since(start)
		}
	}
	if s.Err() != nil || first == 0 || end == 0 {
		t.Fatalf("stream: first %s end %s err %v", first, end, s.Err())
	}
	if first > 1500*time.Millisecond || end < 2*time.Second {
		t.Fatalf("first output after %s, end after %s: buffered", first, end)
	}
	return first, end
}
