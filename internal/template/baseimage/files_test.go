package baseimage

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// The extra files are an input of the cache: any change of name, mode or
// content changes the digest; base's inputs (no files, labels or name)
// marshal as they did before these fields existed, so its cache stays.
func TestFilesInputs(t *testing.T) {
	a := map[string]File{"usr/lib/x/server.py": {Mode: 0o644, Data: []byte("print(1)")}}
	same := map[string]File{"usr/lib/x/server.py": {Mode: 0o644, Data: []byte("print(1)")}}
	if filesDigest(a) != filesDigest(same) {
		t.Fatal("equal files, different digests")
	}
	for name, b := range map[string]map[string]File{
		"content": {"usr/lib/x/server.py": {Mode: 0o644, Data: []byte("print(2)")}},
		"mode":    {"usr/lib/x/server.py": {Mode: 0o755, Data: []byte("print(1)")}},
		"name":    {"usr/lib/y/server.py": {Mode: 0o644, Data: []byte("print(1)")}},
	} {
		if filesDigest(a) == filesDigest(b) {
			t.Errorf("a change of %s kept the digest", name)
		}
	}
	b, _ := json.Marshal(Inputs{Recipe: "1", Suite: "bookworm"})
	for _, k := range []string{"name", "install", "run", "files_sha256", "labels"} {
		if strings.Contains(string(b), `"`+k+`"`) {
			t.Errorf("base's inputs carry %q: %s", k, b)
		}
	}
	ci := CodeInterpreter(Options{})
	if ci.Labels["dev.cube.start-cmd"] == "" || ci.Labels["dev.cube.ready-cmd"] == "" || len(ci.Files) != 1 {
		t.Errorf("code interpreter options: %+v", ci)
	}
}

func TestWriteFiles(t *testing.T) {
	root := t.TempDir()
	if err := writeFiles(root, map[string]File{"usr/local/lib/cube/s.py": {Mode: 0o755, Data: []byte("x")}, "/etc/../etc/f": {Mode: 0o600, Data: []byte("y")}}); err != nil {
		t.Fatal(err)
	}
	for p, mode := range map[string]os.FileMode{"usr/local/lib/cube/s.py": 0o755, "etc/f": 0o600} {
		st, err := os.Stat(filepath.Join(root, p))
		if err != nil {
			t.Fatal(err)
		}
		if st.Mode().Perm() != mode {
			t.Errorf("%s: mode %v, want %v", p, st.Mode().Perm(), mode)
		}
	}
}
