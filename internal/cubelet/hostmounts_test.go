package cubelet

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/cubelet/actions"
	"github.com/cubesandbox/cube/internal/cubelet/config"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/failpoint"
	"github.com/cubesandbox/cube/internal/hostbind"
	"github.com/cubesandbox/cube/internal/sandbox"
	"github.com/cubesandbox/cube/internal/testenv"
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
	if _, _, err := n.StageHostMounts(context.Background(), "sb", got, false); err != nil {
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
	if _, _, err := n.StageHostMounts(context.Background(), "sb", got, false); !errdefs.IsFailedPrecondition(err) {
		t.Errorf("swapped source at start: %v", err)
	}

	// No rules: every host mount is refused, with the reason.
	cfg.Storage.HostMountAllow = nil
	if _, err := checkHostMounts(cfg, ok[:1]); err == nil || !strings.Contains(err.Error(), "host_mount_allow is empty") {
		t.Errorf("no rules: %v", err)
	}
}

// TestHostMountSwapRace: a host mount's source is swapped for a symlink
// to /etc (the directory renamed away, the symlink put in its place) at
// each step between the check by name and the runtime's bind. The bind
// ends on the original directory or is refused, never on /etc. Control,
// each row: binding the source by name after the swap, as the runtime
// did before, reaches /etc.
func TestHostMountSwapRace(t *testing.T) {
	testenv.RequireRoot(t, "mounts")
	dir := t.TempDir()
	mk := func(p string) string {
		full := filepath.Join(dir, p)
		if err := os.MkdirAll(full, 0o755); err != nil {
			t.Fatal(err)
		}
		return full
	}
	allowed, outside := mk("allowed"), mk("outside")
	cfg := &config.Config{}
	cfg.Node.DataDir, cfg.Node.RunDir = mk("cube/data"), mk("cube/run")
	cfg.Storage.HostMountAllow = []config.HostMountRule{{Prefix: allowed}}
	n := actions.NewNode(cfg)
	ctx := context.Background()

	for i, row := range []struct {
		name, point string
		movedTo     string // where the original directory goes
		refused     bool
	}{
		{"swapped before the open", hostbind.FailpointOpen, allowed, true},
		{"swapped after the open", hostbind.FailpointOpened, allowed, false},
		{"swapped after the open, original moved out of the allowed prefix", hostbind.FailpointOpened, outside, true},
		{"swapped after the check", hostbind.FailpointChecked, allowed, false},
		{"swapped after staging, before the runtime binds", hostbind.FailpointStaged, allowed, false},
	} {
		t.Run(row.name, func(t *testing.T) {
			id := fmt.Sprintf("sb%d", i)
			if err := os.MkdirAll(cfg.SandboxRunDir(id), 0o700); err != nil {
				t.Fatal(err)
			}
			src := mk(fmt.Sprintf("allowed/data%d", i))
			if err := os.WriteFile(filepath.Join(src, "marker"), []byte("original"), 0o644); err != nil {
				t.Fatal(err)
			}
			swapped := false
			swap := func(context.Context) error {
				if err := os.Rename(src, filepath.Join(row.movedTo, fmt.Sprintf("moved%d", i))); err != nil {
					return err
				}
				swapped = true
				return os.Symlink("/etc", src)
			}
			if err := failpoint.EnableFunc(row.point, swap); err != nil {
				t.Fatal(err)
			}
			mounts, unstage, err := n.StageHostMounts(ctx, id, []sandbox.HostMount{{Source: src, Destination: "/data"}}, true)
			failpoint.Disable(row.point)
			if !swapped {
				t.Fatalf("the swap at %s did not happen (err %v)", row.point, err)
			}
			switch {
			case err != nil && row.refused && errdefs.IsFailedPrecondition(err):
				t.Logf("swap at %s: refused: %v", row.point, err)
			case err != nil:
				t.Fatalf("swap at %s: %v; want it bound to the original directory", row.point, err)
			case row.refused:
				unstage()
				t.Fatalf("swap at %s: staged %v; want a refusal", row.point, mounts)
			default:
				b, rerr := os.ReadFile(filepath.Join(mounts[0].Source, "marker"))
				_, perr := os.Stat(filepath.Join(mounts[0].Source, "passwd"))
				unstage()
				if string(b) != "original" || perr == nil {
					t.Fatalf("swap at %s: the staged bind shows marker %q (%v), passwd %v; want the original directory", row.point, b, rerr, perr)
				}
				t.Logf("swap at %s: bound to the original directory (marker %q, no passwd), not /etc", row.point, b)
			}
			if _, err := os.Lstat(n.HostMountsDir(id)); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("staging dir left: %v", err)
			}
			if ms, _ := mountinfo.GetMounts(mountinfo.PrefixFilter(cfg.Node.RunDir)); len(ms) != 0 {
				t.Errorf("mounts left under the run dir: %v", ms)
			}

			// Control: the same source bound by name, now.
			ctl := filepath.Join(t.TempDir(), "ctl")
			if err := os.Mkdir(ctl, 0o700); err != nil {
				t.Fatal(err)
			}
			if err := unix.Mount(src, ctl, "", unix.MS_BIND|unix.MS_REC, ""); err != nil {
				t.Fatal(err)
			}
			_, perr := os.Stat(filepath.Join(ctl, "passwd"))
			if err := unix.Unmount(ctl, unix.MNT_DETACH); err != nil {
				t.Error(err)
			}
			if perr != nil {
				t.Fatalf("control: bind by name after the swap does not reach /etc: %v", perr)
			}
			t.Logf("control: bound by name after the swap, %s shows /etc (passwd present)", src)
		})
	}
}
