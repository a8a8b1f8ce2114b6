package qmp

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"net"
	"path/filepath"
	"testing"
	"time"
)

// serve runs a scripted QMP server on a unix socket: it greets, then
// answers each command with reply(cmd, id), which returns the lines to
// send (events may come first, as QEMU's do).
func serve(t *testing.T, reply func(cmd string, id json.RawMessage) []string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "qmp.sock")
	l, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		conn, err := l.Accept()
		if err != nil {
			return
		}
		defer conn.Close()
		// A failed write shows as the client's error.
		_, _ = conn.Write([]byte(`{"QMP": {"version": {}, "capabilities": ["oob"]}}` + "\n"))
		sc := bufio.NewScanner(conn)
		for sc.Scan() {
			var req struct {
				Execute string          `json:"execute"`
				ID      json.RawMessage `json:"id"`
			}
			if json.Unmarshal(sc.Bytes(), &req) != nil {
				return
			}
			for _, line := range reply(req.Execute, req.ID) {
				_, _ = conn.Write([]byte(line + "\n"))
			}
		}
	}()
	return path
}

func TestExecute(t *testing.T) {
	path := serve(t, func(cmd string, id json.RawMessage) []string {
		switch cmd {
		case "qmp_capabilities":
			return []string{`{"return": {}, "id": ` + string(id) + `}`}
		case "query-status":
			return []string{
				`{"event": "STOP", "timestamp": {"seconds": 1, "microseconds": 2}}`,
				`{"return": {}, "id": "stale"}`,
				`{"return": {"status": "paused", "running": false}, "id": ` + string(id) + `}`,
			}
		case "hang":
			return nil
		}
		return []string{`{"error": {"class": "CommandNotFound", "desc": "The command ` + cmd + ` has not been found"}, "id": ` + string(id) + `}`}
	})
	ctx := t.Context()
	c, err := Dial(ctx, path)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	var st struct {
		Status  string `json:"status"`
		Running bool   `json:"running"`
	}
	if err := c.Execute(ctx, "query-status", nil, &st); err != nil || st.Status != "paused" || st.Running {
		t.Fatalf("query-status = %+v, %v", st, err)
	}
	var qe *Error
	if err := c.Execute(ctx, "nope", nil, nil); !errors.As(err, &qe) || qe.Class != "CommandNotFound" {
		t.Fatalf("unknown command = %v, want *Error CommandNotFound", err)
	}
	cctx, cancel := context.WithCancel(ctx)
	time.AfterFunc(20*time.Millisecond, cancel)
	if err := c.Execute(cctx, "hang", nil, nil); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled command = %v, want context.Canceled", err)
	}
}

func TestDialNotQMP(t *testing.T) {
	path := filepath.Join(t.TempDir(), "x.sock")
	l, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go func() {
		conn, err := l.Accept()
		if err == nil {
			_, _ = conn.Write([]byte("{\"hello\": 1}\n")) // a failed write shows as the client's error
			conn.Close()
		}
	}()
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Second)
	defer cancel()
	if _, err := Dial(ctx, path); err == nil {
		t.Fatal("Dial accepted a non-QMP greeting")
	}
	if _, err := Dial(ctx, filepath.Join(t.TempDir(), "absent.sock")); err == nil {
		t.Fatal("Dial of a missing socket succeeded")
	}
}
