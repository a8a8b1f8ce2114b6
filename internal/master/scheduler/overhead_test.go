package scheduler_test

import (
	"testing"

	"github.com/cubesandbox/cube/internal/master/scheduler"
)

// TestMemoryOverhead: a gVisor placement counts the sentry overhead the
// node reports for its runtime; the same request on runc (no overhead)
// fits where the gVisor one does not. The runtime comes from the request,
// else the template's, else the node's default.
func TestMemoryOverhead(t *testing.T) {
	mk := func(id string, mod func(*scheduler.Node)) *scheduler.Node {
		return node(id, func(n *scheduler.Node) {
			n.Runtimes = []string{"runc", "gvisor"}
			n.AllocMemoryMiB = 8192 - 600 // room for 512, not for 512+128
			n.MemoryOverheadMiB = map[string]int64{"gvisor": 128}
			n.TemplateRuntimes = map[string]string{}
			mod(n)
		})
	}
	for _, c := range []struct {
		name    string
		runtime string
		mod     func(*scheduler.Node)
		fits    bool
	}{
		{"gvisor requested", "gvisor", func(*scheduler.Node) {}, false},
		{"runc requested (control)", "runc", func(*scheduler.Node) {}, true},
		{"gvisor template", "", func(n *scheduler.Node) { n.TemplateRuntimes["busybox"] = "gvisor" }, false},
		{"gvisor node default", "", func(n *scheduler.Node) { n.DefaultRuntime = "gvisor" }, false},
		{"runc node default (control)", "", func(n *scheduler.Node) { n.DefaultRuntime = "runc" }, true},
	} {
		r := req
		r.Runtime = c.runtime
		cands, rejs := newSched().Rank([]*scheduler.Node{mk("n", c.mod)}, r)
		if got := len(cands) == 1; got != c.fits {
			t.Errorf("%s: fits %v, want %v (rejections %+v)", c.name, got, c.fits, rejs)
		} else if !c.fits {
			t.Logf("%s: %s", c.name, rejs[0].Reason)
		}
	}
}
