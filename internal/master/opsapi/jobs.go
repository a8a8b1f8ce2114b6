package opsapi

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"sort"
	"sync"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
)

// Long operations (a template import, a warm, a node drain) run as jobs:
// the request that starts one answers 202 with the job at once, the work
// goes on in the master without the request, and the console polls
// GET /jobs/{id} for its steps until it ends. A job runs at most jobLimit
// and can be cancelled; the last jobsKeep finished jobs stay readable.

const (
	jobLimit = 2 * time.Hour
	jobsKeep = 100
)

// Job states.
const (
	jobRunning   = "running"
	jobDone      = "done"
	jobFailed    = "failed"
	jobCancelled = "cancelled"
)

type jobStep struct {
	T     int64  `json:"t"` // Unix ms
	Level string `json:"level"`
	Text  string `json:"text"`
}

// jobJSON is a job as the API shows it.
type jobJSON struct {
	ID       string    `json:"id"`
	Kind     string    `json:"kind"`
	Target   string    `json:"target"`
	By       string    `json:"by"`
	State    string    `json:"state"`
	Steps    []jobStep `json:"steps"`
	Error    string    `json:"error,omitempty"`
	Started  time.Time `json:"started"`
	Ended    time.Time `json:"ended,omitzero"`
	Done     int       `json:"done"`  // units of work finished (nodes, sandboxes)
	Total    int       `json:"total"` // units known so far; 0 when not countable
	Progress string    `json:"progress,omitempty"`
}

type job struct {
	mu     sync.Mutex
	j      jobJSON
	team   string // the starter's team; "" for the admin
	cancel context.CancelFunc
}

func (jb *job) step(level, format string, args ...any) {
	jb.mu.Lock()
	defer jb.mu.Unlock()
	jb.j.Steps = append(jb.j.Steps, jobStep{T: time.Now().UnixMilli(), Level: level, Text: fmt.Sprintf(format, args...)})
}

func (jb *job) count(done, total int) {
	jb.mu.Lock()
	defer jb.mu.Unlock()
	jb.j.Done, jb.j.Total = done, total
}

func (jb *job) view() jobJSON {
	jb.mu.Lock()
	defer jb.mu.Unlock()
	v := jb.j
	v.Steps = append(make([]jobStep, 0, len(jb.j.Steps)), jb.j.Steps...)
	if v.Total > 0 {
		v.Progress = fmt.Sprintf("%d/%d", v.Done, v.Total)
	}
	return v
}

type jobs struct {
	mu sync.Mutex
	m  map[string]*job
	// running counts the jobs' goroutines, for Wait.
	running sync.WaitGroup
}

// Wait returns once every job started so far has ended: after Done is
// closed, so that the master's service outlives the work of its jobs.
func (h *Handler) Wait() { h.jobs.running.Wait() }

func newJobs() *jobs { return &jobs{m: map[string]*job{}} }

// start runs fn as a job of r's caller. fn's context carries the
// request's values (the caller's team scope) but not its cancellation; it
// ends at jobLimit, on a cancel, or when the master shuts down (Done).
func (h *Handler) start(r *http.Request, kind, target string, fn func(ctx context.Context, jb *job) error) *job {
	c := callerOf(r)
	ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), jobLimit)
	jb := &job{j: jobJSON{ID: newToken()[:16], Kind: kind, Target: target, By: c.user, State: jobRunning, Started: time.Now()}, cancel: cancel}
	if c.key != nil {
		jb.team = c.key.Team
	}
	h.jobs.mu.Lock()
	h.jobs.m[jb.j.ID] = jb
	h.jobs.prune()
	h.jobs.mu.Unlock()
	h.record(r, kind+" started", target, "", nil)
	by, remote := c, r.RemoteAddr
	h.jobs.running.Add(1)
	go func() {
		defer h.jobs.running.Done()
		defer cancel()
		if h.cfg.Done != nil {
			stop := make(chan struct{})
			defer close(stop)
			go func() {
				select {
				case <-h.cfg.Done:
					cancel()
				case <-stop:
				}
			}()
		}
		err := fn(ctx, jb)
		jb.mu.Lock()
		jb.j.Ended = time.Now()
		switch {
		case err == nil:
			jb.j.State = jobDone
		case errors.Is(ctx.Err(), context.Canceled):
			jb.j.State, jb.j.Error = jobCancelled, err.Error()
		default:
			jb.j.State, jb.j.Error = jobFailed, err.Error()
		}
		state := jb.j.State
		jb.mu.Unlock()
		e := auditEntry{T: time.Now().UnixMilli(), By: by.user, Admin: by.admin, Team: jb.team, Action: kind + " " + state,
			Target: target, OK: err == nil, Remote: remote}
		if err != nil {
			e.Error = err.Error()
		}
		h.trail.add(e)
		h.log.Info("audit", "by", by.user, "action", "console "+kind, "target", target, "state", state, "err", e.Error)
	}()
	return jb
}

// prune drops the oldest finished jobs beyond jobsKeep; h.jobs.mu held.
func (js *jobs) prune() {
	var ended []*job
	for _, jb := range js.m {
		if v := jb.view(); v.State != jobRunning {
			ended = append(ended, jb)
		}
	}
	if len(ended) <= jobsKeep {
		return
	}
	sort.Slice(ended, func(i, j int) bool { return ended[i].view().Ended.Before(ended[j].view().Ended) })
	for _, jb := range ended[:len(ended)-jobsKeep] {
		delete(js.m, jb.j.ID)
	}
}

// visible is the job id if r's caller may see it (its team's, or any for
// the admin); another team's is not found.
func (h *Handler) visible(r *http.Request, id string) (*job, error) {
	h.jobs.mu.Lock()
	jb := h.jobs.m[id]
	h.jobs.mu.Unlock()
	c := callerOf(r)
	if jb == nil || (!c.admin && (c.key == nil || c.key.Team != jb.team)) {
		return nil, fmt.Errorf("job %q: %w", id, errdefs.ErrNotFound)
	}
	return jb, nil
}

func (h *Handler) listJobs(w http.ResponseWriter, r *http.Request) {
	c := callerOf(r)
	h.jobs.mu.Lock()
	out := []jobJSON{}
	for _, jb := range h.jobs.m {
		if c.admin || (c.key != nil && c.key.Team == jb.team) {
			out = append(out, jb.view())
		}
	}
	h.jobs.mu.Unlock()
	sort.Slice(out, func(i, j int) bool { return out[i].Started.After(out[j].Started) })
	writeJSON(w, http.StatusOK, out)
}

func (h *Handler) getJob(w http.ResponseWriter, r *http.Request) {
	jb, err := h.visible(r, r.PathValue("jobID"))
	if err != nil {
		writeError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, jb.view())
}

func (h *Handler) cancelJob(w http.ResponseWriter, r *http.Request) {
	jb, err := h.visible(r, r.PathValue("jobID"))
	if err != nil {
		writeError(w, err)
		return
	}
	jb.step("warn", "cancel asked by %s", callerOf(r).user)
	jb.cancel()
	h.record(r, "cancel "+jb.j.Kind, jb.j.Target, jb.team, nil)
	w.WriteHeader(http.StatusNoContent)
}
