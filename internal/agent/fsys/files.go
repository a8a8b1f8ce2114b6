package fsys

import (
	"compress/gzip"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"mime"
	"mime/multipart"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/cubesandbox/cube/internal/agent/identity"
	"github.com/cubesandbox/cube/internal/agent/rpcerr"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/failpoint"
)

// Metadata limits, as envd documents them: a key fits the 255-byte xattr
// name after the prefix, and all of a file's metadata fits one inode's
// xattr budget.
const (
	maxMetaKey   = 255 - len(xattrPrefix)
	maxMetaTotal = 4096
	metaHeader   = "X-Metadata-"
)

// FailpointWrite fails an upload after its file (and parent directories)
// were created, before any byte is written: tests prove the undo.
const FailpointWrite = "agent/files.write"

// uploadEntry is one element of POST /files' answer.
type uploadEntry struct {
	Path     string            `json:"path"`
	Name     string            `json:"name"`
	Type     string            `json:"type"`
	Metadata map[string]string `json:"metadata,omitempty"`
}

// Download serves GET /files?path=...: the file's bytes, gzip-encoded when
// the client prefers it, with Range support otherwise.
func (s *Service) Download(w http.ResponseWriter, r *http.Request) {
	u, path, err := s.resolve(r.Context(), r.URL.Query().Get("path"))
	if err != nil {
		rpcerr.WriteHTTP(w, err)
		return
	}
	gz, err := acceptGzip(r.Header.Get("Accept-Encoding"))
	if err != nil {
		rpcerr.WriteHTTPStatus(w, http.StatusNotAcceptable, err.Error())
		return
	}
	var f *os.File
	err = identity.AsUser(u, func() (err error) {
		f, err = os.Open(path)
		return rpcerr.FromOS(err)
	})
	if err != nil {
		if errdefs.IsNotFound(err) {
			rpcerr.WriteHTTPStatus(w, http.StatusNotFound, fmt.Sprintf("path '%s' does not exist", path))
			return
		}
		rpcerr.WriteHTTP(w, fmt.Errorf("open %s: %w", path, err))
		return
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		rpcerr.WriteHTTP(w, err)
		return
	}
	if fi.IsDir() {
		rpcerr.WriteHTTPStatus(w, http.StatusBadRequest, fmt.Sprintf("path '%s' is a directory", path))
		return
	}
	h := w.Header()
	h.Set("Content-Type", "application/octet-stream")
	h.Set("Content-Disposition", mime.FormatMediaType("attachment", map[string]string{"filename": filepath.Base(path)}))
	h.Set("Cache-Control", "no-store")
	h.Add("Vary", "Accept-Encoding")
	if !gz {
		http.ServeContent(w, r, "", fi.ModTime(), f)
		return
	}
	h.Set("Content-Encoding", "gzip")
	w.WriteHeader(http.StatusOK)
	if r.Method == http.MethodHead {
		return
	}
	zw, _ := gzip.NewWriterLevel(w, gzip.BestSpeed)
	if _, err := io.Copy(zw, f); err != nil {
		s.log.Warn("download interrupted", "path", path, "error", err)
		return
	}
	_ = zw.Close()
}

// acceptGzip decides the response encoding from Accept-Encoding, as envd:
// gzip when listed (and not outranked by identity), identity otherwise,
// and an error when the client rejects both.
func acceptGzip(header string) (bool, error) {
	if header == "" {
		return false, nil
	}
	q := map[string]float64{}
	for part := range strings.SplitSeq(header, ",") {
		name, params, _ := strings.Cut(strings.TrimSpace(part), ";")
		val := 1.0
		for p := range strings.SplitSeq(params, ";") {
			if v, ok := strings.CutPrefix(strings.TrimSpace(strings.ToLower(p)), "q="); ok {
				if f, err := strconv.ParseFloat(v, 64); err == nil {
					val = f
				}
			}
		}
		q[strings.ToLower(strings.TrimSpace(name))] = val
	}
	gzipQ, hasGzip := q["gzip"]
	if !hasGzip {
		gzipQ, hasGzip = q["*"]
	}
	identityQ, hasIdentity := q["identity"]
	if !hasIdentity {
		identityQ = 1 // implicitly acceptable (RFC 9110 12.5.3)
		if star, ok := q["*"]; ok && star == 0 {
			identityQ = 0
		}
	}
	switch {
	case hasGzip && gzipQ > 0 && (gzipQ >= identityQ || !hasIdentity):
		return true, nil
	case identityQ > 0:
		return false, nil
	}
	return false, errors.New("no acceptable encoding found, supported: [identity, gzip]")
}

// Upload serves POST /files: an application/octet-stream body written to
// ?path=, or multipart/form-data "file" parts written to ?path= (one file)
// or to each part's filename. Missing parent directories are created;
// existing files are overwritten in place (watchers see a write).
func (s *Service) Upload(w http.ResponseWriter, r *http.Request) {
	defer r.Body.Close()
	u, _, err := s.resolve(r.Context(), "")
	if err != nil {
		rpcerr.WriteHTTP(w, err)
		return
	}
	meta, err := uploadMetadata(r.Header)
	if err != nil {
		rpcerr.WriteHTTP(w, err)
		return
	}
	body := io.Reader(r.Body)
	switch enc := strings.ToLower(strings.TrimSpace(r.Header.Get("Content-Encoding"))); enc {
	case "", "identity":
	case "gzip":
		zr, err := gzip.NewReader(r.Body)
		if err != nil {
			rpcerr.WriteHTTPStatus(w, http.StatusBadRequest, "error decompressing request body: "+err.Error())
			return
		}
		defer zr.Close()
		body = zr
	default:
		rpcerr.WriteHTTPStatus(w, http.StatusBadRequest, fmt.Sprintf("unsupported Content-Encoding: %s, supported: [gzip]", enc))
		return
	}
	query := r.URL.Query()
	mediaType, params, _ := mime.ParseMediaType(r.Header.Get("Content-Type"))
	var out []uploadEntry
	switch {
	case mediaType == "application/octet-stream":
		if !query.Has("path") {
			rpcerr.WriteHTTPStatus(w, http.StatusBadRequest, "path query parameter is required for raw body upload")
			return
		}
		e, err := s.writeFile(u, query.Get("path"), body, meta)
		if err != nil {
			rpcerr.WriteHTTP(w, err)
			return
		}
		out = append(out, e)
	case strings.HasPrefix(mediaType, "multipart/"):
		out, err = s.writeParts(u, query, body, params["boundary"], meta)
		if err != nil {
			rpcerr.WriteHTTP(w, err)
			return
		}
	default:
		rpcerr.WriteHTTPStatus(w, http.StatusBadRequest, fmt.Sprintf("unsupported content type %q, expected multipart/form-data or application/octet-stream", r.Header.Get("Content-Type")))
		return
	}
	if len(out) == 0 {
		rpcerr.WriteHTTPStatus(w, http.StatusBadRequest, `no "file" part in the upload`)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	_ = json.NewEncoder(w).Encode(out)
}

func (s *Service) writeParts(u *identity.User, query url.Values, body io.Reader, boundary string, meta map[string]string) ([]uploadEntry, error) {
	if boundary == "" {
		return nil, fmt.Errorf("multipart upload without a boundary: %w", errdefs.ErrInvalidArgument)
	}
	mr := multipart.NewReader(body, boundary)
	var out []uploadEntry
	for {
		part, err := mr.NextPart()
		if errors.Is(err, io.EOF) {
			return out, nil
		}
		if err != nil {
			return out, fmt.Errorf("malformed multipart body: %v: %w", err, errdefs.ErrInvalidArgument)
		}
		if part.FormName() != "file" {
			part.Close()
			continue
		}
		target := query.Get("path")
		if !query.Has("path") {
			// The raw filename: mime/multipart's FileName() strips
			// directories, and the SDKs send whole paths here.
			_, p, _ := mime.ParseMediaType(part.Header.Get("Content-Disposition"))
			target = p["filename"]
		}
		if target == "" {
			part.Close()
			return out, fmt.Errorf("file part without a path or filename: %w", errdefs.ErrInvalidArgument)
		}
		resolved, err := u.Resolve(target, s.defaults.Workdir())
		if err != nil {
			part.Close()
			return out, err
		}
		if slices.ContainsFunc(out, func(e uploadEntry) bool { return e.Path == resolved }) {
			part.Close()
			return out, fmt.Errorf("you cannot upload multiple files to the same path '%s' in one upload request: %w", resolved, errdefs.ErrInvalidArgument)
		}
		e, err := s.writeFile(u, target, part, meta)
		part.Close()
		if err != nil {
			return out, err
		}
		out = append(out, e)
	}
}

// writeFile writes src to the user's path with the user's credentials.
// On failure nothing new is left behind: a file it created is removed,
// with the directories it created for it.
func (s *Service) writeFile(u *identity.User, target string, src io.Reader, meta map[string]string) (uploadEntry, error) {
	path, err := u.Resolve(target, s.defaults.Workdir())
	if err != nil {
		return uploadEntry{}, err
	}
	err = identity.AsUser(u, func() error {
		fi, statErr := os.Stat(path)
		if statErr == nil && fi.IsDir() {
			return fmt.Errorf("path '%s' is a directory: %w", path, errdefs.ErrInvalidArgument)
		}
		created, err := ensureDirs(filepath.Dir(path))
		if err != nil {
			return err
		}
		undo := func() {
			if errors.Is(statErr, fs.ErrNotExist) { // ours: we created it
				_ = os.Remove(path)
			}
			if created != "" {
				_ = os.RemoveAll(created)
			}
		}
		f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o666)
		if err != nil {
			undo()
			return rpcerr.FromOS(err)
		}
		err = failpoint.Eval(context.Background(), FailpointWrite)
		if err == nil {
			_, err = io.Copy(f, src)
		}
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err == nil {
			err = writeMetadata(path, meta)
		}
		if err != nil {
			undo()
			return fmt.Errorf("write %s: %w", path, rpcerr.FromOS(err))
		}
		return nil
	})
	if err != nil {
		return uploadEntry{}, err
	}
	return uploadEntry{Path: path, Name: filepath.Base(path), Type: "file", Metadata: meta}, nil
}

// ensureDirs creates dir and its missing parents and returns the topmost
// directory it created ("" when dir existed), for undo.
func ensureDirs(dir string) (string, error) {
	top := ""
	for d := dir; ; d = filepath.Dir(d) {
		if _, err := os.Lstat(d); err == nil {
			break
		}
		top = d
		if d == filepath.Dir(d) {
			break
		}
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		if top != "" {
			_ = os.RemoveAll(top)
		}
		return "", fmt.Errorf("create parent directories of the upload: %w", rpcerr.FromOS(err))
	}
	return top, nil
}

// uploadMetadata collects X-Metadata-<key> headers: keys lower-cased,
// the first value wins, limits as envd documents them. No header at all
// means "clear the metadata" (an empty, non-nil map).
func uploadMetadata(h http.Header) (map[string]string, error) {
	meta := map[string]string{}
	total := 0
	for name, vals := range h {
		key, ok := strings.CutPrefix(http.CanonicalHeaderKey(name), metaHeader)
		if !ok || len(vals) == 0 {
			continue
		}
		key = strings.ToLower(key)
		val := vals[0]
		if key == "" || len(key) > maxMetaKey || !printable(key) || !printable(val) {
			return nil, fmt.Errorf("metadata header %q: keys (1-%d bytes) and values must be printable US-ASCII: %w", name, maxMetaKey, errdefs.ErrInvalidArgument)
		}
		meta[key] = val
		total += len(xattrPrefix) + len(key) + len(val)
	}
	if total > maxMetaTotal {
		return nil, fmt.Errorf("metadata is %d bytes, over the %d-byte limit: %w", total, maxMetaTotal, errdefs.ErrInvalidArgument)
	}
	return meta, nil
}

func printable(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < 0x20 || s[i] > 0x7e {
			return false
		}
	}
	return true
}
