package baseimage

import (
	"bufio"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"

	"github.com/cubesandbox/cube/internal/errdefs"
)

// Mirror is one Debian archive apt on this machine is configured with.
type Mirror struct {
	URI     string // e.g. http://deb.debian.org/debian
	Keyring string // Signed-By, when given
}

// FindMirror returns the first enabled binary ("deb") source under aptDir
// (normally /etc/apt) that serves suite, reading sources.list and then
// sources.list.d/*.list and *.sources in name order, as apt does. Builds
// use that mirror and no other host, so the base image comes from the
// archive the machine already trusts.
func FindMirror(aptDir, suite string) (Mirror, error) {
	files := []string{filepath.Join(aptDir, "sources.list")}
	d := filepath.Join(aptDir, "sources.list.d")
	ents, _ := os.ReadDir(d)
	var names []string
	for _, e := range ents {
		if n := e.Name(); strings.HasSuffix(n, ".list") || strings.HasSuffix(n, ".sources") {
			names = append(names, n)
		}
	}
	sort.Strings(names)
	for _, n := range names {
		files = append(files, filepath.Join(d, n))
	}
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		var ms []Mirror
		if strings.HasSuffix(f, ".sources") {
			ms = parseDeb822(string(data), suite)
		} else {
			ms = parseOneLine(string(data), suite)
		}
		if len(ms) > 0 {
			return ms[0], nil
		}
	}
	return Mirror{}, fmt.Errorf("baseimage: no apt source for suite %q under %s: %w", suite, aptDir, errdefs.ErrFailedPrecondition)
}

// parseOneLine reads "deb [opt=val ...] URI suite component..." lines.
func parseOneLine(text, suite string) []Mirror {
	var out []Mirror
	sc := bufio.NewScanner(strings.NewReader(text))
	for sc.Scan() {
		line, _, _ := strings.Cut(sc.Text(), "#")
		f := strings.Fields(line)
		if len(f) < 3 || f[0] != "deb" {
			continue
		}
		f = f[1:]
		var keyring string
		if strings.HasPrefix(f[0], "[") {
			// Options run to the closing bracket, possibly across fields.
			var opts []string
			for len(f) > 0 {
				tok := f[0]
				f = f[1:]
				opts = append(opts, strings.Trim(tok, "[]"))
				if strings.HasSuffix(tok, "]") {
					break
				}
			}
			for _, o := range opts {
				if k, v, ok := strings.Cut(o, "="); ok && strings.EqualFold(k, "signed-by") {
					keyring = v
				}
			}
		}
		if len(f) < 2 || f[1] != suite {
			continue
		}
		out = append(out, Mirror{URI: strings.TrimRight(f[0], "/"), Keyring: keyring})
	}
	return out
}

// parseDeb822 reads stanzas of "Types:", "URIs:", "Suites:", "Signed-By:"
// (and "Enabled: no"), separated by blank lines.
func parseDeb822(text, suite string) []Mirror {
	var out []Mirror
	flush := func(st map[string]string) {
		if len(st) == 0 || strings.EqualFold(st["enabled"], "no") {
			return
		}
		if !slices.Contains(strings.Fields(st["types"]), "deb") || !slices.Contains(strings.Fields(st["suites"]), suite) {
			return
		}
		key := st["signed-by"]
		if strings.Contains(key, "BEGIN PGP") {
			key = "" // an inline key: debootstrap needs a file, use its default
		}
		for _, u := range strings.Fields(st["uris"]) {
			out = append(out, Mirror{URI: strings.TrimRight(u, "/"), Keyring: key})
		}
	}
	st := map[string]string{}
	last := ""
	sc := bufio.NewScanner(strings.NewReader(text))
	for sc.Scan() {
		line := sc.Text()
		switch {
		case strings.TrimSpace(line) == "":
			flush(st)
			st, last = map[string]string{}, ""
		case strings.HasPrefix(line, "#"):
		case line[0] == ' ' || line[0] == '\t':
			if last != "" { // continuation line
				st[last] += "\n" + strings.TrimSpace(line)
			}
		default:
			k, v, ok := strings.Cut(line, ":")
			if !ok {
				continue
			}
			last = strings.ToLower(strings.TrimSpace(k))
			st[last] = strings.TrimSpace(v)
		}
	}
	flush(st)
	return out
}
