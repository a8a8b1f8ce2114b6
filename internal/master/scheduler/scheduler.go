// Package scheduler picks the node for a new sandbox.
//
// Placement is filter, then score, then try in order:
//
//   - Filter drops nodes that cannot take the sandbox at all: unhealthy or
//     cordoned, without the runtime asked for (or, when none is, the
//     runtime its copy of the template is for), without the template, or
//     without the capacity (CPU and memory with the configured overcommit,
//     the per-sandbox maxima, the sandbox count limit).
//   - Score ranks the rest (higher is better), as a weighted sum of three
//     terms in [0, 1]:
//     load      1 - the larger of the node's CPU and memory fractions after placement
//     locality  1 when the node already runs sandboxes of this template
//     (page cache and clone pool warm), else 0
//     spread    1 - sandboxes / (most sandboxes on any candidate + 1), so that
//     nodes of unequal size still share the sandbox count
//     pool      1 when the node has a frozen sandbox of this template in its
//     warm pool (the create claims it instead of starting one), else 0
//     Ties are broken at random, so concurrent creates fan out. A node
//     that reports itself busy ranks after every node that does not,
//     whatever the scores: it is used only when no other node can.
//   - Place calls try for each candidate in rank order until one succeeds.
//     A node that refuses with ResourceExhausted (over its create limit) or
//     Unavailable (unreachable, not ready) is skipped for the next; any
//     other error ends the placement at once (a bad request fails the
//     same everywhere). NoNodeError.Transient says whether the caller may
//     place again in a moment (cubemaster waits nodes.restart_wait for it).
//
// The package holds no state: the caller passes a fresh view of the nodes.
package scheduler

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sort"
	"strings"

	"github.com/cubesandbox/cube/internal/errdefs"
)

// Node is what the scheduler knows about one node.
type Node struct {
	ID      string
	Healthy bool
	// Busy: the node can take the sandbox but said it would rather not
	// (a condition flapping, its create flow full): ranked after every
	// node that is not.
	Busy        bool
	Schedulable bool
	Runtimes    []string
	Templates   map[string]bool
	// TemplateRuntimes is the runtime each template on the node is for
	// (absent or "": the node default). A create that names no runtime
	// runs on it, so a node without that runtime cannot take the create.
	TemplateRuntimes map[string]string
	// Capacity (before overcommit) and the limits of every sandbox on it.
	MilliCPU       int64
	MemoryMiB      int64
	AllocMilliCPU  int64
	AllocMemoryMiB int64
	// The largest single sandbox the node accepts (0 = no limit).
	MaxMilliCPU  int64
	MaxMemoryMiB int64
	Sandboxes    int
	// Sandboxes per template, for locality.
	TemplateSandboxes map[string]int
	// TemplatePool is the warm pool entries per template.
	TemplatePool map[string]int
	// DefaultRuntime runs creates that name none and whose template is
	// for no particular runtime.
	DefaultRuntime string
	// MemoryOverheadMiB is the memory a sandbox of each runtime holds
	// beyond its limit (the gVisor sentry overhead).
	MemoryOverheadMiB map[string]int64
}

// MemoryFor is the memory req takes on n: its limit plus the overhead of
// the runtime it would run on there.
func (n *Node) MemoryFor(req Request) int64 {
	rt := req.Runtime
	if rt == "" {
		rt = n.TemplateRuntimes[req.TemplateID]
	}
	if rt == "" {
		rt = n.DefaultRuntime
	}
	return req.MemoryMiB + n.MemoryOverheadMiB[rt]
}

// Request is the sandbox to place.
type Request struct {
	TemplateID string
	Runtime    string // "" = any runtime
	MilliCPU   int64
	MemoryMiB  int64
}

// Weights of the score terms.
type Weights struct {
	Load     float64 `toml:"load"`
	Locality float64 `toml:"locality"`
	Spread   float64 `toml:"spread"`
	Pool     float64 `toml:"pool"`
}

// Config tunes the scheduler.
type Config struct {
	Weights Weights `toml:"weights"`
	// Capacity multipliers: 4 lets the sum of CPU limits reach four times
	// the cores. Memory is usually left at 1.
	CPUOvercommit    float64 `toml:"cpu_overcommit"`
	MemoryOvercommit float64 `toml:"memory_overcommit"`
	// At most this many sandboxes per node (0 = no limit).
	MaxSandboxesPerNode int `toml:"max_sandboxes_per_node"`
	// At most this many nodes tried per placement (0 = all candidates).
	MaxAttempts int `toml:"max_attempts"`
}

// DefaultConfig is what cubemaster uses unless configured otherwise.
func DefaultConfig() Config {
	return Config{
		Weights:       Weights{Load: 1, Locality: 0.3, Spread: 0.5, Pool: 0.6},
		CPUOvercommit: 32, MemoryOvercommit: 4, MaxAttempts: 3,
	}
}

// Candidate is a node that passed the filter, with its score.
type Candidate struct {
	Node     *Node
	Score    float64
	Load     float64
	Locality float64
	Spread   float64
	Pool     float64
}

// Rejection says why the filter dropped a node.
type Rejection struct {
	NodeID string
	Reason string
	kind   error // errdefs class the reason falls in
	// transient: the reason may pass within seconds (an unhealthy node:
	// a daemon restarting, a condition failing).
	transient bool
}

// Kind is the errdefs class of the reason: FailedPrecondition for a
// missing runtime, NotFound for a missing template, and so on.
func (r Rejection) Kind() error { return r.kind }

// Scheduler ranks nodes for requests.
type Scheduler struct {
	cfg  Config
	rand *rand.Rand // nil = the global source
}

// New returns a scheduler with cfg.
func New(cfg Config) *Scheduler { return &Scheduler{cfg: cfg} }

// WithRand makes tie-breaking deterministic (tests).
func (s *Scheduler) WithRand(r *rand.Rand) *Scheduler { s.rand = r; return s }

func (s *Scheduler) filter(n *Node, req Request) *Rejection {
	reject := func(kind error, f string, a ...any) *Rejection {
		return &Rejection{NodeID: n.ID, Reason: fmt.Sprintf(f, a...), kind: kind}
	}
	switch {
	case !n.Healthy:
		r := reject(errdefs.ErrUnavailable, "unhealthy")
		r.transient = true
		return r
	case !n.Schedulable:
		return reject(errdefs.ErrUnavailable, "cordoned")
	}
	if req.Runtime != "" && !contains(n.Runtimes, req.Runtime) {
		return reject(errdefs.ErrFailedPrecondition, "no runtime %q (has %s)", req.Runtime, strings.Join(n.Runtimes, ","))
	}
	if rt := n.TemplateRuntimes[req.TemplateID]; req.Runtime == "" && rt != "" && n.Templates[req.TemplateID] && !contains(n.Runtimes, rt) {
		return reject(errdefs.ErrFailedPrecondition, "template %q is for runtime %q, which the node lacks (has %s)", req.TemplateID, rt, strings.Join(n.Runtimes, ","))
	}
	if !n.Templates[req.TemplateID] {
		return reject(errdefs.ErrNotFound, "no template %q", req.TemplateID)
	}
	if n.MaxMilliCPU > 0 && req.MilliCPU > n.MaxMilliCPU {
		return reject(errdefs.ErrInvalidArgument, "%d milli-CPU exceeds the node's per-sandbox maximum %d", req.MilliCPU, n.MaxMilliCPU)
	}
	if n.MaxMemoryMiB > 0 && req.MemoryMiB > n.MaxMemoryMiB {
		return reject(errdefs.ErrInvalidArgument, "%d MiB exceeds the node's per-sandbox maximum %d", req.MemoryMiB, n.MaxMemoryMiB)
	}
	if limit := s.cfg.MaxSandboxesPerNode; limit > 0 && n.Sandboxes >= limit {
		return reject(errdefs.ErrResourceExhausted, "%d sandboxes, the limit is %d", n.Sandboxes, limit)
	}
	cpuCap, memCap := s.capacity(n)
	if n.AllocMilliCPU+req.MilliCPU > cpuCap {
		return reject(errdefs.ErrResourceExhausted, "CPU full: %d+%d of %d milli-CPU", n.AllocMilliCPU, req.MilliCPU, cpuCap)
	}
	if mem := n.MemoryFor(req); n.AllocMemoryMiB+mem > memCap {
		return reject(errdefs.ErrResourceExhausted, "memory full: %d+%d of %d MiB", n.AllocMemoryMiB, mem, memCap)
	}
	return nil
}

func (s *Scheduler) capacity(n *Node) (cpu, mem int64) {
	co, mo := s.cfg.CPUOvercommit, s.cfg.MemoryOvercommit
	if co <= 0 {
		co = 1
	}
	if mo <= 0 {
		mo = 1
	}
	return int64(float64(n.MilliCPU) * co), int64(float64(n.MemoryMiB) * mo)
}

func contains(list []string, v string) bool {
	for _, x := range list {
		if x == v {
			return true
		}
	}
	return false
}

// Rank filters and scores nodes for req: candidates best first, and why
// every other node was dropped.
func (s *Scheduler) Rank(nodes []*Node, req Request) ([]Candidate, []Rejection) {
	var cands []Candidate
	var rejs []Rejection
	maxCount := 0
	for _, n := range nodes {
		if r := s.filter(n, req); r != nil {
			rejs = append(rejs, *r)
			continue
		}
		cands = append(cands, Candidate{Node: n})
		if n.Sandboxes > maxCount {
			maxCount = n.Sandboxes
		}
	}
	w := s.cfg.Weights
	for i := range cands {
		c := &cands[i]
		n := c.Node
		cpuCap, memCap := s.capacity(n)
		frac := 0.0
		if cpuCap > 0 {
			frac = float64(n.AllocMilliCPU+req.MilliCPU) / float64(cpuCap)
		}
		if memCap > 0 {
			frac = max(frac, float64(n.AllocMemoryMiB+n.MemoryFor(req))/float64(memCap))
		}
		c.Load = 1 - min(frac, 1)
		if n.TemplateSandboxes[req.TemplateID] > 0 {
			c.Locality = 1
		}
		c.Spread = 1 - float64(n.Sandboxes)/float64(maxCount+1)
		if n.TemplatePool[req.TemplateID] > 0 {
			c.Pool = 1
		}
		c.Score = w.Load*c.Load + w.Locality*c.Locality + w.Spread*c.Spread + w.Pool*c.Pool
	}
	shuffle := rand.Shuffle
	if s.rand != nil {
		shuffle = s.rand.Shuffle
	}
	shuffle(len(cands), func(i, j int) { cands[i], cands[j] = cands[j], cands[i] })
	sort.SliceStable(cands, func(i, j int) bool {
		if cands[i].Node.Busy != cands[j].Node.Busy {
			return !cands[i].Node.Busy
		}
		return cands[i].Score > cands[j].Score
	})
	return cands, rejs
}

// NoNodeError says no node could take the sandbox. It unwraps to the
// errdefs class that best describes why: NotFound when no node has the
// template, Unavailable when no node is healthy, FailedPrecondition when no
// node has the runtime, InvalidArgument when the sandbox is larger than any
// node accepts, ResourceExhausted otherwise (full, or every try refused).
type NoNodeError struct {
	Rejections []Rejection
	// Refusals are the errors of the nodes tried.
	Refusals map[string]error
	kind     error
}

func (e *NoNodeError) Error() string {
	var parts []string
	for _, r := range e.Rejections {
		parts = append(parts, r.NodeID+": "+r.Reason)
	}
	ids := make([]string, 0, len(e.Refusals))
	for id := range e.Refusals {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	for _, id := range ids {
		parts = append(parts, id+": "+e.Refusals[id].Error())
	}
	if len(parts) == 0 {
		return "no node can take the sandbox: no nodes registered"
	}
	return "no node can take the sandbox: " + strings.Join(parts, "; ")
}

func (e *NoNodeError) Unwrap() error { return e.kind }

// Transient reports whether the placement may succeed if tried again in a
// moment: a node tried refused with a retryable error (unreachable, over
// its create limit), or a node was filtered out only for being unhealthy.
// A cluster that lacks the template, the runtime or the room, or whose
// nodes' disks are full, is not.
func (e *NoNodeError) Transient() bool {
	for _, err := range e.Refusals {
		if Retryable(err) && !errdefs.IsNoSpace(err) {
			return true
		}
	}
	for _, r := range e.Rejections {
		if r.transient {
			return true
		}
	}
	return false
}

// classify picks the most specific reason across all rejections: the one
// the user can act on (the template, the runtime, the size) wins only when
// it holds for every node.
func classify(rejs []Rejection, refusals map[string]error) error {
	if len(refusals) > 0 {
		// Every node tried is out of disk: that waits for an operator,
		// not for a retry (the API's 507, naming each filesystem).
		noSpace := true
		for _, err := range refusals {
			noSpace = noSpace && errdefs.IsNoSpace(err)
		}
		if noSpace {
			return errdefs.ErrNoSpace
		}
		// Every node tried passed the filter (healthy, schedulable) and
		// refused with a retryable error: the cluster cannot take the
		// sandbox right now, which the client should retry (429), not
		// an outage (503).
		return errdefs.ErrResourceExhausted
	}
	if len(rejs) == 0 {
		return errdefs.ErrUnavailable
	}
	all := func(kind error) bool {
		for _, r := range rejs {
			if !errors.Is(r.kind, kind) {
				return false
			}
		}
		return true
	}
	for _, k := range []error{errdefs.ErrNotFound, errdefs.ErrUnavailable, errdefs.ErrFailedPrecondition, errdefs.ErrInvalidArgument} {
		if all(k) {
			return k
		}
	}
	// Mixed reasons: if any healthy node only lacked room, say so.
	for _, r := range rejs {
		if errors.Is(r.kind, errdefs.ErrResourceExhausted) {
			return errdefs.ErrResourceExhausted
		}
	}
	for _, r := range rejs {
		if errors.Is(r.kind, errdefs.ErrNotFound) {
			return errdefs.ErrNotFound
		}
	}
	return errdefs.ErrUnavailable
}

// Retryable reports whether a node's refusal means "try another node".
func Retryable(err error) bool {
	return errdefs.IsResourceExhausted(err) || errdefs.IsUnavailable(err)
}

// Place ranks nodes for req and calls try on each candidate, best first,
// until one succeeds, returning that node. See the package comment for
// which errors move on to the next node.
func (s *Scheduler) Place(ctx context.Context, nodes []*Node, req Request, try func(context.Context, *Node) error) (*Node, error) {
	cands, rejs := s.Rank(nodes, req)
	if len(cands) == 0 {
		return nil, &NoNodeError{Rejections: rejs, kind: classify(rejs, nil)}
	}
	refusals := map[string]error{}
	for i, c := range cands {
		if s.cfg.MaxAttempts > 0 && i >= s.cfg.MaxAttempts {
			break
		}
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		err := try(ctx, c.Node)
		if err == nil {
			return c.Node, nil
		}
		if !Retryable(err) || errors.Is(err, context.Canceled) {
			return nil, err
		}
		refusals[c.Node.ID] = err
	}
	return nil, &NoNodeError{Rejections: rejs, Refusals: refusals, kind: classify(rejs, refusals)}
}
