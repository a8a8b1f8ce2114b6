// Package bench is cube-bench's load generator: the scenarios that drive
// a cubelet through its gRPC API (registered here, one file per area),
// the runner that interleaves each with its raw baselines and compares
// them, and the environment they run against (a private cubelet or a
// running one, the test image, the raw baselines' scratch space). The
// bare runtimes it times live in bench/raw, the private node in
// bench/node, and the report model and its rendering in bench/report.
package bench

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sort"
	"sync"

	"github.com/cubesandbox/cube/internal/bench/report"
)

// Scenario is one measurement. Scenarios register themselves (Register, in
// init) so that new areas (snapshots, clones, the E2B API, other runtimes)
// add a file and nothing else.
type Scenario struct {
	Name string
	Kind report.Kind
	Help string
	// Runtime is the cubelet runtime a baseline stands for ("" = any):
	// the runner compares a cube scenario only with the baselines of the
	// runtime it runs on.
	Runtime string
	// Baselines are compared with this scenario's result; the runner runs
	// each with the same Params (N capped by Options.BaselineN).
	Baselines []string
	// Params picks N and concurrency from the options.
	Params func(report.Options) report.Params
	// Probe reports, wrapped in ErrSkip, why the scenario cannot run
	// against this node (an RPC the cubelet does not implement, a missing
	// runtime or binary). nil means it can run. May be nil.
	Probe func(ctx context.Context, e *Env) error
	// Run measures. It must leave nothing behind, also when it fails.
	// Finish, when set, adds to the scenario's result what only the
	// whole of it knows once its chunks are merged (summaries over every
	// chunk: a chunk's notes are cut to a few). May be nil.
	Finish func(e *Env, r *report.Result)
	// Explicit scenarios run only when named, never with "all": they
	// build a whole system of their own (the cluster scenarios).
	Explicit bool
	// Whole scenarios run their N in one go, after their baselines,
	// instead of in chunks alternating with them: what they measure
	// carries over from sample to sample (a warm pool that drains).
	Whole bool
	Run   func(ctx context.Context, e *Env, p report.Params) (*report.Result, error)
}

// ErrSkip marks a scenario that cannot run here; the message says why.
var ErrSkip = errors.New("skipped")

// skipf returns an ErrSkip with a reason.
func skipf(format string, args ...any) error {
	return fmt.Errorf("%w: "+format, append([]any{ErrSkip}, args...)...)
}

var (
	regMu    sync.Mutex
	registry = map[string]*Scenario{}
	// order is the default run order: the order of registration within
	// each kind, cube scenarios first.
	order []string
)

// Register adds a scenario; a duplicate name panics (a programming error).
func Register(s Scenario) {
	regMu.Lock()
	defer regMu.Unlock()
	if s.Name == "" || s.Run == nil || s.Params == nil {
		panic("bench: scenario needs Name, Params and Run")
	}
	if _, dup := registry[s.Name]; dup {
		panic("bench: duplicate scenario " + s.Name)
	}
	registry[s.Name] = &s
	order = append(order, s.Name)
}

// Lookup returns the registered scenario called name.
func Lookup(name string) (*Scenario, bool) {
	regMu.Lock()
	defer regMu.Unlock()
	s, ok := registry[name]
	return s, ok
}

// Scenarios returns every registered scenario of kind ("" = all), in
// registration order.
func Scenarios(kind report.Kind) []*Scenario {
	regMu.Lock()
	defer regMu.Unlock()
	var out []*Scenario
	for _, n := range order {
		if s := registry[n]; kind == "" || s.Kind == kind {
			out = append(out, s)
		}
	}
	return out
}

// Resolve turns a list of names into scenarios. "all" expands to every
// cube scenario but the Explicit ones; an unknown name is an error listing the known ones.
func Resolve(names []string) ([]*Scenario, error) {
	var out []*Scenario
	seen := map[string]bool{}
	for _, n := range names {
		if n == "all" {
			for _, s := range Scenarios(report.KindCube) {
				if !seen[s.Name] && !s.Explicit {
					seen[s.Name] = true
					out = append(out, s)
				}
			}
			continue
		}
		s, ok := Lookup(n)
		if !ok {
			var known []string
			for _, s := range Scenarios("") {
				known = append(known, s.Name)
			}
			sort.Strings(known)
			return nil, fmt.Errorf("unknown scenario %q (known: all, %v)", n, known)
		}
		if !seen[n] {
			seen[n] = true
			out = append(out, s)
		}
	}
	return slices.Clip(out), nil
}
