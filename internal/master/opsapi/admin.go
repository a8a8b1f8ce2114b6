package opsapi

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/master"
	"github.com/cubesandbox/cube/internal/master/catalog"
)

// The admin's pages: node drain, template import, warm and delete, API
// keys and teams. authed refuses them to team users (403).

func decode(w http.ResponseWriter, r *http.Request, v any) error {
	if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, 1<<16)).Decode(v); err != nil {
		return fmt.Errorf("request body: %v: %w", err, errdefs.ErrInvalidArgument)
	}
	return nil
}

// drain starts a job draining the node: cordoned, then its sandboxes
// moved elsewhere, one step per sandbox (master.Service.Drain).
func (h *Handler) drain(w http.ResponseWriter, r *http.Request) {
	var body struct {
		Wait     bool `json:"wait"`
		Parallel int  `json:"parallel"`
	}
	if r.ContentLength != 0 {
		if err := decode(w, r, &body); err != nil {
			writeError(w, err)
			return
		}
	}
	node := r.PathValue("nodeID")
	jb := h.start(r, "drain", node, func(ctx context.Context, jb *job) error {
		jb.step("info", "draining %s: each sandbox must have a node to go to; then it is cordoned and they move", node)
		err := h.b.Drain(ctx, node, master.DrainOptions{Wait: body.Wait, Parallel: body.Parallel}, func(ev master.DrainEvent) {
			jb.count(ev.Total-ev.Remaining, ev.Total)
			switch ev.Phase {
			case master.DrainMoving:
				jb.step("info", "%s (%s): moving", ev.SandboxID, ev.State)
			case master.DrainMoved:
				jb.step("info", "%s: moved to %s in %s", ev.SandboxID, ev.To, ev.Took.Round(time.Millisecond))
			case master.DrainFailed:
				jb.step("error", "%s: move failed, left on the node: %s", ev.SandboxID, ev.Err)
			case master.DrainWaiting:
				jb.step("info", "%s: running; waiting for it to end", ev.SandboxID)
			case master.DrainEnded:
				jb.step("info", "%s: ended", ev.SandboxID)
			case master.DrainDone:
				jb.step("info", "%s holds none of its sandboxes", node)
			}
		})
		if err == nil {
			jb.step("info", "drained; %s stays cordoned until uncordoned", node)
		}
		return err
	})
	writeJSON(w, http.StatusAccepted, jb.view())
}

type templateJSON struct {
	ID        string            `json:"id"`
	Aliases   []string          `json:"aliases"`
	Nodes     []string          `json:"nodes"`
	WarmNodes []string          `json:"warmNodes"`
	Runtimes  map[string]string `json:"runtimes,omitempty"`
	Stored    bool              `json:"stored"`
	SizeBytes int64             `json:"sizeBytes"`
	CreatedAt time.Time         `json:"createdAt"`
}

func templateOf(t master.Template) templateJSON {
	return templateJSON{ID: t.ID, Aliases: nonNil(t.Aliases), Nodes: nonNil(t.Nodes), WarmNodes: nonNil(t.WarmNodes), Runtimes: t.Runtimes,
		Stored: t.Stored, SizeBytes: t.SizeBytes, CreatedAt: t.CreatedAt}
}

func nonNil(s []string) []string {
	if s == nil {
		return []string{}
	}
	return s
}

// importTemplate starts a job importing a template from a path on the
// master (an OCI layout or an image archive) or a registry image, onto
// one node or every healthy node. Its steps follow the template onto the
// nodes as their reports show it.
func (h *Handler) importTemplate(w http.ResponseWriter, r *http.Request) {
	var body struct {
		ID       string `json:"id"`
		Source   string `json:"source"`
		ImageRef string `json:"imageRef"`
		NodeID   string `json:"nodeID"`
		Runtime  string `json:"runtime"`
		Warm     bool   `json:"warm"`
		Insecure bool   `json:"insecure"`
	}
	if err := decode(w, r, &body); err != nil {
		writeError(w, err)
		return
	}
	if body.ID == "" || (body.Source == "") == (body.ImageRef == "") {
		writeError(w, fmt.Errorf("want {\"id\", and \"source\" (a path on the master) or \"imageRef\"}: %w", errdefs.ErrInvalidArgument))
		return
	}
	want := 0
	if body.NodeID != "" {
		want = 1
	} else if ns, err := h.b.Nodes(r.Context()); err == nil {
		for _, n := range ns {
			if n.Healthy {
				want++
			}
		}
	}
	req := master.TemplateImport{ID: body.ID, Source: body.Source, ImageRef: body.ImageRef, NodeID: body.NodeID,
		Runtime: body.Runtime, Warm: body.Warm, Insecure: body.Insecure}
	from := body.Source
	if from == "" {
		from = body.ImageRef
	}
	jb := h.start(r, "template import", body.ID, func(ctx context.Context, jb *job) error {
		jb.step("info", "importing %s from %s onto %d node(s)%s", body.ID, from, want, map[bool]string{true: ", then warming"}[body.Warm])
		jb.count(0, want)
		// The import is one call; its progress is the template showing
		// on the nodes, looked at while it runs.
		watch, stop := context.WithCancel(ctx)
		defer stop()
		go func() {
			seen := map[string]bool{}
			t := time.NewTicker(500 * time.Millisecond)
			defer t.Stop()
			for {
				select {
				case <-watch.Done():
					return
				case <-t.C:
				}
				for _, tm := range h.b.Templates() {
					if tm.ID != body.ID {
						continue
					}
					for _, n := range tm.Nodes {
						if !seen[n] {
							seen[n] = true
							jb.step("info", "on node %s", n)
						}
					}
					jb.count(len(seen), max(want, len(seen)))
				}
			}
		}()
		t, err := h.b.ImportTemplate(ctx, req)
		stop()
		if err != nil {
			return err
		}
		jb.count(len(t.Nodes), max(want, len(t.Nodes)))
		jb.step("info", "imported: on %d node(s) %v, warm on %v", len(t.Nodes), t.Nodes, nonNil(t.WarmNodes))
		return nil
	})
	writeJSON(w, http.StatusAccepted, jb.view())
}

// maxTemplateUpload bounds an image archive sent through the console.
const maxTemplateUpload = 16 << 30

// uploadTemplate imports the image archive (OCI or docker) in the body:
// the master spools it into its template store and the nodes pull it
// (master.Service.ImportUpload). It answers when the import is done; the
// browser shows the upload's own progress while it is sent. Query:
// nodeID, runtime, warm=1.
func (h *Handler) uploadTemplate(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	id := r.PathValue("templateID")
	if r.ContentLength > maxTemplateUpload {
		writeError(w, fmt.Errorf("an archive of %d bytes: at most %d through the console: %w", r.ContentLength, int64(maxTemplateUpload), errTooLarge))
		return
	}
	start := time.Now()
	t, err := h.b.ImportUpload(r.Context(), master.TemplateImport{ID: id, NodeID: q.Get("nodeID"), Runtime: q.Get("runtime"), Warm: q.Get("warm") == "1"},
		http.MaxBytesReader(w, r.Body, maxTemplateUpload))
	if mbe := (*http.MaxBytesError)(nil); errors.As(err, &mbe) {
		err = fmt.Errorf("an archive over %d bytes: at most %d through the console: %w", mbe.Limit, int64(maxTemplateUpload), errTooLarge)
	}
	h.record(r, "template upload", id, "", err)
	if err != nil {
		writeError(w, err)
		return
	}
	h.log.Info("ops: template uploaded", "template_id", id, "bytes", r.ContentLength, "took", time.Since(start))
	writeJSON(w, http.StatusCreated, templateOf(t))
}

// warmTemplate starts a job warming a template on every node holding it.
func (h *Handler) warmTemplate(w http.ResponseWriter, r *http.Request) {
	var body struct {
		Runtime string `json:"runtime"`
	}
	if r.ContentLength != 0 {
		if err := decode(w, r, &body); err != nil {
			writeError(w, err)
			return
		}
	}
	id := r.PathValue("templateID")
	t, err := h.b.GetTemplate(r.Context(), id)
	if err != nil {
		writeError(w, err)
		return
	}
	jb := h.start(r, "template warm", t.ID, func(ctx context.Context, jb *job) error {
		done := 0
		jb.count(0, len(t.Nodes))
		jb.step("info", "warming %s on %d node(s): a boot and a memory snapshot on each", t.ID, len(t.Nodes))
		_, err := h.b.WarmTemplate(ctx, t.ID, body.Runtime, func(node string, err error) {
			done++
			jb.count(done, len(t.Nodes))
			if err != nil {
				jb.step("error", "%s: %v", node, err)
				return
			}
			jb.step("info", "%s: warm", node)
		})
		return err
	})
	writeJSON(w, http.StatusAccepted, jb.view())
}

func (h *Handler) deleteTemplate(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("templateID")
	// Snapshots go through their own page: this deletes templates only.
	if _, err := h.b.GetTemplate(r.Context(), id); err != nil {
		writeError(w, err)
		return
	}
	nodes, err := h.b.DeleteTemplate(r.Context(), id)
	h.record(r, "template delete", id, "", err)
	if err != nil {
		writeError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"nodes": nonNil(nodes)})
}

type keyJSON struct {
	ID         string    `json:"id"`
	Name       string    `json:"name"`
	Prefix     string    `json:"prefix"`
	Team       string    `json:"team"`
	Admin      bool      `json:"admin"`
	CreatedAt  time.Time `json:"createdAt"`
	LastUsedAt time.Time `json:"lastUsedAt,omitzero"`
	Secret     string    `json:"secret,omitempty"` // at create only
}

func keyOf(k *catalog.APIKey) keyJSON {
	return keyJSON{ID: k.ID, Name: k.Name, Prefix: k.Prefix, Team: k.Team, Admin: k.Admin, CreatedAt: k.CreatedAt, LastUsedAt: k.LastUsedAt}
}

func (h *Handler) listKeys(w http.ResponseWriter, r *http.Request) {
	ks, err := h.b.Keys().List(r.Context())
	if err != nil {
		writeError(w, err)
		return
	}
	out := make([]keyJSON, 0, len(ks))
	for _, k := range ks {
		out = append(out, keyOf(k))
	}
	writeJSON(w, http.StatusOK, out)
}

// createKey issues a key; its secret is in this answer only.
func (h *Handler) createKey(w http.ResponseWriter, r *http.Request) {
	var body struct {
		Name  string `json:"name"`
		Team  string `json:"team"`
		Admin bool   `json:"admin"`
	}
	if err := decode(w, r, &body); err != nil {
		writeError(w, err)
		return
	}
	k, secret, err := h.b.Keys().Create(r.Context(), body.Name, body.Team, body.Admin)
	h.record(r, "api key create", body.Name, body.Team, err)
	if err != nil {
		writeError(w, err)
		return
	}
	out := keyOf(k)
	out.Secret = secret
	writeJSON(w, http.StatusCreated, out)
}

func (h *Handler) deleteKey(w http.ResponseWriter, r *http.Request) {
	k, err := h.b.Keys().Delete(r.Context(), r.PathValue("keyID"))
	team := ""
	if k != nil {
		team = k.Team
	}
	h.record(r, "api key delete", r.PathValue("keyID"), team, err)
	if err != nil {
		writeError(w, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

type quotaJSON struct {
	MaxSandboxes int64 `json:"maxSandboxes"`
	MaxMilliCPU  int64 `json:"maxMilliCPU"`
	MaxMemoryMiB int64 `json:"maxMemoryMiB"`
}

type teamJSON struct {
	Name      string    `json:"name"`
	CreatedAt time.Time `json:"createdAt"`
	Quota     quotaJSON `json:"quota"`
	Sandboxes int64     `json:"sandboxes"`
	MilliCPU  int64     `json:"milliCPU"`
	MemoryMiB int64     `json:"memoryMiB"`
	Keys      int       `json:"keys"`
}

func (h *Handler) listTeams(w http.ResponseWriter, r *http.Request) {
	ts, usage, err := h.b.ListTeams(r.Context())
	if err != nil {
		writeError(w, err)
		return
	}
	ks, err := h.b.Keys().List(r.Context())
	if err != nil {
		writeError(w, err)
		return
	}
	keys := map[string]int{}
	for _, k := range ks {
		team := k.Team
		if team == "" {
			team = catalog.DefaultTeam
		}
		keys[team]++
	}
	out := make([]teamJSON, 0, len(ts))
	for _, t := range ts {
		u := usage[t.Name]
		out = append(out, teamJSON{Name: t.Name, CreatedAt: t.CreatedAt, Keys: keys[t.Name],
			Quota:     quotaJSON{MaxSandboxes: t.Quota.MaxSandboxes, MaxMilliCPU: t.Quota.MaxMilliCPU, MaxMemoryMiB: t.Quota.MaxMemoryMiB},
			Sandboxes: u.Sandboxes, MilliCPU: u.MilliCPU, MemoryMiB: u.MemoryMiB})
	}
	slices.SortFunc(out, func(a, b teamJSON) int {
		if a.Name < b.Name {
			return -1
		}
		return 1
	})
	writeJSON(w, http.StatusOK, out)
}

func (h *Handler) createTeam(w http.ResponseWriter, r *http.Request) {
	var body struct {
		Name  string    `json:"name"`
		Quota quotaJSON `json:"quota"`
	}
	if err := decode(w, r, &body); err != nil {
		writeError(w, err)
		return
	}
	q := catalog.Quota{MaxSandboxes: body.Quota.MaxSandboxes, MaxMilliCPU: body.Quota.MaxMilliCPU, MaxMemoryMiB: body.Quota.MaxMemoryMiB}
	t, err := h.b.CreateTeam(r.Context(), body.Name, q)
	h.record(r, "team create", body.Name, body.Name, err)
	if err != nil {
		writeError(w, err)
		return
	}
	writeJSON(w, http.StatusCreated, teamJSON{Name: t.Name, CreatedAt: t.CreatedAt, Quota: body.Quota})
}

func (h *Handler) setQuota(w http.ResponseWriter, r *http.Request) {
	var q quotaJSON
	if err := decode(w, r, &q); err != nil {
		writeError(w, err)
		return
	}
	team := r.PathValue("team")
	err := h.b.SetTeamQuota(r.Context(), team, catalog.Quota{MaxSandboxes: q.MaxSandboxes, MaxMilliCPU: q.MaxMilliCPU, MaxMemoryMiB: q.MaxMemoryMiB})
	h.record(r, "team quota", team, team, err)
	if err != nil {
		writeError(w, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// deleteTeam removes a team and revokes its keys; with ?force=1 its
// sandboxes are killed and its snapshots deleted first.
func (h *Handler) deleteTeam(w http.ResponseWriter, r *http.Request) {
	team := r.PathValue("team")
	force := r.URL.Query().Get("force") == "1"
	d, err := h.b.DeleteTeam(r.Context(), team, force, "console admin "+callerOf(r).user)
	h.record(r, "team delete", team, team, err)
	if err != nil {
		writeError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"revokedKeys": len(d.Keys), "killedSandboxes": nonNil(d.Sandboxes), "deletedSnapshots": nonNil(d.Snapshots)})
}
