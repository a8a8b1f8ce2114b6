package cubelet

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cubesandbox/cube/internal/cubelet/actions"
	"github.com/cubesandbox/cube/internal/cubelet/config"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/sandbox"
)

// TestCheckHostMounts covers the allow-list rules without a cubelet:
// prefixes, read-only rules, symlink escapes, reserved destinations and
// cubelet's own directories.
func TestCheckHostMounts(t *testing.T) {
	dir := t.TempDir()
	mk := func(p string) string {
		full := filepath.Join(dir, p)
		if err := os.MkdirAll(full, 0o755); err != nil {
			t.Fatal(err)
		}
		return full
	}
	rw, ro, outside := mk("allowed/rw"), mk("allowed/ro"), mk("outside")
	mk("allowed/rw/sub")
	data := mk("cube/data")
	if err := os.WriteFile(filepath.Join(rw, "file"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	// A symlink inside an allowed prefix that points out of it, and a
	// symlinked prefix.
	if err := os.Symlink(outside, filepath.Join(rw, "escape")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(rw, filepath.Join(dir, "rwlink")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("/dev/null", filepath.Join(rw, "dev")); err != nil {
		t.Fatal(err)
	}
	cfg := &config.Config{}
	cfg.Node.DataDir, cfg.Node.RunDir = data, mk("cube/run")
	cfg.Storage.HostMountAllow = []config.HostMountRule{
		{Prefix: filepath.Join(dir, "allowed")},
		{Prefix: ro, ReadOnly: true},
		{Prefix: filepath.Join(dir, "rwlink")},
		{Prefix: filepath.Join(dir, "cube")},
	}
	n := actions.NewNode(cfg)

	ok := []sandbox.HostMount{
		{Source: rw, Destination: "/mnt/rw"},
		{Source: filepath.Join(rw, "file"), Destination: "/etc/data", ReadOnly: true},
		{Source: ro, Destination: "/mnt/ro", ReadOnly: true},
		{Source: filepath.Join(dir, "rwlink", "sub"), Destination: "/mnt/sub"},
	}
	got, err := checkHostMounts(cfg, ok)
	if err != nil {
		t.Fatalf("allowed mounts refused: %v", err)
	}
	if got[3].Source != filepath.Join(rw, "sub") {
		t.Errorf("source not resolved: %q", got[3].Source)
	}
	if _, err := n.HostMountsFor(got); err != nil {
		t.Errorf("re-check at start: %v", err)
	}

	for _, c := range []struct {
		name  string
		m     sandbox.HostMount
		field string
		msg   string
	}{
		{"outside", sandbox.HostMount{Source: outside, Destination: "/x"}, "source", "not under any prefix"},
		{"symlink escape", sandbox.HostMount{Source: filepath.Join(rw, "escape"), Destination: "/x"}, "source", "resolves to"},
		{"device", sandbox.HostMount{Source: filepath.Join(rw, "dev"), Destination: "/x"}, "source", "neither a directory"},
		{"rw under read-only rule", sandbox.HostMount{Source: ro, Destination: "/x"}, "source", "read-only"},
		{"relative", sandbox.HostMount{Source: "allowed/rw", Destination: "/x"}, "source", "absolute"},
		{"missing", sandbox.HostMount{Source: filepath.Join(rw, "nope"), Destination: "/x"}, "source", "does not exist"},
		{"cubelet data dir", sandbox.HostMount{Source: data, Destination: "/x"}, "source", "cubelet's own"},
		{"parent of data dir", sandbox.HostMount{Source: filepath.Join(dir, "cube"), Destination: "/x"}, "source", "cubelet's own"},
		{"root dest", sandbox.HostMount{Source: rw, Destination: "/"}, "destination", "root"},
		{"proc dest", sandbox.HostMount{Source: rw, Destination: "/proc/sys"}, "destination", "/proc"},
		{"unclean dest", sandbox.HostMount{Source: rw, Destination: "/a/../dev"}, "destination", "clean"},
		{"no dest", sandbox.HostMount{Source: rw}, "destination", "required"},
	} {
		_, err := checkHostMounts(cfg, []sandbox.HostMount{c.m})
		var fe *errdefs.FieldError
		if !errors.As(err, &fe) || !errdefs.IsInvalidArgument(err) ||
			fe.Field != "host_mounts[0]."+c.field || !strings.Contains(fe.Msg, c.msg) {
			t.Errorf("%s: want InvalidArgument on %s mentioning %q, got %v", c.name, c.field, c.msg, err)
		}
	}
	if _, err := checkHostMounts(cfg, []sandbox.HostMount{{Source: rw, Destination: "/a"}, {Source: ro, Destination: "/a", ReadOnly: true}}); err == nil {
		t.Error("duplicate destination accepted")
	}

	// A source swapped for a symlink after create is refused at start.
	swapped := mk("allowed/rw/later")
	got, err = checkHostMounts(cfg, []sandbox.HostMount{{Source: swapped, Destination: "/later"}})
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(swapped); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(outside, swapped); err != nil {
		t.Fatal(err)
	}
	if _, err := n.HostMountsFor(got); !errdefs.IsFailedPrecondition(err) {
		t.Errorf("swapped source at start: %v", err)
	}

	// No rules: every host mount is refused, with the reason.
	cfg.Storage.HostMountAllow = nil
	if _, err := checkHostMounts(cfg, ok[:1]); err == nil || !strings.Contains(err.Error(), "host_mount_allow is empty") {
		t.Errorf("no rules: %v", err)
	}
}
