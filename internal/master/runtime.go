package master

import (
	"errors"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/master/scheduler"
)

// A sandbox runs on one runtime driver (docs/control-plane.md, Runtimes).
// The client may name it at create (cube's E2B extension "runtime"); else
// the node runs the template's runtime, else its own default. Either way
// the catalog records what the node actually used, and everything made
// from the sandbox later (resume, snapshots, forks, clones) stays on it:
// those run on the node and from state only that runtime can read.

// knownRuntimes are the drivers cube ships. A runtime a node advertises
// is known as well, so a node with a driver newer than this master is
// still usable by name.
var knownRuntimes = []string{"gvisor", "runc", "vm"}

var runtimeNameRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9-]{0,31}$`)

// validateRuntime checks a runtime a create names against the cluster,
// before anything is written: a name no node offers can never be placed,
// and saying so now is clearer than a list of per-node rejections.
func (s *Service) validateRuntime(name string) error {
	if name == "" {
		return nil
	}
	if !runtimeNameRE.MatchString(name) {
		return errdefs.FieldErrorf("runtime", "%q: 1-32 letters, digits or '-'", name)
	}
	offered := s.clusterRuntimes()
	if !slices.Contains(offered, name) {
		if !slices.Contains(knownRuntimes, name) {
			return errdefs.FieldErrorf("runtime", "unknown runtime %q; cube has %s", name, strings.Join(knownRuntimes, ", "))
		}
		have := "none"
		if len(offered) > 0 {
			have = strings.Join(offered, ", ")
		}
		return errdefs.FieldErrorf("runtime", "no node offers runtime %q (the nodes offer: %s)", name, have)
	}
	return nil
}

// clusterRuntimes is every runtime some registered node advertises,
// healthy or not (an unhealthy node's runtime is only unavailable, which
// placement reports as such).
func (s *Service) clusterRuntimes() []string {
	set := map[string]bool{}
	for _, n := range s.schedNodes() {
		for _, rt := range n.Runtimes {
			set[rt] = true
		}
	}
	out := make([]string, 0, len(set))
	for rt := range set {
		out = append(out, rt)
	}
	sort.Strings(out)
	return out
}

// runtimePlacementErr turns a placement that failed for want of the named
// runtime into an InvalidArgument on the field: some node offers the
// runtime, but none of those holds the template. Other failures pass
// through.
func runtimePlacementErr(err error, template, runtime string) error {
	var nn *scheduler.NoNodeError
	if runtime == "" || !errors.As(err, &nn) || len(nn.Refusals) > 0 {
		return err
	}
	if !errdefs.IsNotFound(err) && !errdefs.IsFailedPrecondition(err) {
		return err
	}
	for _, r := range nn.Rejections {
		if errdefs.IsFailedPrecondition(r.Kind()) {
			return &errdefs.FieldError{Field: "runtime", Msg: "no node that holds template " + strconv.Quote(template) +
				" offers runtime " + strconv.Quote(runtime) + " (" + nn.Error() + ")"}
		}
	}
	return err
}

// CommonRuntime is the runtime every node's copy of the template is for,
// or "" when they differ or use their node's default.
func (t Template) CommonRuntime() string {
	common := ""
	for i, n := range t.Nodes {
		rt := t.Runtimes[n]
		if i > 0 && rt != common {
			return ""
		}
		common = rt
	}
	return common
}

// AllWarm reports whether every node holding the template has it warm.
func (t Template) AllWarm() bool { return len(t.Nodes) > 0 && len(t.WarmNodes) == len(t.Nodes) }
