package sandbox

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"time"

	"connectrpc.com/connect"

	"github.com/cubesandbox/cube/api/envd/filesystem"
	"github.com/cubesandbox/cube/api/envd/filesystem/filesystemconnect"
)

// Files reads, writes, lists and watches the sandbox's files. Paths are
// absolute, or relative to the user's home directory.
type Files struct {
	s   *Sandbox
	rpc filesystemconnect.FilesystemClient
}

// FileType is an entry's type.
type FileType string

// Entry types.
const (
	TypeFile    FileType = "file"
	TypeDir     FileType = "dir"
	TypeSymlink FileType = "symlink"
)

// EntryInfo describes a file or directory.
type EntryInfo struct {
	Name          string
	Path          string
	Type          FileType
	Size          int64
	Mode          os.FileMode
	Permissions   string
	Owner, Group  string
	ModifiedTime  time.Time
	SymlinkTarget string
	Metadata      map[string]string
}

func entryInfo(e *filesystem.EntryInfo) EntryInfo {
	if e == nil {
		return EntryInfo{}
	}
	return EntryInfo{
		Name: e.GetName(), Path: e.GetPath(), Type: fileType(e.GetType()), Size: e.GetSize(),
		Mode: os.FileMode(e.GetMode()), Permissions: e.GetPermissions(), Owner: e.GetOwner(), Group: e.GetGroup(),
		ModifiedTime: e.GetModifiedTime().AsTime(), SymlinkTarget: e.GetSymlinkTarget(), Metadata: e.GetMetadata(),
	}
}

func fileType(t filesystem.FileType) FileType {
	switch t {
	case filesystem.FileType_FILE_TYPE_FILE:
		return TypeFile
	case filesystem.FileType_FILE_TYPE_DIRECTORY:
		return TypeDir
	case filesystem.FileType_FILE_TYPE_SYMLINK:
		return TypeSymlink
	}
	return ""
}

// FileOptions name the Linux user a file call acts as; a nil *FileOptions
// is the sandbox's default user.
type FileOptions struct {
	User string
}

func (o *FileOptions) user() string {
	if o == nil {
		return ""
	}
	return o.User
}

// filesURL is the agent's /files URL for path as user.
func (f *Files) filesURL(path, user string) string {
	q := url.Values{"path": {path}}
	if user != "" {
		q.Set("username", user)
	}
	return f.s.envd + "/files?" + q.Encode()
}

// filesError turns a refusal of /files into an *APIError.
func filesError(op string, resp *http.Response) error {
	data, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	return fmt.Errorf("%s: %w", op, apiError(resp, data))
}

// Read returns the file's content.
func (f *Files) Read(ctx context.Context, path string, opts *FileOptions) ([]byte, error) {
	r, err := f.ReadStream(ctx, path, opts)
	if err != nil {
		return nil, err
	}
	defer r.Close()
	data, err := io.ReadAll(r)
	if err != nil {
		return nil, classify("read "+path, err)
	}
	return data, nil
}

// ReadStream returns the file's content as a stream; close it. ctx bounds
// the whole read.
func (f *Files) ReadStream(ctx context.Context, path string, opts *FileOptions) (io.ReadCloser, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, f.filesURL(path, opts.user()), nil)
	if err != nil {
		return nil, err
	}
	resp, err := f.s.http.Do(req)
	if err != nil {
		return nil, classify("read "+path, err)
	}
	if resp.StatusCode != http.StatusOK {
		defer resp.Body.Close()
		return nil, filesError("read "+path, resp)
	}
	return resp.Body, nil
}

// WriteInfo is a written file.
type WriteInfo struct {
	Name string   `json:"name"`
	Type FileType `json:"type"`
	Path string   `json:"path"`
}

// Write writes data to path, creating missing parent directories and
// replacing what was there.
func (f *Files) Write(ctx context.Context, path string, data []byte, opts *FileOptions) (*WriteInfo, error) {
	return f.WriteStream(ctx, path, bytes.NewReader(data), opts)
}

// WriteStream writes what r yields to path (see Write).
func (f *Files) WriteStream(ctx context.Context, path string, r io.Reader, opts *FileOptions) (*WriteInfo, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, f.filesURL(path, opts.user()), r)
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/octet-stream")
	resp, err := f.s.http.Do(req)
	if err != nil {
		return nil, classify("write "+path, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, filesError("write "+path, resp)
	}
	var out []WriteInfo
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil || len(out) == 0 {
		return nil, fmt.Errorf("write %s: the agent's answer: %v", path, err)
	}
	return &out[0], nil
}

// List lists the directory's entries, depth levels down (0 means 1).
func (f *Files) List(ctx context.Context, path string, depth uint32, opts *FileOptions) ([]EntryInfo, error) {
	ctx, cancel := f.s.client.unaryContext(ctx)
	defer cancel()
	resp, err := f.rpc.ListDir(ctx, request(&filesystem.ListDirRequest{Path: path, Depth: depth}, opts.user()))
	if err != nil {
		return nil, classify("list "+path, err)
	}
	out := make([]EntryInfo, 0, len(resp.Msg.GetEntries()))
	for _, e := range resp.Msg.GetEntries() {
		out = append(out, entryInfo(e))
	}
	return out, nil
}

// GetInfo describes the file or directory at path.
func (f *Files) GetInfo(ctx context.Context, path string, opts *FileOptions) (*EntryInfo, error) {
	ctx, cancel := f.s.client.unaryContext(ctx)
	defer cancel()
	resp, err := f.rpc.Stat(ctx, request(&filesystem.StatRequest{Path: path}, opts.user()))
	if err != nil {
		return nil, classify("stat "+path, err)
	}
	e := entryInfo(resp.Msg.GetEntry())
	return &e, nil
}

// Exists reports whether path exists.
func (f *Files) Exists(ctx context.Context, path string, opts *FileOptions) (bool, error) {
	_, err := f.GetInfo(ctx, path, opts)
	if errors.Is(err, ErrNotFound) {
		return false, nil
	}
	return err == nil, err
}

// MakeDir creates the directory and its missing parents; it reports false
// when the directory already existed.
func (f *Files) MakeDir(ctx context.Context, path string, opts *FileOptions) (bool, error) {
	ctx, cancel := f.s.client.unaryContext(ctx)
	defer cancel()
	_, err := f.rpc.MakeDir(ctx, request(&filesystem.MakeDirRequest{Path: path}, opts.user()))
	if connect.CodeOf(err) == connect.CodeAlreadyExists {
		return false, nil
	}
	if err != nil {
		return false, classify("make directory "+path, err)
	}
	return true, nil
}

// Rename moves oldPath to newPath, creating newPath's parents.
func (f *Files) Rename(ctx context.Context, oldPath, newPath string, opts *FileOptions) (*EntryInfo, error) {
	ctx, cancel := f.s.client.unaryContext(ctx)
	defer cancel()
	resp, err := f.rpc.Move(ctx, request(&filesystem.MoveRequest{Source: oldPath, Destination: newPath}, opts.user()))
	if err != nil {
		return nil, classify("rename "+oldPath, err)
	}
	e := entryInfo(resp.Msg.GetEntry())
	return &e, nil
}

// Remove removes the file or directory (recursively). Removing what is
// already gone succeeds.
func (f *Files) Remove(ctx context.Context, path string, opts *FileOptions) error {
	ctx, cancel := f.s.client.unaryContext(ctx)
	defer cancel()
	_, err := f.rpc.Remove(ctx, request(&filesystem.RemoveRequest{Path: path}, opts.user()))
	return classify("remove "+path, err)
}

// EventType is what happened to a watched entry.
type EventType string

// Watch event types.
const (
	EventCreate EventType = "create"
	EventWrite  EventType = "write"
	EventRemove EventType = "remove"
	EventRename EventType = "rename"
	EventChmod  EventType = "chmod"
)

// FilesystemEvent is one change in a watched directory. Name is relative
// to it.
type FilesystemEvent struct {
	Name string
	Type EventType
	// Entry describes the entry after the change (WatchOptions.IncludeEntry;
	// nil for removals).
	Entry *EntryInfo
}

var eventTypes = map[filesystem.EventType]EventType{
	filesystem.EventType_EVENT_TYPE_CREATE: EventCreate, filesystem.EventType_EVENT_TYPE_WRITE: EventWrite,
	filesystem.EventType_EVENT_TYPE_REMOVE: EventRemove, filesystem.EventType_EVENT_TYPE_RENAME: EventRename,
	filesystem.EventType_EVENT_TYPE_CHMOD: EventChmod,
}

// WatchOptions configure WatchDir.
type WatchOptions struct {
	User string
	// Recursive watches subdirectories too.
	Recursive bool
	// IncludeEntry adds the entry's description to each event.
	IncludeEntry bool
	// Timeout ends the watch; default none.
	Timeout time.Duration
	// OnExit is called once when the watch ends, with the reason (nil
	// after Stop).
	OnExit func(err error)
}

// WatchHandle is a running watch.
type WatchHandle struct {
	cancel context.CancelFunc
	done   chan struct{}
	err    error
}

// Stop ends the watch and waits for its callback to return.
func (w *WatchHandle) Stop() {
	w.cancel()
	<-w.done
}

// Done is closed when the watch has ended.
func (w *WatchHandle) Done() <-chan struct{} { return w.done }

// Err is why the watch ended (after Done; nil after Stop).
func (w *WatchHandle) Err() error {
	<-w.done
	return w.err
}

// WatchDir watches the directory and calls onEvent for each change, from
// one goroutine, until Stop, the options' Timeout or an error. It returns
// once the watch is in place: every change after it is reported.
func (f *Files) WatchDir(ctx context.Context, path string, onEvent func(FilesystemEvent), opts *WatchOptions) (*WatchHandle, error) {
	var o WatchOptions
	if opts != nil {
		o = *opts
	}
	streamCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	if o.Timeout > 0 {
		cancel()
		streamCtx, cancel = context.WithTimeout(context.WithoutCancel(ctx), o.Timeout)
	}
	stop := context.AfterFunc(ctx, cancel)
	defer stop()
	r := request(&filesystem.WatchDirRequest{Path: path, Recursive: o.Recursive, IncludeEntry: o.IncludeEntry}, o.User)
	keepalive(r.Header())
	stream, err := f.rpc.WatchDir(streamCtx, r)
	if err != nil {
		cancel()
		return nil, classify("watch "+path, err)
	}
	// The start event says the watch is in place.
	for {
		if !stream.Receive() {
			err := stream.Err()
			if err == nil {
				err = errors.New("the agent closed the watch before it started")
			}
			cancel()
			_ = stream.Close()
			if ctx.Err() != nil {
				err = ctx.Err()
			}
			return nil, classify("watch "+path, err)
		}
		if stream.Msg().GetStart() != nil {
			break
		}
	}
	w := &WatchHandle{cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(w.done)
		defer cancel()
		defer func() { _ = stream.Close() }()
		for stream.Receive() {
			ev := stream.Msg().GetFilesystem()
			if ev == nil {
				continue
			}
			out := FilesystemEvent{Name: ev.GetName(), Type: eventTypes[ev.GetType()]}
			if ev.Entry != nil {
				e := entryInfo(ev.GetEntry())
				out.Entry = &e
			}
			onEvent(out)
		}
		if err := stream.Err(); err != nil && streamCtx.Err() != context.Canceled {
			w.err = classify("watch "+path, err)
		}
		if o.OnExit != nil {
			o.OnExit(w.err)
		}
	}()
	return w, nil
}
