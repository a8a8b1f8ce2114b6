package report

import (
	"sync"
	"time"
)

// ActionStat is the latency of one workflow action inside cubelet, from
// the timings every lifecycle RPC returns. Set against the RPC's own
// latency it shows where the time goes, and how much is outside every
// action (gRPC, validation, the state store, the engine).
type ActionStat struct {
	Action  string  `json:"action"` // flow/step/action, e.g. create/3/container
	Latency Summary `json:"latency"`
}

// ActionTimes collects action timings across the calls of a scenario,
// keyed flow/step/action, in the order first seen. A nil *ActionTimes
// ignores what it is given.
type ActionTimes struct {
	mu    sync.Mutex
	m     map[string][]time.Duration
	order []string
}

// Add records one timing of the action key.
func (a *ActionTimes) Add(key string, d time.Duration) {
	if a == nil {
		return
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.m == nil {
		a.m = map[string][]time.Duration{}
	}
	if _, ok := a.m[key]; !ok {
		a.order = append(a.order, key)
	}
	a.m[key] = append(a.m[key], d)
}

// Merge adds o's timings (o may be nil).
func (a *ActionTimes) Merge(o *ActionTimes) {
	if o == nil {
		return
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.m == nil {
		a.m = map[string][]time.Duration{}
	}
	for _, k := range o.order {
		if _, ok := a.m[k]; !ok {
			a.order = append(a.order, k)
		}
		a.m[k] = append(a.m[k], o.m[k]...)
	}
}

// Stats summarises each action's timings.
func (a *ActionTimes) Stats() []ActionStat {
	if a == nil {
		return nil
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	var out []ActionStat
	for _, k := range a.order {
		out = append(out, ActionStat{Action: k, Latency: Summarize(a.m[k])})
	}
	return out
}
