package opsapi

import (
	"encoding/json"
	"fmt"
	"net/http"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/master"
	"github.com/cubesandbox/cube/internal/master/catalog"
)

type nodeJSON struct {
	ID            string    `json:"id"`
	Hostname      string    `json:"hostname"`
	Version       string    `json:"version"`
	Healthy       bool      `json:"healthy"`
	Reason        string    `json:"reason,omitempty"`
	Schedulable   bool      `json:"schedulable"`
	Sandboxes     int       `json:"sandboxes"`
	CPUs          int32     `json:"cpus"`
	MemoryBytes   int64     `json:"memoryBytes"`
	MaxMilliCPU   int64     `json:"maxMilliCPU"`
	MaxMemoryMiB  int64     `json:"maxMemoryMiB"`
	AllocMilliCPU int64     `json:"allocatedMilliCPU"`
	AllocMemMiB   int64     `json:"allocatedMemoryMiB"`
	StorageTotal  int64     `json:"storageTotalBytes"`
	StorageFree   int64     `json:"storageFreeBytes"`
	LastHeartbeat time.Time `json:"lastHeartbeat"`
}

func (h *Handler) nodes(w http.ResponseWriter, r *http.Request) {
	ns, err := h.b.Nodes(r.Context())
	if err != nil {
		writeError(w, err)
		return
	}
	out := make([]nodeJSON, 0, len(ns))
	for _, n := range ns {
		rep := n.Report
		out = append(out, nodeJSON{
			ID: rep.GetNodeId(), Hostname: rep.GetHostname(), Version: rep.GetVersion(), Healthy: n.Healthy, Reason: n.Reason,
			Schedulable: n.Schedulable, Sandboxes: n.Sandboxes, CPUs: rep.GetCpus(), MemoryBytes: rep.GetMemoryBytes(),
			MaxMilliCPU: rep.GetMaxMilliCpu(), MaxMemoryMiB: rep.GetMaxMemoryMib(), AllocMilliCPU: rep.GetAllocatedMilliCpu(),
			AllocMemMiB: rep.GetAllocatedMemoryMib(), StorageTotal: rep.GetStorageTotalBytes(), StorageFree: rep.GetStorageFreeBytes(),
			LastHeartbeat: n.LastHeartbeat,
		})
	}
	writeJSON(w, http.StatusOK, out)
}

func (h *Handler) cordon(on bool) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		_, err := h.b.SetSchedulable(r.Context(), r.PathValue("nodeID"), on)
		h.record(r, map[bool]string{true: "uncordon", false: "cordon"}[on], r.PathValue("nodeID"), "", err)
		if err != nil {
			writeError(w, err)
			return
		}
		w.WriteHeader(http.StatusNoContent)
	}
}

type sandboxJSON struct {
	ID         string            `json:"id"`
	TemplateID string            `json:"templateID"`
	Alias      string            `json:"alias,omitempty"`
	NodeID     string            `json:"nodeID"`
	State      string            `json:"state"`
	Runtime    string            `json:"runtime"`
	Team       string            `json:"team"`
	MilliCPU   int64             `json:"milliCPU"`
	MemoryMiB  int64             `json:"memoryMiB"`
	StartedAt  time.Time         `json:"startedAt"`
	EndAt      time.Time         `json:"endAt"`
	Metadata   map[string]string `json:"metadata,omitempty"`
}

func sandboxOf(sb *catalog.Sandbox) sandboxJSON {
	return sandboxJSON{
		ID: sb.ID, TemplateID: sb.TemplateID, Alias: sb.Alias, NodeID: sb.NodeID, State: sb.State, Runtime: sb.Runtime,
		Team: sb.Team, MilliCPU: sb.MilliCPU, MemoryMiB: sb.MemoryMiB, StartedAt: sb.StartedAt, EndAt: sb.EndAt, Metadata: sb.Metadata,
	}
}

// list is every running and paused sandbox the caller may see, newest
// first, filtered by q (a substring of ID, template, node or team).
func (h *Handler) list(r *http.Request, q string) ([]sandboxJSON, error) {
	sbs, _, err := h.b.List(r.Context(), catalog.Query{})
	if err != nil {
		return nil, err
	}
	out := make([]sandboxJSON, 0, len(sbs))
	for _, sb := range sbs {
		if q != "" && !strings.Contains(sb.ID+" "+sb.TemplateID+" "+sb.Alias+" "+sb.NodeID+" "+sb.Team, q) {
			continue
		}
		out = append(out, sandboxOf(sb))
	}
	return out, nil
}

func (h *Handler) sandboxes(w http.ResponseWriter, r *http.Request) {
	out, err := h.list(r, r.URL.Query().Get("q"))
	if err != nil {
		writeError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, out)
}

func (h *Handler) create(w http.ResponseWriter, r *http.Request) {
	var body struct {
		Template string `json:"template"`
		Timeout  int64  `json:"timeoutSeconds"`
		Runtime  string `json:"runtime"`
	}
	if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, 1<<16)).Decode(&body); err != nil || body.Template == "" {
		writeError(w, fmt.Errorf("want {\"template\": ...}: %w", errdefs.ErrInvalidArgument))
		return
	}
	req := master.CreateRequest{Template: body.Template, Timeout: time.Duration(body.Timeout) * time.Second, Runtime: body.Runtime}
	if c := callerOf(r); c.key != nil {
		req.APIKeyID = c.key.ID
	}
	sb, err := h.b.Create(r.Context(), req)
	if err != nil {
		h.record(r, "create", body.Template, "", err)
		writeError(w, err)
		return
	}
	h.audit(r, sb.ID, sb.Team, "create")
	writeJSON(w, http.StatusCreated, sandboxOf(sb))
}

// audit records who did what: an API key as on the E2B API, the admin by
// name in the master's log.
// It also goes to the console's audit log (audit.go), with the
// sandbox's team so that team sees what the admin did to it.
func (h *Handler) audit(r *http.Request, id, team, action string) {
	h.trail.add(auditEntry{T: time.Now().UnixMilli(), By: callerOf(r).user, Admin: callerOf(r).admin, Team: team, Action: action,
		Target: id, OK: true, Remote: r.RemoteAddr})
	c := callerOf(r)
	if c.key != nil {
		h.b.Audit(r.Context(), id, action+" (console)", c.key)
		return
	}
	h.log.Info("audit", "sandbox_id", id, "action", action+" (console)", "admin", c.user)
}

func (h *Handler) sandbox(w http.ResponseWriter, r *http.Request) {
	sb, err := h.b.Get(r.Context(), r.PathValue("sandboxID"))
	if err != nil {
		writeError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, sandboxOf(sb))
}

type metricJSON struct {
	T          int64   `json:"t"` // Unix ms
	CPUCount   int     `json:"cpuCount"`
	CPUUsedPct float64 `json:"cpuUsedPct"`
	MemUsed    int64   `json:"memUsed"`
	MemCache   int64   `json:"memCache"`
	MemTotal   int64   `json:"memTotal"`
	Tasks      int64   `json:"tasks"`
	DiskUsed   int64   `json:"diskUsed"`
	DiskTotal  int64   `json:"diskTotal"`
	NetRx      int64   `json:"netRx"`
	NetTx      int64   `json:"netTx"`
}

func (h *Handler) metrics(w http.ResponseWriter, r *http.Request) {
	var since time.Time
	if v := r.URL.Query().Get("since"); v != "" {
		ms, err := strconv.ParseInt(v, 10, 64)
		if err != nil {
			writeError(w, fmt.Errorf("since %q: %w", v, errdefs.ErrInvalidArgument))
			return
		}
		since = time.UnixMilli(ms)
	}
	ms, err := h.b.Metrics(r.Context(), r.PathValue("sandboxID"), since, time.Time{})
	if err != nil {
		writeError(w, err)
		return
	}
	out := make([]metricJSON, 0, len(ms))
	for _, m := range ms {
		out = append(out, metricOf(m))
	}
	writeJSON(w, http.StatusOK, out)
}

func metricOf(m master.Metric) metricJSON {
	return metricJSON{T: m.Timestamp.UnixMilli(), CPUCount: m.CPUCount, CPUUsedPct: m.CPUUsedPct, MemUsed: m.MemUsed,
		MemCache: m.MemCache, MemTotal: m.MemTotal, Tasks: m.Tasks, DiskUsed: m.DiskUsed, DiskTotal: m.DiskTotal, NetRx: m.NetRx, NetTx: m.NetTx}
}

type logJSON struct {
	T       int64             `json:"t"`
	Level   string            `json:"level"`
	Message string            `json:"message"`
	Fields  map[string]string `json:"fields,omitempty"`
}

// logs pages the sandbox's log newest first: before (Unix ms,
// inclusive) and limit.
func (h *Handler) logs(w http.ResponseWriter, r *http.Request) {
	q := catalog.EventQuery{SandboxID: r.PathValue("sandboxID"), Backward: true, Limit: 200}
	if v := r.URL.Query().Get("before"); v != "" {
		ms, err := strconv.ParseInt(v, 10, 64)
		if err != nil {
			writeError(w, fmt.Errorf("before %q: %w", v, errdefs.ErrInvalidArgument))
			return
		}
		q.Since = time.UnixMilli(ms)
	}
	evs, err := h.b.SandboxLog(r.Context(), q)
	if err != nil {
		writeError(w, err)
		return
	}
	out := make([]logJSON, 0, len(evs))
	for _, e := range evs {
		out = append(out, logJSON{T: e.At.UnixMilli(), Level: e.Level, Message: e.Message, Fields: e.Fields})
	}
	writeJSON(w, http.StatusOK, out)
}

func (h *Handler) verb(name string) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		id := r.PathValue("sandboxID")
		team := ""
		if sb, err := h.b.Get(r.Context(), id); err == nil {
			team = sb.Team
		}
		var err error
		switch name {
		case "pause":
			err = h.b.Pause(r.Context(), id)
		case "resume":
			_, err = h.b.Resume(r.Context(), id, 0)
		case "kill":
			err = h.b.Kill(r.Context(), id)
		}
		if err != nil {
			h.record(r, name, id, team, err)
			writeError(w, err)
			return
		}
		h.audit(r, id, team, name) // a kill's goes to the master's log: the row and its events are gone
		w.WriteHeader(http.StatusNoContent)
	}
}

type snapshotJSON struct {
	ID         string    `json:"id"`
	Name       string    `json:"name,omitempty"`
	SandboxID  string    `json:"sandboxID"`
	TemplateID string    `json:"templateID"`
	NodeID     string    `json:"nodeID"`
	HasMemory  bool      `json:"hasMemory"`
	CreatedAt  time.Time `json:"createdAt"`
	Team       string    `json:"team"`
}

func (h *Handler) snapshot(w http.ResponseWriter, r *http.Request) {
	var body struct {
		Name string `json:"name"`
	}
	_ = json.NewDecoder(http.MaxBytesReader(w, r.Body, 4096)).Decode(&body)
	id := r.PathValue("sandboxID")
	snap, err := h.b.Snapshot(r.Context(), id, body.Name)
	if err != nil {
		h.record(r, "snapshot", id, "", err)
		writeError(w, err)
		return
	}
	h.audit(r, id, snap.Team, "snapshot")
	writeJSON(w, http.StatusCreated, snapshotOf(snap))
}

// fork starts count (1 by default, at most 10) copies of a running
// sandbox from a snapshot of it; each succeeds or fails on its own.
func (h *Handler) fork(w http.ResponseWriter, r *http.Request) {
	var body struct {
		Count int `json:"count"`
	}
	if r.ContentLength != 0 {
		if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, 4096)).Decode(&body); err != nil {
			writeError(w, fmt.Errorf("fork body: %v: %w", err, errdefs.ErrInvalidArgument))
			return
		}
	}
	if body.Count == 0 {
		body.Count = 1
	}
	if body.Count < 0 || body.Count > 10 {
		writeError(w, fmt.Errorf("count %d: 1 to 10 from the console: %w", body.Count, errdefs.ErrInvalidArgument))
		return
	}
	id := r.PathValue("sandboxID")
	res, err := h.b.Fork(r.Context(), id, body.Count, 0)
	if err != nil {
		h.record(r, "fork", id, "", err)
		writeError(w, err)
		return
	}
	out := struct {
		Sandboxes []sandboxJSON `json:"sandboxes"`
		Errors    []string      `json:"errors"`
	}{Sandboxes: []sandboxJSON{}, Errors: []string{}}
	for _, f := range res {
		if f.Err != nil {
			out.Errors = append(out.Errors, f.Err.Error())
			continue
		}
		out.Sandboxes = append(out.Sandboxes, sandboxOf(f.Sandbox))
		h.audit(r, f.Sandbox.ID, f.Sandbox.Team, "fork of "+id)
	}
	if len(out.Errors) > 0 {
		h.record(r, "fork", id, "", fmt.Errorf("%d of %d forks failed: %s", len(out.Errors), len(res), out.Errors[0]))
	}
	writeJSON(w, http.StatusCreated, out)
}

func snapshotOf(s *catalog.Snapshot) snapshotJSON {
	return snapshotJSON{ID: s.ID, Name: s.Name, SandboxID: s.SandboxID, TemplateID: s.TemplateID, NodeID: s.NodeID,
		HasMemory: s.HasMemory, CreatedAt: s.CreatedAt, Team: s.Team}
}

func (h *Handler) templates(w http.ResponseWriter, _ *http.Request) {
	ts := h.b.Templates()
	out := make([]templateJSON, 0, len(ts))
	for _, t := range ts {
		out = append(out, templateOf(t))
	}
	writeJSON(w, http.StatusOK, out)
}

// lineageNode is one node of the lineage tree: a template, a sandbox or a
// snapshot, with what came from it.
type lineageNode struct {
	Kind     string         `json:"kind"` // template, sandbox, snapshot
	ID       string         `json:"id"`
	Label    string         `json:"label"`
	State    string         `json:"state,omitempty"`
	Children []*lineageNode `json:"children"`
}

// lineage draws templates → sandboxes made from them → their snapshots →
// sandboxes made from those, for what the caller may see. A snapshot
// whose sandbox is gone hangs under its template.
func (h *Handler) lineage(w http.ResponseWriter, r *http.Request) {
	sbs, _, err := h.b.List(r.Context(), catalog.Query{})
	if err != nil {
		writeError(w, err)
		return
	}
	var snaps []*catalog.Snapshot
	for after := ""; ; {
		page, next, err := h.b.ListSnapshots(r.Context(), catalog.SnapshotQuery{Limit: 500, After: after})
		if err != nil {
			writeError(w, err)
			return
		}
		snaps = append(snaps, page...)
		if next == "" || len(page) == 0 {
			break
		}
		after = next
	}
	nodes := map[string]*lineageNode{}
	var roots []*lineageNode
	root := func(tmpl string) *lineageNode {
		k := "template/" + tmpl
		if n := nodes[k]; n != nil {
			return n
		}
		n := &lineageNode{Kind: "template", ID: tmpl, Label: tmpl, Children: []*lineageNode{}}
		nodes[k] = n
		roots = append(roots, n)
		return n
	}
	snapByID := map[string]*catalog.Snapshot{}
	for _, s := range snaps {
		snapByID[s.ID] = s
		if s.Name != "" {
			snapByID[s.Name] = s
		}
		label := s.ID
		if s.Name != "" {
			label = s.Name + " (" + s.ID + ")"
		}
		nodes["snapshot/"+s.ID] = &lineageNode{Kind: "snapshot", ID: s.ID, Label: label, Children: []*lineageNode{}}
	}
	for _, sb := range sbs {
		nodes["sandbox/"+sb.ID] = &lineageNode{Kind: "sandbox", ID: sb.ID, Label: sb.ID, State: sb.State, Children: []*lineageNode{}}
	}
	// Sandboxes hang under the snapshot or template they came from.
	sort.Slice(sbs, func(i, j int) bool { return sbs[i].StartedAt.Before(sbs[j].StartedAt) })
	for _, sb := range sbs {
		n := nodes["sandbox/"+sb.ID]
		from := sb.Alias
		if from == "" {
			from = sb.TemplateID
		}
		if s := snapByID[from]; s != nil {
			p := nodes["snapshot/"+s.ID]
			p.Children = append(p.Children, n)
			continue
		}
		p := root(sb.TemplateID)
		p.Children = append(p.Children, n)
	}
	sort.Slice(snaps, func(i, j int) bool { return snaps[i].CreatedAt.Before(snaps[j].CreatedAt) })
	for _, s := range snaps {
		n := nodes["snapshot/"+s.ID]
		if p := nodes["sandbox/"+s.SandboxID]; p != nil {
			p.Children = append(p.Children, n)
			continue
		}
		p := root(s.TemplateID)
		p.Children = append(p.Children, n)
	}
	if roots == nil {
		roots = []*lineageNode{}
	}
	writeJSON(w, http.StatusOK, roots)
}
