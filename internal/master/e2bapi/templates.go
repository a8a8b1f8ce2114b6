package e2bapi

import (
	"net/http"

	"github.com/cubesandbox/cube/internal/master"
)

// Templates are imported through the master or on nodes (cubecli
// template import), not built through this API: the build endpoints are
// not served. A template in the master's store that no node holds yet is
// "waiting" (no create can be placed).

func (h *Handler) templateJSON(t master.Template) templateJSON {
	names := append([]string{t.ID}, t.Aliases...)
	aliases := t.Aliases
	if aliases == nil {
		aliases = []string{}
	}
	status := "ready"
	if len(t.Nodes) == 0 {
		status = "waiting"
	}
	return templateJSON{
		TemplateID: t.ID, BuildID: t.Digest, BuildStatus: status, BuildCount: 1,
		CPUCount: cpuCount(h.cfg.MilliCPU), MemoryMB: h.cfg.MemoryMiB, DiskSizeMB: (t.SizeBytes + 1<<20 - 1) >> 20,
		EnvdVersion: h.cfg.EnvdVersion, Aliases: aliases, Names: names,
		CreatedAt: timeJSON(t.CreatedAt), UpdatedAt: timeJSON(t.CreatedAt),
		Runtime: t.CommonRuntime(), Warm: t.AllWarm(),
	}
}

func (h *Handler) listTemplates(w http.ResponseWriter, r *http.Request) {
	ts := h.b.Templates()
	out := make([]templateJSON, 0, len(ts))
	for _, t := range ts {
		out = append(out, h.templateJSON(t))
	}
	writeJSON(w, http.StatusOK, out)
}

func (h *Handler) getTemplate(w http.ResponseWriter, r *http.Request) {
	t, err := h.b.GetTemplate(r.Context(), r.PathValue("templateID"))
	if err != nil {
		writeError(w, err)
		return
	}
	tj := h.templateJSON(t)
	writeJSON(w, http.StatusOK, templateWithBuilds{
		TemplateID: tj.TemplateID, Aliases: tj.Aliases, Names: tj.Names, CreatedAt: tj.CreatedAt, UpdatedAt: tj.UpdatedAt,
		Runtime: tj.Runtime, Warm: tj.Warm,
		Builds: []templateBuild{{
			BuildID: tj.BuildID, Status: tj.BuildStatus, CPUCount: tj.CPUCount, MemoryMB: tj.MemoryMB, DiskSizeMB: tj.DiskSizeMB,
			EnvdVersion: tj.EnvdVersion, CreatedAt: tj.CreatedAt, UpdatedAt: tj.UpdatedAt, FinishedAt: tj.CreatedAt,
		}},
	})
}

// deleteTemplate deletes a snapshot or a template (E2B's SDK deletes
// snapshots through this path too).
func (h *Handler) deleteTemplate(w http.ResponseWriter, r *http.Request) {
	// A snapshot any key of its team may delete (another team's is not
	// found, admin or not); a template only an admin key.
	k := apiKey(r)
	if _, err := h.b.DeleteFromAPI(r.Context(), r.PathValue("templateID"), k != nil && k.Admin); err != nil {
		writeError(w, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

func (h *Handler) templateAlias(w http.ResponseWriter, r *http.Request) {
	t, err := h.b.GetTemplate(r.Context(), r.PathValue("alias"))
	if err != nil {
		writeError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, templateAlias{TemplateID: t.ID})
}
