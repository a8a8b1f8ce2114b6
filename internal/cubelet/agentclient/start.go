package agentclient

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"time"

	"connectrpc.com/connect"

	pb "github.com/cubesandbox/cube/api/envd/process"
	"github.com/cubesandbox/cube/api/envd/process/processconnect"
	"github.com/cubesandbox/cube/internal/agentproto"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/runtime"
	"github.com/cubesandbox/cube/internal/sandbox"
)

// StartTag tags the template's service in the agent's process list (what
// the SDK's commands.list shows), as E2B's start command is tagged.
const StartTag = "start_cmd"

// readyEvery is how often the ready command is tried.
const readyEvery = 100 * time.Millisecond

// StartService starts a template's service in rec's sandbox through the
// agent's envd process API, as the sandbox's default user (sh -c start,
// left running when this returns), then runs ready (sh -c) until it exits
// 0 or ctx ends. A service that exits while ready still fails is an
// error carrying the end of its output. ready "" waits for nothing.
func StartService(ctx context.Context, d runtime.Driver, rec *sandbox.Record, start, ready string) error {
	e, err := EndpointFor(d, rec)
	if err != nil {
		return err
	}
	defer e.Client.CloseIdleConnections()
	client := processconnect.NewProcessClient(tokenClient(e), e.Base)

	// The service's stream is read until its start event and then closed:
	// the agent keeps a process whose client went away (as envd does for
	// background commands).
	sctx, stop := context.WithCancel(ctx)
	defer stop()
	tag := StartTag
	svc, err := client.Start(sctx, connect.NewRequest(&pb.StartRequest{
		Process: &pb.ProcessConfig{Cmd: "/bin/sh", Args: []string{"-c", start}}, Tag: &tag,
	}))
	if err != nil {
		return fmt.Errorf("start the template's service: %w: %w", err, errdefs.ErrUnavailable)
	}
	var pid uint32
	for pid == 0 && svc.Receive() {
		pid = svc.Msg().GetEvent().GetStart().GetPid()
	}
	if pid == 0 {
		return fmt.Errorf("start the template's service %q: no start event: %v: %w", start, svc.Err(), errdefs.ErrUnavailable)
	}
	// Watch it in the background while the ready command runs: a service
	// that dies early fails the create at once, with its last output.
	ended := make(chan string, 1)
	go func() {
		var tail []byte
		for svc.Receive() {
			ev := svc.Msg().GetEvent()
			tail = append(tail, ev.GetData().GetStdout()...)
			tail = append(tail, ev.GetData().GetStderr()...)
			if len(tail) > 2048 {
				tail = tail[len(tail)-2048:]
			}
			if end := ev.GetEnd(); end != nil {
				ended <- fmt.Sprintf("exited (%d %s): %s", end.GetExitCode(), end.GetStatus(), strings.TrimSpace(string(tail)))
				return
			}
		}
	}()
	if ready == "" {
		return nil
	}
	var last string
	for {
		ok, out, err := runOnce(ctx, client, ready)
		if ok {
			return nil
		}
		if err != nil {
			last = err.Error()
		} else {
			last = out
		}
		select {
		case why := <-ended:
			return fmt.Errorf("the template's service %q %s: %w", start, why, errdefs.ErrFailedPrecondition)
		case <-ctx.Done():
			return fmt.Errorf("the template's service %q not ready (%q: %s): %w", start, ready, last, ctx.Err())
		case <-time.After(readyEvery):
		}
	}
}

// runOnce runs sh -c cmd to its end and says whether it exited 0, with
// the end of its output.
func runOnce(ctx context.Context, client processconnect.ProcessClient, cmd string) (bool, string, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	no := false
	s, err := client.Start(ctx, connect.NewRequest(&pb.StartRequest{
		Process: &pb.ProcessConfig{Cmd: "/bin/sh", Args: []string{"-c", cmd}}, Stdin: &no,
	}))
	if err != nil {
		return false, "", err
	}
	defer s.Close()
	var out []byte
	for s.Receive() {
		ev := s.Msg().GetEvent()
		out = append(out, ev.GetData().GetStdout()...)
		out = append(out, ev.GetData().GetStderr()...)
		if end := ev.GetEnd(); end != nil {
			if len(out) > 512 {
				out = out[len(out)-512:]
			}
			return end.GetExitCode() == 0, strings.TrimSpace(string(out)), nil
		}
	}
	if err := s.Err(); err != nil {
		return false, "", err
	}
	return false, "", errors.New("stream ended without an end event")
}

// tokenClient is e's client with the access token on every request.
func tokenClient(e Endpoint) *http.Client {
	if e.Token == "" {
		return e.Client
	}
	c := *e.Client
	base := c.Transport
	if base == nil {
		base = http.DefaultTransport
	}
	c.Transport = tokenTransport{base: base, token: e.Token}
	return &c
}

type tokenTransport struct {
	base  http.RoundTripper
	token string
}

func (t tokenTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set(agentproto.AccessTokenHeader, t.token)
	return t.base.RoundTrip(r)
}
