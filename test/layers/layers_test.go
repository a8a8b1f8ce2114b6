// Package layers checks the import rules of docs/architecture.md against
// the code: the rules block in that document is the source, so the map
// contributors read and the graph the compiler builds cannot drift apart.
package layers

import (
	"bufio"
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
)

const module = "github.com/cubesandbox/cube"

// rule is one line of the rules block:
//
//	<packages> only|never|never-deps <patterns> [except <packages>]
//
// only: every import from this module is in patterns; never: no direct
// import is; never-deps: no dependency, direct or not, is. Patterns are
// module-relative; "x/..." matches x and everything under it.
type rule struct {
	line     int
	subjects []string
	verb     string
	targets  []string
	except   []string
}

func match(pattern, pkg string) bool {
	if base, ok := strings.CutSuffix(pattern, "/..."); ok {
		return pkg == base || strings.HasPrefix(pkg, base+"/")
	}
	return pkg == pattern
}

func matchAny(patterns []string, pkg string) bool {
	return slices.ContainsFunc(patterns, func(p string) bool { return match(p, pkg) })
}

func parseRules(t *testing.T, doc string) []rule {
	t.Helper()
	var rules []rule
	in := false
	sc := bufio.NewScanner(strings.NewReader(doc))
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		switch {
		case line == "```imports":
			in = true
			continue
		case in && line == "```":
			in = false
			continue
		case !in || line == "" || strings.HasPrefix(line, "#"):
			continue
		}
		f := strings.Fields(line)
		r := rule{line: n}
		i := slices.IndexFunc(f, func(s string) bool { return s == "only" || s == "never" || s == "never-deps" })
		if i < 1 {
			t.Fatalf("docs/architecture.md:%d: want '<packages> only|never|never-deps <patterns> [except <packages>]': %q", n, line)
		}
		r.subjects, r.verb = f[:i], f[i]
		rest := f[i+1:]
		if j := slices.Index(rest, "except"); j >= 0 {
			r.targets, r.except = rest[:j], rest[j+1:]
		} else {
			r.targets = rest
		}
		if len(r.targets) == 0 {
			t.Fatalf("docs/architecture.md:%d: a rule names no patterns", n)
		}
		rules = append(rules, r)
	}
	if len(rules) == 0 {
		t.Fatal("docs/architecture.md has no ```imports block")
	}
	return rules
}

type pkg struct {
	imports []string // module-relative, this module only
	deps    []string
}

func listPackages(t *testing.T, root string) map[string]pkg {
	t.Helper()
	cmd := exec.Command("go", "list", "-f", "{{.ImportPath}}|{{join .Imports \" \"}}|{{join .Deps \" \"}}", "./...")
	cmd.Dir = root
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, stderr.String())
	}
	local := func(s string) []string {
		var r []string
		for _, p := range strings.Fields(s) {
			if rel, ok := strings.CutPrefix(p, module+"/"); ok {
				r = append(r, rel)
			}
		}
		return r
	}
	pkgs := map[string]pkg{}
	for _, l := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		parts := strings.SplitN(l, "|", 3)
		if len(parts) != 3 {
			t.Fatalf("go list: odd line %q", l)
		}
		name, ok := strings.CutPrefix(parts[0], module+"/")
		if !ok {
			continue
		}
		pkgs[name] = pkg{imports: local(parts[1]), deps: local(parts[2])}
	}
	return pkgs
}

func TestImportRules(t *testing.T) {
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	doc, err := os.ReadFile(filepath.Join(root, "docs", "architecture.md"))
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range check(parseRules(t, string(doc)), listPackages(t, root)) {
		t.Error(e)
	}
}

// check returns one line per import that breaks a rule, and one per rule
// that applies to no package (a stale rule checks nothing).
func check(rules []rule, pkgs map[string]pkg) []string {
	names := make([]string, 0, len(pkgs))
	for n := range pkgs {
		names = append(names, n)
	}
	slices.Sort(names)
	var errs []string
	for _, r := range rules {
		subjects := 0
		for _, name := range names {
			if !matchAny(r.subjects, name) || matchAny(r.except, name) {
				continue
			}
			subjects++
			p := pkgs[name]
			var bad []string
			switch r.verb {
			case "only":
				for _, imp := range p.imports {
					if !matchAny(r.targets, imp) {
						bad = append(bad, imp)
					}
				}
			case "never":
				for _, imp := range p.imports {
					if matchAny(r.targets, imp) {
						bad = append(bad, imp)
					}
				}
			case "never-deps":
				for _, dep := range p.deps {
					if matchAny(r.targets, dep) {
						bad = append(bad, dep)
					}
				}
			}
			if len(bad) > 0 {
				verb := " imports "
				if r.verb == "never-deps" {
					verb = " depends on "
				}
				errs = append(errs, name+verb+strings.Join(bad, ", ")+": against docs/architecture.md:"+strconv.Itoa(r.line)+" ("+r.verb+" "+strings.Join(r.targets, " ")+")")
			}
		}
		if subjects == 0 {
			errs = append(errs, "docs/architecture.md:"+strconv.Itoa(r.line)+": the rule matches no package ("+strings.Join(r.subjects, " ")+"): a stale rule checks nothing")
		}
	}
	return errs
}

// TestChecker keeps the checker honest on a made-up graph: each verb
// reports its violation, an allowed import and an excepted package are
// not reported, and a rule that matches nothing is.
func TestChecker(t *testing.T) {
	rules := parseRules(t, "```imports\n# comment\na/... only a/... b\nc never d/... except c/ok\ne never-deps f\nzz never a\n```\n")
	if len(rules) != 4 || rules[1].except[0] != "c/ok" || rules[2].verb != "never-deps" {
		t.Fatalf("parsed %+v", rules)
	}
	pkgs := map[string]pkg{
		"a":    {imports: []string{"a/x", "b"}},                    // allowed
		"a/x":  {imports: []string{"c"}},                           // only: c is not listed
		"c":    {imports: []string{"d/y"}},                         // never: d/...
		"c/ok": {imports: []string{"d"}},                           // excepted
		"e":    {imports: []string{"b"}, deps: []string{"b", "f"}}, // never-deps: f via b
		"b":    {deps: []string{"f"}},
	}
	got := check(rules, pkgs)
	want := []string{"a/x imports c", "c imports d/y", "e depends on f", "rule matches no package (zz)"}
	if len(got) != len(want) {
		t.Fatalf("check = %q, want %d findings", got, len(want))
	}
	for i, w := range want {
		if !strings.Contains(got[i], w) {
			t.Errorf("finding %d = %q, want it to mention %q", i, got[i], w)
		}
	}
	for _, c := range []struct {
		pattern, pkg string
		want         bool
	}{
		{"a/...", "a", true}, {"a/...", "a/b/c", true}, {"a/...", "ab", false},
		{"internal/cubelet/...", "internal/cubeletclient", false}, {"b", "b/c", false},
	} {
		if got := match(c.pattern, c.pkg); got != c.want {
			t.Errorf("match(%q, %q) = %v, want %v", c.pattern, c.pkg, got, c.want)
		}
	}
}
