package opsapi

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"sort"
	"strconv"
	"strings"
	"time"

	"connectrpc.com/connect"

	fspb "github.com/cubesandbox/cube/api/envd/filesystem"
	"github.com/cubesandbox/cube/api/envd/filesystem/filesystemconnect"
	"github.com/cubesandbox/cube/internal/errdefs"
)

// The files browser: a running sandbox's files, through its agent (envd's
// filesystem service and its /files endpoint, as the SDKs use them) over
// the master's route to the node, as the sandbox's default user. The
// caller's team scopes AgentHTTP: another team's sandbox is not found.

// Size caps: a read shown in a page, and an upload through the master.
const (
	maxReadBytes   = 8 << 20
	maxUploadBytes = 256 << 20
	// maxListBytes bounds one directory listing from the agent (about
	// 100,000 entries); listTimeout how long the console waits for it.
	maxListBytes = 16 << 20
	listTimeout  = 30 * time.Second
)

// errTooLarge marks a read or upload over its cap (413).
var errTooLarge = errors.New("too large")

type fileJSON struct {
	Name     string    `json:"name"`
	Path     string    `json:"path"`
	Type     string    `json:"type"` // file, dir, symlink
	Size     int64     `json:"size"`
	Mode     string    `json:"mode"`
	Owner    string    `json:"owner"`
	Modified time.Time `json:"modified,omitzero"`
}

func filePath(r *http.Request) (string, error) {
	p := r.URL.Query().Get("path")
	if p == "" {
		p = "/"
	}
	if !strings.HasPrefix(p, "/") {
		return "", fmt.Errorf("path %q: want an absolute path: %w", p, errdefs.ErrInvalidArgument)
	}
	return p, nil
}

// listFiles lists one directory.
func (h *Handler) listFiles(w http.ResponseWriter, r *http.Request) {
	p, err := filePath(r)
	if err != nil {
		writeError(w, err)
		return
	}
	hc, base, token, done, err := h.agent(r)
	if err != nil {
		writeError(w, err)
		return
	}
	defer done()
	req := connect.NewRequest(&fspb.ListDirRequest{Path: p, Depth: 1})
	if token != "" {
		req.Header().Set("X-Access-Token", token)
	}
	// The agent is inside the sandbox, so its answer is bounded like any
	// other untrusted input: in size and in time.
	ctx, cancel := context.WithTimeout(r.Context(), listTimeout)
	defer cancel()
	resp, err := filesystemconnect.NewFilesystemClient(hc, base, connect.WithReadMaxBytes(maxListBytes)).ListDir(ctx, req)
	if err != nil {
		writeError(w, fromConnect(err))
		return
	}
	out := make([]fileJSON, 0, len(resp.Msg.GetEntries()))
	for _, e := range resp.Msg.GetEntries() {
		typ := "file"
		switch e.GetType() {
		case fspb.FileType_FILE_TYPE_DIRECTORY:
			typ = "dir"
		case fspb.FileType_FILE_TYPE_SYMLINK:
			typ = "symlink"
		}
		f := fileJSON{Name: e.GetName(), Path: e.GetPath(), Type: typ, Size: e.GetSize(), Mode: e.GetPermissions(), Owner: e.GetOwner()}
		if t := e.GetModifiedTime(); t != nil {
			f.Modified = t.AsTime()
		}
		out = append(out, f)
	}
	sort.Slice(out, func(i, j int) bool {
		if (out[i].Type == "dir") != (out[j].Type == "dir") {
			return out[i].Type == "dir"
		}
		return out[i].Name < out[j].Name
	})
	writeJSON(w, http.StatusOK, out)
}

// readFile sends a file's bytes as an attachment of opaque type (never
// rendered as a page of this origin), up to maxReadBytes.
func (h *Handler) readFile(w http.ResponseWriter, r *http.Request) {
	p, err := filePath(r)
	if err != nil {
		writeError(w, err)
		return
	}
	resp, err := h.agentFiles(r, http.MethodGet, p, nil)
	if err != nil {
		writeError(w, err)
		return
	}
	defer resp.Body.Close()
	if resp.ContentLength > maxReadBytes {
		writeError(w, fmt.Errorf("%s is %d bytes; the console reads at most %d: %w", p, resp.ContentLength, maxReadBytes, errTooLarge))
		return
	}
	w.Header().Set("Content-Type", "application/octet-stream")
	w.Header().Set("Content-Disposition", "attachment; filename*=UTF-8''"+url.PathEscape(p[strings.LastIndex(p, "/")+1:]))
	w.Header().Set("Cache-Control", "no-store")
	if resp.ContentLength >= 0 {
		w.Header().Set("Content-Length", strconv.FormatInt(resp.ContentLength, 10))
	}
	if resp.ContentLength < 0 {
		// No length announced: read up to the limit and one byte more,
		// so a file over it is refused rather than cut short with a 200.
		b, err := io.ReadAll(io.LimitReader(resp.Body, maxReadBytes+1))
		if err != nil {
			writeError(w, fmt.Errorf("read %s: %w: %w", p, errdefs.ErrUnavailable, err))
			return
		}
		if len(b) > maxReadBytes {
			writeError(w, fmt.Errorf("%s is over %d bytes; the console reads at most %d: %w", p, maxReadBytes, maxReadBytes, errTooLarge))
			return
		}
		w.Header().Set("Content-Length", strconv.Itoa(len(b)))
		w.WriteHeader(http.StatusOK)
		_, _ = w.Write(b)
		return
	}
	w.WriteHeader(http.StatusOK)
	_, _ = io.Copy(w, io.LimitReader(resp.Body, maxReadBytes))
}

// writeFile writes the request body to path (parents made), up to
// maxUploadBytes.
func (h *Handler) writeFile(w http.ResponseWriter, r *http.Request) {
	p, err := filePath(r)
	if err != nil {
		writeError(w, err)
		return
	}
	if r.ContentLength > maxUploadBytes {
		writeError(w, fmt.Errorf("an upload of %d bytes; at most %d through the console: %w", r.ContentLength, maxUploadBytes, errTooLarge))
		return
	}
	resp, err := h.agentFiles(r, http.MethodPost, p, http.MaxBytesReader(w, r.Body, maxUploadBytes))
	if err == nil {
		resp.Body.Close()
	}
	if mbe := (*http.MaxBytesError)(nil); errors.As(err, &mbe) {
		err = fmt.Errorf("an upload over %d bytes; at most %d through the console: %w", mbe.Limit, maxUploadBytes, errTooLarge)
	}
	team := "" // the sandbox's, so its team sees what the admin wrote there
	if sb, gerr := h.b.Get(r.Context(), r.PathValue("sandboxID")); gerr == nil {
		team = sb.Team
	}
	h.record(r, "file upload", r.PathValue("sandboxID")+":"+p, team, err)
	if err != nil {
		writeError(w, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

func (h *Handler) agent(r *http.Request) (hc *http.Client, base, token string, done func(), err error) {
	ag, ok := h.b.(Agents)
	if !ok {
		return nil, "", "", nil, fmt.Errorf("no route to sandboxes: %w", errdefs.ErrNotImplemented)
	}
	return ag.AgentHTTP(r.Context(), r.PathValue("sandboxID"))
}

// agentFiles calls the agent's /files for path; a non-2xx answer is an
// error carrying the agent's message.
func (h *Handler) agentFiles(r *http.Request, method, p string, body io.Reader) (*http.Response, error) {
	hc, base, token, done, err := h.agent(r)
	if err != nil {
		return nil, err
	}
	req, err := http.NewRequestWithContext(r.Context(), method, base+"/files?path="+url.QueryEscape(p), body)
	if err != nil {
		done()
		return nil, err
	}
	if token != "" {
		req.Header.Set("X-Access-Token", token)
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/octet-stream")
	}
	resp, err := hc.Do(req)
	if err != nil {
		done()
		return nil, fmt.Errorf("the sandbox's agent: %v: %w", err, errdefs.ErrUnavailable)
	}
	if resp.StatusCode/100 != 2 {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		resp.Body.Close()
		done()
		return nil, agentError(resp.StatusCode, p, b)
	}
	resp.Body = &closeAll{ReadCloser: resp.Body, done: done}
	return resp, nil
}

type closeAll struct {
	io.ReadCloser
	done func()
}

func (c *closeAll) Close() error {
	err := c.ReadCloser.Close()
	c.done()
	return err
}

// agentError maps an agent's HTTP status to an error kind.
func agentError(code int, p string, body []byte) error {
	msg := strings.TrimSpace(string(body))
	kind := errdefs.ErrUnavailable
	switch code {
	case http.StatusNotFound:
		kind = errdefs.ErrNotFound
	case http.StatusBadRequest:
		kind = errdefs.ErrInvalidArgument
	case http.StatusUnauthorized, http.StatusForbidden:
		kind = errdefs.ErrPermissionDenied
	case http.StatusRequestEntityTooLarge, http.StatusInsufficientStorage:
		kind = errdefs.ErrResourceExhausted
	}
	return fmt.Errorf("%s: the agent answered %d %s: %w", p, code, msg, kind)
}

// fromConnect maps an envd RPC error to an error kind.
func fromConnect(err error) error {
	kind := errdefs.ErrUnavailable
	switch connect.CodeOf(err) {
	case connect.CodeNotFound:
		kind = errdefs.ErrNotFound
	case connect.CodeInvalidArgument:
		kind = errdefs.ErrInvalidArgument
	case connect.CodePermissionDenied, connect.CodeUnauthenticated:
		kind = errdefs.ErrPermissionDenied
	case connect.CodeFailedPrecondition:
		kind = errdefs.ErrFailedPrecondition
	}
	return fmt.Errorf("%v: %w", err, kind)
}
