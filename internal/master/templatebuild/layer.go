package templatebuild

import (
	"archive/tar"
	"bytes"
	"errors"
	"fmt"
	"io"
	"path"
	"slices"
	"strings"
	"time"
)

// ScratchDir is the build sandbox's own directory: uploads, lists and
// layer archives. It is never part of a layer.
const ScratchDir = "/.cube-build"

// excluded are the paths a layer never holds: kernel and runtime mounts,
// scratch space, and the agent the template import injects itself.
var excluded = []string{"/proc", "/sys", "/dev", "/run", "/tmp", "/var/tmp", ScratchDir, "/usr/local/bin/cube-agent"}

// ListCmd prints every path of the root filesystem (one filesystem: other
// mounts are not descended) with its change time, NUL-separated, as
// "<ctime> <path>". A change time moves on every write, chmod, chown or
// rename, and no process can set it back, so comparing two listings finds
// every file a step touched (GNU find).
func ListCmd() string {
	var prune []string
	for _, p := range excluded {
		prune = append(prune, "-path "+p)
	}
	return "find / -xdev \\( " + strings.Join(prune, " -o ") + " \\) -prune -o -printf '%C@ %p\\0'"
}

// Listing is a parsed ListCmd output: path -> change time.
type Listing map[string]string

// ParseListing parses ListCmd's output.
func ParseListing(b []byte) (Listing, error) {
	l := Listing{}
	for _, rec := range bytes.Split(b, []byte{0}) {
		if len(rec) == 0 {
			continue
		}
		ct, p, ok := bytes.Cut(rec, []byte{' '})
		if !ok || len(p) == 0 || p[0] != '/' {
			return nil, fmt.Errorf("file listing: malformed record %q", rec)
		}
		l[string(p)] = string(ct)
	}
	if len(l) == 0 {
		return nil, errors.New("file listing: empty")
	}
	return l, nil
}

// Diff is what a step changed: paths added or changed (sorted, parents
// before children, without the leading "/"), and paths removed (only the
// topmost of a removed tree).
type Diff struct {
	Changed []string
	Removed []string
}

// Empty reports whether the step changed nothing.
func (d Diff) Empty() bool { return len(d.Changed) == 0 && len(d.Removed) == 0 }

// Compare finds what changed between two listings.
func Compare(before, after Listing) Diff {
	var d Diff
	for p, ct := range after {
		if p == "/" {
			continue
		}
		if old, ok := before[p]; !ok || old != ct {
			d.Changed = append(d.Changed, strings.TrimPrefix(p, "/"))
		}
	}
	for p := range before {
		if _, ok := after[p]; ok || p == "/" {
			continue
		}
		if _, parentGone := before[path.Dir(p)]; parentGone && path.Dir(p) != "/" {
			if _, still := after[path.Dir(p)]; !still {
				continue // the parent's whiteout covers it
			}
		}
		d.Removed = append(d.Removed, p)
	}
	slices.Sort(d.Changed)
	slices.Sort(d.Removed)
	return d
}

// TarListCmd archives the NUL-separated relative paths in list (no
// recursion: the list names every entry) into out, keeping owners, modes
// and times (GNU tar).
func TarListCmd(list, out string) string {
	return "tar --null --no-recursion --numeric-owner -C / -cpf " + out + " -T " + list
}

const whiteoutPrefix = ".wh."

// WriteLayer writes the OCI layer of a step: a whiteout for each removed
// path, then the entries of the archive the sandbox made (in is nil when
// nothing was added or changed).
func WriteLayer(w io.Writer, in io.Reader, removed []string) error {
	tw := tar.NewWriter(w)
	for _, p := range removed {
		rel := strings.TrimPrefix(p, "/")
		wh := path.Join(path.Dir(rel), whiteoutPrefix+path.Base(rel))
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: wh, Mode: 0o644, Format: tar.FormatPAX}); err != nil {
			return err
		}
	}
	if in != nil {
		tr := tar.NewReader(in)
		for {
			h, err := tr.Next()
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				return fmt.Errorf("layer archive from the build sandbox: %w", err)
			}
			if strings.HasPrefix(path.Base(h.Name), whiteoutPrefix) {
				return fmt.Errorf("the step made %q: a name the OCI layer format reserves for deletions", h.Name)
			}
			// Deterministic across builds of the same files: no access
			// or change times.
			h.AccessTime, h.ChangeTime = time.Time{}, time.Time{}
			if err := tw.WriteHeader(h); err != nil {
				return err
			}
			if _, err := io.Copy(tw, tr); err != nil { //nolint:gosec // G110: a tar, not compressed; its size is the step's files
				return err
			}
		}
	}
	return tw.Close()
}

// SplitLayer is WriteLayer undone, to replay a cached layer in a build
// sandbox: the removed paths (absolute), and the archive without the
// whiteouts written to w.
func SplitLayer(r io.Reader, w io.Writer) (removed []string, err error) {
	tr := tar.NewReader(r)
	tw := tar.NewWriter(w)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return nil, err
		}
		if base := path.Base(h.Name); strings.HasPrefix(base, whiteoutPrefix) {
			removed = append(removed, "/"+path.Join(path.Dir(h.Name), strings.TrimPrefix(base, whiteoutPrefix)))
			continue
		}
		if err := tw.WriteHeader(h); err != nil {
			return nil, err
		}
		if _, err := io.Copy(tw, tr); err != nil { //nolint:gosec // G110: our own cached layer, not compressed
			return nil, err
		}
	}
	return removed, tw.Close()
}
