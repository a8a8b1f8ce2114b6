package opsapi

import (
	"context"
	"encoding/json"
	"net/http"

	"connectrpc.com/connect"
	"golang.org/x/net/websocket"

	pb "github.com/cubesandbox/cube/api/envd/process"
	"github.com/cubesandbox/cube/api/envd/process/processconnect"
)

// Agents reaches a running sandbox's agent (the terminal).
type Agents interface {
	AgentHTTP(ctx context.Context, id string) (hc *http.Client, base, token string, done func(), err error)
}

// termMsg is what the console sends over the terminal's WebSocket.
type termMsg struct {
	Type string `json:"type"` // input, resize
	Data string `json:"data,omitempty"`
	Cols uint32 `json:"cols,omitempty"`
	Rows uint32 `json:"rows,omitempty"`
}

// terminal bridges a WebSocket to a shell on a PTY in the sandbox, run by
// its agent (envd's process service, as the SDKs' terminal): output goes
// out as binary frames, input and resizes come in as JSON text frames.
// The shell is killed when the socket closes. The browser's same-origin
// cookie admits it; a WebSocket from another origin is refused (the
// handshake's Origin must be this host).
func (h *Handler) terminal(w http.ResponseWriter, r *http.Request) {
	ag, ok := h.b.(Agents)
	if !ok {
		http.Error(w, "no terminal", http.StatusNotImplemented)
		return
	}
	id := r.PathValue("sandboxID")
	hc, base, token, done, err := ag.AgentHTTP(r.Context(), id)
	if err != nil {
		writeError(w, err)
		return
	}
	defer done()
	srv := websocket.Server{
		Handshake: func(cfg *websocket.Config, req *http.Request) error {
			// A browser always sends Origin; a page of another site
			// opening the socket (the cookie is SameSite=Strict too) is
			// refused. Non-browser callers send none.
			origin, err := websocket.Origin(cfg, req)
			if err != nil {
				return err
			}
			if origin != nil && origin.Host != req.Host {
				return errCSRF
			}
			cfg.Origin = origin
			return nil
		},
		Handler: func(ws *websocket.Conn) { h.runTerminal(ws, hc, base, token, id) },
	}
	srv.ServeHTTP(w, r)
}

func (h *Handler) runTerminal(ws *websocket.Conn, hc *http.Client, base, token, id string) {
	defer ws.Close()
	ctx, cancel := context.WithCancel(ws.Request().Context())
	defer cancel()
	pc := processconnect.NewProcessClient(hc, base)
	withToken := func(req connect.AnyRequest) {
		if token != "" {
			req.Header().Set("X-Access-Token", token)
		}
	}
	start := connect.NewRequest(&pb.StartRequest{
		Process: &pb.ProcessConfig{Cmd: "/bin/sh", Args: []string{"-l"}, Envs: map[string]string{"TERM": "xterm-256color"}},
		Pty:     &pb.PTY{Size: &pb.PTY_Size{Cols: 80, Rows: 24}},
	})
	withToken(start)
	stream, err := pc.Start(ctx, start)
	if err != nil {
		h.log.Warn("ops: terminal", "sandbox_id", id, "err", err)
		_ = websocket.Message.Send(ws, "\r\n[terminal: "+err.Error()+"]\r\n")
		return
	}
	defer stream.Close()
	var pid uint32
	if stream.Receive() {
		pid = stream.Msg().GetEvent().GetStart().GetPid()
	}
	if pid == 0 {
		_ = websocket.Message.Send(ws, "\r\n[terminal: the shell did not start]\r\n")
		return
	}
	h.log.Info("ops: terminal opened", "sandbox_id", id, "pid", pid)
	sel := &pb.ProcessSelector{Selector: &pb.ProcessSelector_Pid{Pid: pid}}
	defer func() {
		req := connect.NewRequest(&pb.SendSignalRequest{Process: sel, Signal: pb.Signal_SIGNAL_SIGKILL})
		withToken(req)
		_, _ = pc.SendSignal(context.WithoutCancel(ctx), req)
		h.log.Info("ops: terminal closed", "sandbox_id", id, "pid", pid)
	}()
	go func() {
		defer cancel()
		for {
			var raw string
			if err := websocket.Message.Receive(ws, &raw); err != nil {
				h.log.Debug("ops: terminal socket", "sandbox_id", id, "err", err)
				return
			}
			var m termMsg
			if json.Unmarshal([]byte(raw), &m) != nil {
				continue
			}
			switch m.Type {
			case "input":
				req := connect.NewRequest(&pb.SendInputRequest{Process: sel, Input: &pb.ProcessInput{Input: &pb.ProcessInput_Pty{Pty: []byte(m.Data)}}})
				withToken(req)
				if _, err := pc.SendInput(ctx, req); err != nil {
					h.log.Warn("ops: terminal input", "sandbox_id", id, "err", err)
					return
				}
			case "resize":
				if m.Cols == 0 || m.Rows == 0 || m.Cols > 1000 || m.Rows > 1000 {
					continue
				}
				req := connect.NewRequest(&pb.UpdateRequest{Process: sel, Pty: &pb.PTY{Size: &pb.PTY_Size{Cols: m.Cols, Rows: m.Rows}}})
				withToken(req)
				_, _ = pc.Update(ctx, req)
			}
		}
	}()
	for stream.Receive() {
		ev := stream.Msg().GetEvent()
		if d := ev.GetData(); d != nil {
			if b := d.GetPty(); len(b) > 0 {
				if err := websocket.Message.Send(ws, b); err != nil {
					return
				}
			}
		}
		if ev.GetEnd() != nil {
			_ = websocket.Message.Send(ws, "\r\n[exited]\r\n")
			return
		}
	}
}
