package cubeletapi

import (
	"testing"

	"github.com/cubesandbox/cube/internal/cubeletclient"
	"github.com/cubesandbox/cube/internal/lifecycle"
)

// TestStateNames: the client names API states without the lifecycle
// package; its names must be the lifecycle's.
func TestStateNames(t *testing.T) {
	for _, s := range lifecycle.All {
		p := stateToPB(s)
		if name := cubeletclient.StateName(p); name != string(s) {
			t.Errorf("%s: client names it %q", s, name)
		}
		if got, ok := cubeletclient.ParseState(string(s)); !ok || got != p {
			t.Errorf("%s: client parses it as %s %v", s, got, ok)
		}
		if back := StateFromPB(p); back != s {
			t.Errorf("%s: back as %q", s, back)
		}
	}
}
