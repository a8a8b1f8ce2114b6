package main

import (
	"bytes"
	"strings"
	"testing"
)

func TestRender(t *testing.T) {
	in := "e2b (JS)\t2.51.0\tenvd\trunc\tfiles: write\tpass\n" +
		"e2b (JS)\t2.51.0\tenvd\tgvisor\tfiles: write\tfail\n" +
		"e2b (JS)\t2.51.0\tenvd\tgvisor\tfiles: write\tpass\n" + // a rerun: the latest counts
		"e2b (Python)\t2.63.0\tsync\trunc\ttest_kill\tfail\n" +
		"e2b (Python)\t2.63.0\tsync\trunc\ttest_a|b\tskip\n" +
		"malformed line\n"
	runtimes := map[string]bool{}
	rows := parse(strings.NewReader(in), nil, runtimes)
	var b bytes.Buffer
	render(&b, rows, runtimes)
	out := b.String()
	for _, want := range []string{
		"| SDK | version | suite | runc | gvisor |",
		"| e2b (JS) | 2.51.0 | envd | 1/1 | 1/1 |",
		"| e2b (Python) | 2.63.0 | sync | **0/2** | — |",
		"## e2b (Python) 2.63.0",
		"| sync | test_kill | **FAIL** | — |",
		`| sync | test_a\|b | skip | — |`,
		"## Notes",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("missing %q in\n%s", want, out)
		}
	}
}

// TestVersionOrder: one SDK's versions in release order, not text order
// (2.7.0 before 2.51.0).
func TestVersionOrder(t *testing.T) {
	in := "e2b (JS)\t2.51.0\tdomain\trunc\tx\tpass\n" +
		"e2b (JS)\t2.7.0\tdomain\trunc\tx\tpass\n" +
		"e2b (JS)\t1.13.2\tdomain\trunc\tx\tpass\n"
	runtimes := map[string]bool{}
	var b bytes.Buffer
	render(&b, parse(strings.NewReader(in), nil, runtimes), runtimes)
	out := b.String()
	i, j, k := strings.Index(out, "## e2b (JS) 1.13.2"), strings.Index(out, "## e2b (JS) 2.7.0"), strings.Index(out, "## e2b (JS) 2.51.0")
	if i < 0 || !(i < j && j < k) {
		t.Errorf("versions out of order (%d %d %d):\n%s", i, j, k, out)
	}
	for _, c := range []struct {
		a, b string
		want int
	}{{"2.7.0", "2.51.0", -1}, {"2.51.0", "2.51.0", 0}, {"1.13.2", "2.0.1", -1}, {"2.0.0", "2.0", 1}, {"?", "2.0.0", 1}} {
		if got := compareVersions(c.a, c.b); got != c.want {
			t.Errorf("compareVersions(%s, %s) = %d, want %d", c.a, c.b, got, c.want)
		}
	}
}
