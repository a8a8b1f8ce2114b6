package templatebuild

import (
	"bytes"
	"context"
	"encoding/base64"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"

	"connectrpc.com/connect"

	pb "github.com/cubesandbox/cube/api/envd/process"
	"github.com/cubesandbox/cube/api/envd/process/processconnect"
	"github.com/cubesandbox/cube/internal/errdefs"
)

// box is a build sandbox reached through its agent's envd API, as the
// SDKs reach any sandbox.
type box struct {
	id    string
	hc    *http.Client
	base  string
	token string
	pc    processconnect.ProcessClient
}

func newBox(id string, hc *http.Client, base, token string) *box {
	return &box{id: id, hc: hc, base: base, token: token, pc: processconnect.NewProcessClient(hc, base)}
}

func basicUser(user string) string {
	return "Basic " + base64.StdEncoding.EncodeToString([]byte(user+":"))
}

// ExitError is a command that ran and failed.
type ExitError struct {
	Code   int
	Status string
}

func (e *ExitError) Error() string { return fmt.Sprintf("exited with %s", e.Status) }

// run runs cmd with /bin/sh -c as user ("": the sandbox's default user), sending its output line by line
// to out (nil: discarded) and returning its stdout. A non-zero exit is an
// *ExitError.
func (b *box) run(ctx context.Context, cmd, user string, env map[string]string, cwd string, out func(stderr bool, line string)) ([]byte, error) {
	cfg := &pb.ProcessConfig{Cmd: "/bin/sh", Args: []string{"-c", cmd}, Envs: env}
	if cwd != "" {
		cfg.Cwd = &cwd
	}
	noStdin := false
	req := connect.NewRequest(&pb.StartRequest{Process: cfg, Stdin: &noStdin})
	if b.token != "" {
		req.Header().Set("X-Access-Token", b.token)
	}
	if user != "" {
		req.Header().Set("Authorization", basicUser(user))
	}
	stream, err := b.pc.Start(ctx, req)
	if err != nil {
		return nil, fmt.Errorf("sandbox %s: start %q: %w", b.id, cmd, err)
	}
	defer stream.Close()
	var stdout bytes.Buffer
	lines := [2]*lineSplitter{{out: out}, {out: out, stderr: true}}
	for stream.Receive() {
		ev := stream.Msg().GetEvent()
		switch {
		case ev.GetData() != nil:
			if d := ev.GetData().GetStdout(); d != nil {
				stdout.Write(d)
				lines[0].write(d)
			}
			if d := ev.GetData().GetStderr(); d != nil {
				lines[1].write(d)
			}
		case ev.GetEnd() != nil:
			lines[0].flush()
			lines[1].flush()
			end := ev.GetEnd()
			switch {
			case end.GetExited() && end.GetExitCode() == 0:
				return stdout.Bytes(), nil
			case end.GetExited() || end.GetStatus() != "":
				// A non-zero exit or a signal (envd also sets error
				// to the status then).
				return stdout.Bytes(), &ExitError{Code: int(end.GetExitCode()), Status: end.GetStatus()}
			}
			return stdout.Bytes(), fmt.Errorf("sandbox %s: %q: %s", b.id, cmd, end.GetError())
		}
	}
	if err := stream.Err(); err != nil {
		return stdout.Bytes(), fmt.Errorf("sandbox %s: %q: %w", b.id, cmd, err)
	}
	return stdout.Bytes(), fmt.Errorf("sandbox %s: %q: the stream ended without the process's end: %w", b.id, cmd, errdefs.ErrUnavailable)
}

// lineSplitter turns output chunks into lines for the build log.
type lineSplitter struct {
	out    func(stderr bool, line string)
	stderr bool
	buf    []byte
}

func (l *lineSplitter) write(p []byte) {
	if l.out == nil {
		return
	}
	l.buf = append(l.buf, p...)
	for {
		i := bytes.IndexByte(l.buf, '\n')
		if i < 0 {
			break
		}
		l.out(l.stderr, strings.TrimRight(string(l.buf[:i]), "\r"))
		l.buf = l.buf[i+1:]
	}
	if len(l.buf) > 64<<10 { // a very long line without a newline
		l.flush()
	}
}

func (l *lineSplitter) flush() {
	if l.out != nil && len(l.buf) > 0 {
		l.out(l.stderr, string(l.buf))
	}
	l.buf = nil
}

func (b *box) filesURL(p string) string {
	return b.base + "/files?" + url.Values{"path": {p}, "username": {"root"}}.Encode()
}

func (b *box) do(req *http.Request) (*http.Response, error) {
	if b.token != "" {
		req.Header.Set("X-Access-Token", b.token)
	}
	resp, err := b.hc.Do(req)
	if err != nil {
		return nil, fmt.Errorf("sandbox %s: %s %s: %w", b.id, req.Method, req.URL.Query().Get("path"), err)
	}
	if resp.StatusCode/100 != 2 {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		resp.Body.Close()
		return nil, fmt.Errorf("sandbox %s: %s %s: %s: %s", b.id, req.Method, req.URL.Query().Get("path"), resp.Status, bytes.TrimSpace(msg))
	}
	return resp, nil
}

// upload writes r to p in the sandbox as root.
func (b *box) upload(ctx context.Context, p string, r io.Reader) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, b.filesURL(p), r)
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/octet-stream")
	resp, err := b.do(req)
	if err != nil {
		return err
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	return resp.Body.Close()
}

// download copies p from the sandbox into w.
func (b *box) download(ctx context.Context, p string, w io.Writer) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, b.filesURL(p), nil)
	if err != nil {
		return err
	}
	resp, err := b.do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if _, err := io.Copy(w, resp.Body); err != nil {
		return fmt.Errorf("sandbox %s: download %s: %w", b.id, p, err)
	}
	return nil
}
