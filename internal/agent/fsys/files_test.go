package fsys

import (
	"net/http"
	"strings"
	"testing"

	"github.com/cubesandbox/cube/internal/errdefs"
)

func TestAcceptGzip(t *testing.T) {
	cases := []struct {
		header  string
		gzip    bool
		invalid bool
	}{
		{"", false, false},
		{"gzip", true, false},
		{"gzip, deflate, br", true, false}, // undici's default: envd gzips
		{"identity", false, false},
		{"gzip;q=0.5, identity", false, false},
		{"gzip;q=0, identity", false, false},
		{"br", false, false},
		{"*", true, false},
		{"br, identity;q=0", false, true},
		{"*;q=0", false, true},
		{"GZIP;Q=1", true, false},
	}
	for _, c := range cases {
		gz, err := acceptGzip(c.header)
		if gz != c.gzip || (err != nil) != c.invalid {
			t.Errorf("acceptGzip(%q) = %v, %v; want %v, invalid=%v", c.header, gz, err, c.gzip, c.invalid)
		}
	}
}

func TestUploadMetadata(t *testing.T) {
	h := http.Header{}
	h.Set("X-Metadata-Owner", "alice")
	h.Add("X-Metadata-Owner", "ignored second value")
	h.Set("X-Metadata-Build-Id", "42")
	h.Set("Content-Type", "application/octet-stream")
	m, err := uploadMetadata(h)
	if err != nil || len(m) != 2 || m["owner"] != "alice" || m["build-id"] != "42" {
		t.Fatalf("metadata %v, %v", m, err)
	}
	if m, err := uploadMetadata(http.Header{}); err != nil || m == nil || len(m) != 0 {
		t.Fatalf("no headers must mean empty metadata (clear): %v %v", m, err)
	}
	for name, h := range map[string]http.Header{
		"non-ASCII value": {"X-Metadata-A": {"caf\u00e9"}},
		"control char":    {"X-Metadata-A": {"a\tb"}},
		"key too long":    {"X-Metadata-" + strings.Repeat("k", 247): {"v"}},
		"too much":        {"X-Metadata-A": {strings.Repeat("v", 3000)}, "X-Metadata-B": {strings.Repeat("v", 3000)}},
	} {
		if _, err := uploadMetadata(h); !errdefs.IsInvalidArgument(err) {
			t.Errorf("%s: %v, want InvalidArgument", name, err)
		}
	}
}
