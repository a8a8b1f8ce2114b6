package agenttest

import (
	"bytes"
	"compress/gzip"
	"crypto/rand"
	"crypto/sha256"
	"encoding/json"
	"io"
	"mime/multipart"
	"net/http"
	"strings"
	"testing"

	"connectrpc.com/connect"

	fspb "github.com/cubesandbox/cube/api/envd/filesystem"
)

func (h *harness) testFiles(t *testing.T) {
	t.Run("Multipart", h.testMultipart)
	t.Run("OctetStreamGzipRange", h.testOctetGzip)
	t.Run("LargeBinary", h.testLargeBinary)
	t.Run("Metadata", h.testMetadata)
	t.Run("Errors", h.testFilesErrors)
	if h.tg.Sandbox {
		t.Run("HugeUploadFillsDisk", h.testHugeUpload)
	}
}

type uploaded struct {
	Path     string            `json:"path"`
	Name     string            `json:"name"`
	Type     string            `json:"type"`
	Metadata map[string]string `json:"metadata"`
}

// multipartBody builds a form with one "file" part per name->content.
func multipartBody(t *testing.T, files [][2]string) (io.Reader, string) {
	t.Helper()
	var buf bytes.Buffer
	mw := multipart.NewWriter(&buf)
	for _, f := range files {
		// Hand-written header: CreateFormFile would escape nothing but
		// the SDKs put whole paths in filename, which we must keep.
		hdr := make(map[string][]string)
		hdr["Content-Disposition"] = []string{`form-data; name="file"; filename="` + f[0] + `"`}
		hdr["Content-Type"] = []string{"application/octet-stream"}
		w, err := mw.CreatePart(hdr)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = w.Write([]byte(f[1]))
	}
	_ = mw.Close()
	return &buf, mw.FormDataContentType()
}

func (h *harness) testMultipart(t *testing.T) {
	ctx := ctxT(t)
	dir := h.scratch(t)
	body, ctype := multipartBody(t, [][2]string{{"ignored-name.txt", "first version"}})
	code, b, _ := h.do(t, h.h1, "POST", "/files?username=user&path="+urlQuery(dir+"/deep/er/file.txt"), body, map[string]string{"Content-Type": ctype})
	var res []uploaded
	if code != http.StatusOK || json.Unmarshal(b, &res) != nil || len(res) != 1 ||
		res[0].Path != dir+"/deep/er/file.txt" || res[0].Name != "file.txt" || res[0].Type != "file" {
		t.Fatalf("upload: %d %s", code, b)
	}
	for _, p := range []string{dir + "/deep", dir + "/deep/er", dir + "/deep/er/file.txt"} {
		st, err := h.fs.Stat(ctx, as(h, "root", &fspb.StatRequest{Path: p}))
		if err != nil || st.Msg.GetEntry().GetOwner() != "user" {
			t.Errorf("%s: owner %q (%v), want user", p, st.Msg.GetEntry().GetOwner(), err)
		}
	}
	// Overwrite with shorter content: no leftover bytes.
	body, ctype = multipartBody(t, [][2]string{{"x", "v2"}})
	if code, b, _ := h.do(t, h.h1, "POST", "/files?path="+urlQuery(dir+"/deep/er/file.txt"), body, map[string]string{"Content-Type": ctype}); code != http.StatusOK {
		t.Fatalf("overwrite: %d %s", code, b)
	}
	if got := string(h.download(t, "", dir+"/deep/er/file.txt")); got != "v2" {
		t.Errorf("after overwrite: %q", got)
	}
	// Several files, paths from their filenames (writeFiles in the SDK).
	body, ctype = multipartBody(t, [][2]string{{dir + "/m/one.txt", "1"}, {dir + "/m/two.txt", "22"}})
	code, b, _ = h.do(t, h.h1, "POST", "/files", body, map[string]string{"Content-Type": ctype})
	if code != http.StatusOK || json.Unmarshal(b, &res) != nil || len(res) != 2 || res[1].Path != dir+"/m/two.txt" {
		t.Fatalf("multi upload: %d %s", code, b)
	}
	if string(h.download(t, "", dir+"/m/two.txt")) != "22" {
		t.Errorf("second part content wrong")
	}
	body, ctype = multipartBody(t, [][2]string{{dir + "/dup", "a"}, {dir + "/dup", "b"}})
	if code, b, _ := h.do(t, h.h1, "POST", "/files", body, map[string]string{"Content-Type": ctype}); code != http.StatusBadRequest {
		t.Errorf("duplicate paths in one upload: %d %s", code, b)
	}
}

func (h *harness) testOctetGzip(t *testing.T) {
	dir := h.scratch(t)
	content := strings.Repeat("compressible line\n", 4096)
	var gz bytes.Buffer
	zw := gzip.NewWriter(&gz)
	_, _ = zw.Write([]byte(content))
	_ = zw.Close()
	code, b, _ := h.do(t, h.h1, "POST", "/files?path="+urlQuery(dir+"/z.txt"), &gz,
		map[string]string{"Content-Type": "application/octet-stream", "Content-Encoding": "gzip"})
	if code != http.StatusOK {
		t.Fatalf("gzip upload: %d %s", code, b)
	}
	// Go's transport would decompress silently; ask by hand to see it.
	req, _ := http.NewRequestWithContext(ctxT(t), "GET", h.tg.URL+"/files?path="+urlQuery(dir+"/z.txt"), nil)
	req.Header.Set("Accept-Encoding", "gzip")
	if h.token != "" {
		req.Header.Set("X-Access-Token", h.token)
	}
	resp, err := h.h1.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	raw, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.Header.Get("Content-Encoding") != "gzip" || len(raw) >= len(content) {
		t.Fatalf("download not gzip: %q, %d bytes", resp.Header.Get("Content-Encoding"), len(raw))
	}
	zr, err := gzip.NewReader(bytes.NewReader(raw))
	if err != nil {
		t.Fatal(err)
	}
	plain, _ := io.ReadAll(zr)
	if string(plain) != content {
		t.Errorf("gzip round trip differs")
	}
	// Identity with a byte range.
	code, b, hdr := h.do(t, h.h1, "GET", "/files?path="+urlQuery(dir+"/z.txt"), nil, map[string]string{"Range": "bytes=0-10", "Accept-Encoding": "identity"})
	if code != http.StatusPartialContent || string(b) != content[:11] || hdr.Get("Content-Encoding") != "" {
		t.Errorf("range: %d %q", code, b)
	}
	if code, b, _ := h.do(t, h.h1, "GET", "/files?path="+urlQuery(dir+"/z.txt"), nil, map[string]string{"Accept-Encoding": "br;q=1, identity;q=0"}); code != http.StatusNotAcceptable {
		t.Errorf("no acceptable encoding: %d %s", code, b)
	}
}

func (h *harness) testLargeBinary(t *testing.T) {
	dir := h.scratch(t)
	data := make([]byte, 8<<20)
	_, _ = rand.Read(data)
	h.upload(t, "user", dir+"/big.bin", data)
	got := h.download(t, "user", dir+"/big.bin")
	if sha256.Sum256(got) != sha256.Sum256(data) {
		t.Fatalf("8 MiB round trip differs (%d bytes back)", len(got))
	}
}

func (h *harness) testMetadata(t *testing.T) {
	ctx := ctxT(t)
	dir := h.scratch(t)
	code, b, _ := h.do(t, h.h1, "POST", "/files?path="+urlQuery(dir+"/m.txt"), strings.NewReader("x"),
		map[string]string{"Content-Type": "application/octet-stream", "X-Metadata-Owner": "alice", "X-Metadata-Stage": "raw data"})
	var res []uploaded
	if code != http.StatusOK || json.Unmarshal(b, &res) != nil || res[0].Metadata["owner"] != "alice" {
		t.Fatalf("upload with metadata: %d %s", code, b)
	}
	st, err := h.fs.Stat(ctx, as(h, "user", &fspb.StatRequest{Path: dir + "/m.txt"}))
	if md := st.Msg.GetEntry().GetMetadata(); err != nil || md["owner"] != "alice" || md["stage"] != "raw data" || len(md) != 2 {
		t.Errorf("stat metadata: %v %v", md, err)
	}
	// A new upload replaces the metadata as a whole.
	h.upload(t, "user", dir+"/m.txt", []byte("y"))
	st, err = h.fs.Stat(ctx, as(h, "user", &fspb.StatRequest{Path: dir + "/m.txt"}))
	if md := st.Msg.GetEntry().GetMetadata(); err != nil || len(md) != 0 {
		t.Errorf("metadata after plain upload: %v %v", md, err)
	}
	code, _, _ = h.do(t, h.h1, "POST", "/files?path="+urlQuery(dir+"/m.txt"), strings.NewReader("x"),
		map[string]string{"Content-Type": "application/octet-stream", "X-Metadata-Big": strings.Repeat("v", 5000)})
	if code != http.StatusBadRequest {
		t.Errorf("oversized metadata: %d", code)
	}
}

func (h *harness) testFilesErrors(t *testing.T) {
	dir := h.scratch(t)
	check := func(what string, code int, b []byte, want int) {
		t.Helper()
		if code != want {
			t.Errorf("%s: %d %s, want %d", what, code, b, want)
			return
		}
		if c, msg := envdError(t, b); c != want || msg == "" {
			t.Errorf("%s: error body %s", what, b)
		}
	}
	octet := map[string]string{"Content-Type": "application/octet-stream"}
	code, b, _ := h.do(t, h.h1, "GET", "/files?path="+urlQuery(dir+"/missing.txt"), nil, nil)
	check("download missing", code, b, http.StatusNotFound)
	code, b, _ = h.do(t, h.h1, "GET", "/files?path="+urlQuery(dir), nil, nil)
	check("download a directory", code, b, http.StatusBadRequest)
	code, b, _ = h.do(t, h.h1, "GET", "/files?username=user&path="+urlQuery(h.tg.RootOnly+"/x"), nil, nil)
	check("user downloads from root-only dir", code, b, http.StatusForbidden)
	code, b, _ = h.do(t, h.h1, "POST", "/files?username=user&path="+urlQuery(h.tg.RootOnly+"/planted.txt"), strings.NewReader("x"), octet)
	check("user uploads into root-only dir", code, b, http.StatusForbidden)
	code, b, _ = h.do(t, h.h1, "POST", "/files?username=user&path="+urlQuery("/etc/passwd"), strings.NewReader("x"), octet)
	check("user overwrites /etc/passwd", code, b, http.StatusForbidden)
	code, b, _ = h.do(t, h.h1, "POST", "/files?username=user&path="+urlQuery(dir), strings.NewReader("x"), octet)
	check("upload onto a directory", code, b, http.StatusBadRequest)
	code, b, _ = h.do(t, h.h1, "POST", "/files", strings.NewReader("x"), octet)
	check("octet-stream without path", code, b, http.StatusBadRequest)
	code, b, _ = h.do(t, h.h1, "POST", "/files?path=x", strings.NewReader("x"), map[string]string{"Content-Type": "text/plain"})
	check("unsupported content type", code, b, http.StatusBadRequest)
	code, b, _ = h.do(t, h.h1, "POST", "/files?path="+urlQuery(dir+"/g"), strings.NewReader("not gzip"), map[string]string{"Content-Type": "application/octet-stream", "Content-Encoding": "gzip"})
	check("bad gzip", code, b, http.StatusBadRequest)
	code, b, _ = h.do(t, h.h1, "POST", "/files?path="+urlQuery(dir+"/g"), strings.NewReader("x"), map[string]string{"Content-Type": "application/octet-stream", "Content-Encoding": "br"})
	check("unsupported encoding", code, b, http.StatusBadRequest)
	code, b, _ = h.do(t, h.h1, "POST", "/files?path=x", strings.NewReader("--b\r\nbroken"), map[string]string{"Content-Type": "multipart/form-data; boundary=b"})
	check("truncated multipart", code, b, http.StatusBadRequest)
	code, b, _ = h.do(t, h.h1, "GET", "/files?username=ghost&path=x", nil, nil)
	check("unknown username", code, b, http.StatusUnauthorized)

	// Nothing was planted, and the agent still serves.
	if _, err := h.fs.Stat(ctxT(t), as(h, "root", &fspb.StatRequest{Path: h.tg.RootOnly + "/planted.txt"})); connect.CodeOf(err) != connect.CodeNotFound {
		t.Errorf("refused upload left a file: %v", err)
	}
	h.healthy(t)
}

// testHugeUpload fills the sandbox's small disk: 507, and no partial file.
func (h *harness) testHugeUpload(t *testing.T) {
	dir := h.scratch(t)
	huge := io.LimitReader(zeroReader{}, 512<<20)
	code, b, _ := h.do(t, h.h1, "POST", "/files?path="+urlQuery(dir+"/sub/huge.bin"), huge, map[string]string{"Content-Type": "application/octet-stream"})
	if code != http.StatusInsufficientStorage {
		t.Fatalf("huge upload: %d %s, want 507", code, b)
	}
	if _, err := h.fs.Stat(ctxT(t), as(h, "root", &fspb.StatRequest{Path: dir + "/sub"})); connect.CodeOf(err) != connect.CodeNotFound {
		t.Errorf("failed upload left its file or directory behind: %v", err)
	}
	h.healthy(t)
	h.upload(t, "user", dir+"/after.txt", []byte("disk usable again"))
}

type zeroReader struct{}

func (zeroReader) Read(p []byte) (int, error) {
	clear(p)
	return len(p), nil
}
