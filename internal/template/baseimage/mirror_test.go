package baseimage

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/cubesandbox/cube/internal/errdefs"
)

func TestFindMirror(t *testing.T) {
	write := func(dir, name, body string) {
		t.Helper()
		if err := os.MkdirAll(filepath.Dir(filepath.Join(dir, name)), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, name), []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	deb822 := `Types: deb
# http://snapshot.debian.org/archive/debian/20250520T000000Z
URIs: http://deb.debian.org/debian/
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://deb.debian.org/debian-security
Suites: bookworm-security
Components: main
`
	for _, tc := range []struct {
		name    string
		files   map[string]string
		suite   string
		want    Mirror
		wantErr bool
	}{
		{"deb822", map[string]string{"sources.list.d/debian.sources": deb822}, "bookworm",
			Mirror{URI: "http://deb.debian.org/debian", Keyring: "/usr/share/keyrings/debian-archive-keyring.gpg"}, false},
		{"deb822 security suite", map[string]string{"sources.list.d/debian.sources": deb822}, "bookworm-security",
			Mirror{URI: "http://deb.debian.org/debian-security"}, false},
		{"one-line with options", map[string]string{"sources.list": "# comment\ndeb-src http://src.example/debian bookworm main\ndeb [arch=amd64 signed-by=/k.gpg] http://mirror.example/debian bookworm main contrib\n"}, "bookworm",
			Mirror{URI: "http://mirror.example/debian", Keyring: "/k.gpg"}, false},
		{"sources.list first", map[string]string{"sources.list": "deb http://first.example/debian bookworm main\n", "sources.list.d/debian.sources": deb822}, "bookworm",
			Mirror{URI: "http://first.example/debian"}, false},
		{"disabled stanza and files skipped", map[string]string{
			"sources.list.d/a.sources":               "Enabled: no\nTypes: deb\nURIs: http://off.example/debian\nSuites: bookworm\n",
			"sources.list.d/b.list.disabled-by-farm": "deb http://off2.example/debian bookworm main\n",
			"sources.list.d/c.list":                  "deb http://on.example/debian bookworm main\n",
		}, "bookworm", Mirror{URI: "http://on.example/debian"}, false},
		{"no such suite", map[string]string{"sources.list.d/debian.sources": deb822}, "trixie", Mirror{}, true},
		{"nothing", nil, "bookworm", Mirror{}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			for n, b := range tc.files {
				write(dir, n, b)
			}
			got, err := FindMirror(dir, tc.suite)
			if tc.wantErr {
				if !errdefs.IsFailedPrecondition(err) {
					t.Fatalf("err = %v, want FailedPrecondition", err)
				}
				return
			}
			if err != nil || got != tc.want {
				t.Fatalf("got %+v, %v; want %+v", got, err, tc.want)
			}
		})
	}
}
