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
