package e2bapi

import (
	"net/http"

	"github.com/cubesandbox/cube/internal/master/catalog"
)

// Volumes as E2B's SDK manages them (Volume.create/list/get_info/destroy)
// and mounts them (Sandbox.create volumeMounts: [{name, path}]). A volume
// is an ext4 image on one node (docs/storage.md); sizeMiB in the create
// body is cube's extension (E2B's names no size).

// newVolume is components.schemas.NewVolume.
type newVolume struct {
	Name    string `json:"name"`
	SizeMiB int64  `json:"sizeMiB"`
}

// volumeJSON is components.schemas.Volume; sizeMiB is cube's extension.
type volumeJSON struct {
	VolumeID string `json:"volumeID"`
	Name     string `json:"name"`
	SizeMiB  int64  `json:"sizeMiB"`
}

// volumeAndToken is components.schemas.VolumeAndToken.
type volumeAndToken struct {
	volumeJSON
	Token string `json:"token"`
}

func volumeOf(v *catalog.Volume) volumeJSON {
	return volumeJSON{VolumeID: v.ID, Name: v.Name, SizeMiB: v.SizeMiB}
}

func (h *Handler) createVolume(w http.ResponseWriter, r *http.Request) {
	var body newVolume
	if err := decode(w, r, &body, true); err != nil {
		writeError(w, err)
		return
	}
	v, err := h.b.CreateVolume(r.Context(), body.Name, body.SizeMiB)
	if err != nil {
		writeError(w, err)
		return
	}
	writeJSON(w, http.StatusCreated, volumeAndToken{volumeJSON: volumeOf(v), Token: v.Token})
}

func (h *Handler) listVolumes(w http.ResponseWriter, r *http.Request) {
	vs, err := h.b.ListVolumes(r.Context())
	if err != nil {
		writeError(w, err)
		return
	}
	out := make([]volumeJSON, 0, len(vs))
	for _, v := range vs {
		out = append(out, volumeOf(v))
	}
	writeJSON(w, http.StatusOK, out)
}

func (h *Handler) getVolume(w http.ResponseWriter, r *http.Request) {
	v, err := h.b.GetVolume(r.Context(), r.PathValue("volumeID"))
	if err != nil {
		writeError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, volumeAndToken{volumeJSON: volumeOf(v), Token: v.Token})
}

func (h *Handler) deleteVolume(w http.ResponseWriter, r *http.Request) {
	if err := h.b.DeleteVolume(r.Context(), r.PathValue("volumeID")); err != nil {
		writeError(w, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}
