package runc

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"
)

// errNoFreezer means the container's freezer cgroup could not be found;
// the caller falls back to `runc pause/resume`.
var errNoFreezer = errors.New("runc: no freezer cgroup")

// freeze writes the container's freezer cgroup directly instead of
// forking `runc pause` (about 5 ms of process start-up per call, the
// whole difference to the raw freezer). runc derives a container's
// paused status from the same cgroup, so `runc state` stays truthful.
//
// The cgroup is found in runc's own state.json (no fork): on hybrid and
// v1 hosts the v1 freezer hierarchy, on pure v2 hosts cgroup.freeze.
//
// The paths are cached per container (reading and decoding state.json was
// most of what a thaw cost beyond the raw write); Start and Stop forget
// an ID, and a cached path that is gone is looked up again once.
func (d *Driver) freeze(ctx context.Context, id string, frozen bool) error {
	if v, ok := d.freezers.Load(id); ok {
		err := freezeAt(ctx, v.(map[string]string), frozen)
		if !errors.Is(err, fs.ErrNotExist) && !errors.Is(err, errNoFreezer) {
			return err
		}
		d.freezers.Delete(id)
	}
	paths, err := d.cgroupPaths(id)
	if err != nil {
		return err
	}
	if err := freezeAt(ctx, paths, frozen); err != nil {
		return err
	}
	d.freezers.Store(id, paths)
	return nil
}

// forgetFreezer drops id's cached cgroup paths.
func (d *Driver) forgetFreezer(id string) { d.freezers.Delete(id) }

func freezeAt(ctx context.Context, paths map[string]string, frozen bool) error {
	if dir := paths["freezer"]; dir != "" {
		want := "THAWED"
		if frozen {
			want = "FROZEN"
		}
		file := filepath.Join(dir, "freezer.state")
		if frozen {
			return freezeV1(ctx, file)
		}
		if err := os.WriteFile(file, []byte(want), 0); err != nil {
			return fmt.Errorf("write %s: %w", file, err)
		}
		return waitFile(ctx, file, func(s string) bool { return s == want })
	}
	if dir := paths[""]; dir != "" {
		if _, err := os.Stat(filepath.Join(dir, "cgroup.freeze")); err != nil {
			return errNoFreezer
		}
		val, want := "0", "frozen 0"
		if frozen {
			val, want = "1", "frozen 1"
		}
		if err := os.WriteFile(filepath.Join(dir, "cgroup.freeze"), []byte(val), 0); err != nil {
			return fmt.Errorf("write cgroup.freeze: %w", err)
		}
		return waitFile(ctx, filepath.Join(dir, "cgroup.events"), func(s string) bool {
			for _, l := range strings.Split(s, "\n") {
				if l == want {
					return true
				}
			}
			return false
		})
	}
	return errNoFreezer
}

func (d *Driver) cgroupPaths(id string) (map[string]string, error) {
	data, err := os.ReadFile(filepath.Join(d.rc.Root, id, "state.json"))
	if err != nil {
		return nil, errNoFreezer
	}
	var st struct {
		CgroupPaths map[string]string `json:"cgroup_paths"`
	}
	if err := json.Unmarshal(data, &st); err != nil || len(st.CgroupPaths) == 0 {
		return nil, errNoFreezer
	}
	return st.CgroupPaths, nil
}

// freezeV1 freezes a v1 freezer cgroup. The kernel can leave one in
// FREEZING for good when a task is caught mid-way (seen under heavy I/O
// load), which runc works around the same way: write FROZEN again while
// waiting, and every so often thaw and retry. A freeze that still does not
// take before ctx ends is thawed, so the sandbox keeps running instead of
// hanging half-frozen.
func freezeV1(ctx context.Context, file string) error {
	delay := 50 * time.Microsecond
	for i := 0; ; i++ {
		if err := os.WriteFile(file, []byte("FROZEN"), 0); err != nil {
			return fmt.Errorf("write %s: %w", file, err)
		}
		data, err := os.ReadFile(file)
		if err != nil {
			return err
		}
		if strings.TrimSpace(string(data)) == "FROZEN" {
			return nil
		}
		if i%50 == 49 {
			_ = os.WriteFile(file, []byte("THAWED"), 0)
		}
		select {
		case <-ctx.Done():
			_ = os.WriteFile(file, []byte("THAWED"), 0)
			return fmt.Errorf("waiting for %s: %w", file, ctx.Err())
		case <-time.After(delay):
		}
		if delay < 5*time.Millisecond {
			delay *= 2
		}
	}
}

// waitFile polls a cgroup file until ok accepts its content: a v1
// freezer reports FREEZING until every task has stopped.
func waitFile(ctx context.Context, file string, ok func(string) bool) error {
	delay := 50 * time.Microsecond
	for {
		data, err := os.ReadFile(file)
		if err != nil {
			return err
		}
		if ok(strings.TrimSpace(string(data))) {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("waiting for %s: %w", file, ctx.Err())
		case <-time.After(delay):
		}
		if delay < 5*time.Millisecond {
			delay *= 2
		}
	}
}
