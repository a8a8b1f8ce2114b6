package procs

import (
	"context"
	"fmt"
	"net/http"
	"strconv"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"

	pb "github.com/cubesandbox/cube/api/envd/process"
	"github.com/cubesandbox/cube/api/envd/process/processconnect"
	"github.com/cubesandbox/cube/internal/agent/identity"
	"github.com/cubesandbox/cube/internal/agent/keepalive"
	"github.com/cubesandbox/cube/internal/errdefs"
)

// Defaults are the sandbox-wide settings /init provides.
type Defaults interface {
	EnvVars() map[string]string
	Workdir() string
}

// Service is process.Process over a Manager. The acting user comes from
// the request context (identity.WithUser, set by the agent's auth layer).
type Service struct {
	m        *Manager
	defaults Defaults
}

var _ processconnect.ProcessHandler = (*Service)(nil)

// NewService returns the Connect service.
func NewService(m *Manager, d Defaults) *Service { return &Service{m: m, defaults: d} }

func user(ctx context.Context) (*identity.User, error) {
	if u := identity.FromContext(ctx); u != nil {
		return u, nil
	}
	return nil, fmt.Errorf("no user for this request: %w", errdefs.ErrUnauthenticated)
}

// timeoutOf is the Connect deadline the client set: the process's lifetime,
// as in envd (commands.run's timeoutMs kills the command).
func timeoutOf(h http.Header) (time.Duration, error) {
	v := h.Get("Connect-Timeout-Ms")
	if v == "" {
		return 0, nil
	}
	ms, err := strconv.ParseInt(v, 10, 64)
	if err != nil || ms < 0 {
		return 0, fmt.Errorf("Connect-Timeout-Ms %q: %w", v, errdefs.ErrInvalidArgument)
	}
	return time.Duration(ms) * time.Millisecond, nil
}

func (s *Service) Start(ctx context.Context, req *connect.Request[pb.StartRequest], stream *connect.ServerStream[pb.StartResponse]) error {
	u, err := user(ctx)
	if err != nil {
		return err
	}
	timeout, err := timeoutOf(req.Header())
	if err != nil {
		return err
	}
	msg := req.Msg
	p, sub, err := s.m.Start(StartOptions{
		Config:  msg.GetProcess(),
		User:    u,
		Workdir: s.defaults.Workdir(),
		Env:     s.defaults.EnvVars(),
		PTY:     msg.Pty,
		Tag:     msg.GetTag(),
		Stdin:   msg.Stdin == nil || msg.GetStdin(),
		Timeout: timeout,
	})
	if err != nil {
		return err
	}
	defer sub.Close()
	send := func(ev *pb.ProcessEvent) error { return stream.Send(&pb.StartResponse{Event: ev}) }
	if err := send(startEvent(p.PID)); err != nil {
		return err
	}
	return pumpEvents(ctx, sub, keepalive.Interval(req.Header()), send)
}

func (s *Service) Connect(ctx context.Context, req *connect.Request[pb.ConnectRequest], stream *connect.ServerStream[pb.ConnectResponse]) error {
	p, err := s.m.Get(req.Msg.GetProcess())
	if err != nil {
		return err
	}
	send := func(ev *pb.ProcessEvent) error { return stream.Send(&pb.ConnectResponse{Event: ev}) }
	sub, end := p.Subscribe()
	if err := send(startEvent(p.PID)); err != nil {
		if sub != nil {
			sub.Close()
		}
		return err
	}
	if sub == nil { // ended between Get and Subscribe
		return send(&pb.ProcessEvent{Event: &pb.ProcessEvent_End{End: end}})
	}
	defer sub.Close()
	return pumpEvents(ctx, sub, keepalive.Interval(req.Header()), send)
}

func startEvent(pid uint32) *pb.ProcessEvent {
	return &pb.ProcessEvent{Event: &pb.ProcessEvent_Start{Start: &pb.ProcessEvent_StartEvent{Pid: pid}}}
}

// pumpEvents forwards a subscription to a stream until the end event has
// been sent or the client goes away (the process keeps running then).
func pumpEvents(ctx context.Context, sub *Subscription, every time.Duration, send func(*pb.ProcessEvent) error) error {
	tick := time.NewTicker(every)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-tick.C:
			if err := send(&pb.ProcessEvent{Event: &pb.ProcessEvent_Keepalive{Keepalive: &pb.ProcessEvent_KeepAlive{}}}); err != nil {
				return err
			}
		case ev := <-sub.C:
			if ev.End != nil {
				return send(&pb.ProcessEvent{Event: &pb.ProcessEvent_End{End: ev.End}})
			}
			if err := send(&pb.ProcessEvent{Event: &pb.ProcessEvent_Data{Data: ev.Data}}); err != nil {
				return err
			}
			tick.Reset(every)
		}
	}
}

func (s *Service) List(context.Context, *connect.Request[pb.ListRequest]) (*connect.Response[pb.ListResponse], error) {
	res := &pb.ListResponse{}
	for _, p := range s.m.List() {
		info := &pb.ProcessInfo{Config: p.Config, Pid: p.PID}
		if p.Tag != "" {
			info.Tag = &p.Tag
		}
		res.Processes = append(res.Processes, info)
	}
	return connect.NewResponse(res), nil
}

func (s *Service) SendInput(_ context.Context, req *connect.Request[pb.SendInputRequest]) (*connect.Response[pb.SendInputResponse], error) {
	p, err := s.m.Get(req.Msg.GetProcess())
	if err != nil {
		return nil, err
	}
	if err := write(p, req.Msg.GetInput()); err != nil {
		return nil, err
	}
	return connect.NewResponse(&pb.SendInputResponse{}), nil
}

func write(p *Proc, in *pb.ProcessInput) error {
	switch v := in.GetInput().(type) {
	case *pb.ProcessInput_Stdin:
		return p.WriteStdin(v.Stdin)
	case *pb.ProcessInput_Pty:
		return p.WritePTY(v.Pty)
	}
	return fmt.Errorf("input needs stdin or pty data: %w", errdefs.ErrInvalidArgument)
}

func (s *Service) StreamInput(_ context.Context, stream *connect.ClientStream[pb.StreamInputRequest]) (*connect.Response[pb.StreamInputResponse], error) {
	var p *Proc
	for stream.Receive() {
		switch ev := stream.Msg().GetEvent().(type) {
		case *pb.StreamInputRequest_Start:
			if p != nil {
				return nil, fmt.Errorf("stream input: second start event: %w", errdefs.ErrInvalidArgument)
			}
			found, err := s.m.Get(ev.Start.GetProcess())
			if err != nil {
				return nil, err
			}
			p = found
		case *pb.StreamInputRequest_Data:
			if p == nil {
				return nil, fmt.Errorf("stream input: data before the start event: %w", errdefs.ErrInvalidArgument)
			}
			if err := write(p, ev.Data.GetInput()); err != nil {
				return nil, err
			}
		case *pb.StreamInputRequest_Keepalive:
		default:
			return nil, fmt.Errorf("stream input: empty event: %w", errdefs.ErrInvalidArgument)
		}
	}
	if err := stream.Err(); err != nil {
		return nil, err
	}
	return connect.NewResponse(&pb.StreamInputResponse{}), nil
}

func (s *Service) SendSignal(_ context.Context, req *connect.Request[pb.SendSignalRequest]) (*connect.Response[pb.SendSignalResponse], error) {
	var sig unix.Signal
	switch req.Msg.GetSignal() {
	case pb.Signal_SIGNAL_SIGKILL:
		sig = unix.SIGKILL
	case pb.Signal_SIGNAL_SIGTERM:
		sig = unix.SIGTERM
	default:
		return nil, fmt.Errorf("signal %v: only SIGTERM and SIGKILL: %w", req.Msg.GetSignal(), errdefs.ErrInvalidArgument)
	}
	p, err := s.m.Get(req.Msg.GetProcess())
	if err != nil {
		return nil, err
	}
	if err := p.Signal(sig); err != nil {
		return nil, err
	}
	return connect.NewResponse(&pb.SendSignalResponse{}), nil
}

func (s *Service) Update(_ context.Context, req *connect.Request[pb.UpdateRequest]) (*connect.Response[pb.UpdateResponse], error) {
	p, err := s.m.Get(req.Msg.GetProcess())
	if err != nil {
		return nil, err
	}
	if req.Msg.Pty == nil {
		return nil, fmt.Errorf("update needs a pty size: %w", errdefs.ErrInvalidArgument)
	}
	if err := checkPTYSize(req.Msg.Pty); err != nil {
		return nil, err
	}
	size := req.Msg.GetPty().GetSize()
	if err := p.Resize(uint16(size.GetCols()), uint16(size.GetRows())); err != nil {
		return nil, err
	}
	return connect.NewResponse(&pb.UpdateResponse{}), nil
}

func (s *Service) CloseStdin(_ context.Context, req *connect.Request[pb.CloseStdinRequest]) (*connect.Response[pb.CloseStdinResponse], error) {
	p, err := s.m.Get(req.Msg.GetProcess())
	if err != nil {
		return nil, err
	}
	if err := p.CloseStdin(); err != nil {
		return nil, err
	}
	return connect.NewResponse(&pb.CloseStdinResponse{}), nil
}
