package bench

import (
	"fmt"
	"strings"
	"testing"

	"github.com/cubesandbox/cube/internal/bench/report"
)

func TestRegistry(t *testing.T) {
	all, err := Resolve([]string{"all"})
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, s := range all {
		if s.Kind != report.KindCube {
			t.Errorf("all includes %s of kind %s", s.Name, s.Kind)
		}
		if s.Explicit {
			t.Errorf("all includes %s, which runs only when named", s.Name)
		}
		names = append(names, s.Name)
		for _, b := range s.Baselines {
			if bs, ok := Lookup(b); !ok || bs.Kind != report.KindBaseline {
				t.Errorf("%s: baseline %q is not a registered baseline", s.Name, b)
			}
		}
	}
	if got := strings.Join(names, ","); !strings.HasPrefix(got, "create-c1,create-c50,pause,resume,destroy") || !strings.Contains(got, "density") {
		t.Errorf("all = %s", got)
	}
	if _, err := Resolve([]string{"create-c1", "nope"}); err == nil || !strings.Contains(err.Error(), "unknown scenario \"nope\"") {
		t.Errorf("unknown scenario: %v", err)
	}
	got, err := Resolve([]string{"pause", "runc-pause", "pause"})
	if err != nil || len(got) != 2 {
		t.Errorf("duplicates: %v %v", got, err)
	}
}

func TestSplit(t *testing.T) {
	for _, c := range []struct {
		n, k int
		want string
	}{
		{100, 10, "[10 10 10 10 10 10 10 10 10 10]"},
		{7, 3, "[3 2 2]"},
		{3, 10, "[1 1 1]"},
		{5, 1, "[5]"},
		{5, 0, "[5]"},
		{0, 4, "[0]"},
	} {
		if got := fmt.Sprint(split(c.n, c.k)); got != c.want {
			t.Errorf("split(%d, %d) = %s, want %s", c.n, c.k, got, c.want)
		}
	}
}
