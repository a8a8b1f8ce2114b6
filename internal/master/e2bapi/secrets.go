package e2bapi

import (
	"net/http"
	"time"
)

// The secrets API is cube's: a team's named values that credential rules
// reference ({"host", "header", "secretName"}) instead of carrying them.
// Values go in and never come out: listings give names and times only.

// secretBody is the body of POST /secrets and PUT /secrets/{name}.
type secretBody struct {
	Name  string `json:"name"`
	Value string `json:"value"`
}

// secretJSON is what the API says about a secret (no value).
type secretJSON struct {
	Name      string    `json:"name"`
	CreatedAt time.Time `json:"createdAt"`
	UpdatedAt time.Time `json:"updatedAt"`
}

func (h *Handler) createSecret(w http.ResponseWriter, r *http.Request) {
	h.putSecret(w, r, "", false)
}

func (h *Handler) replaceSecret(w http.ResponseWriter, r *http.Request) {
	h.putSecret(w, r, r.PathValue("name"), true)
}

func (h *Handler) putSecret(w http.ResponseWriter, r *http.Request, name string, replace bool) {
	var body secretBody
	if err := decode(w, r, &body, true); err != nil {
		writeError(w, err)
		return
	}
	if replace {
		body.Name = name
	}
	m, err := h.b.PutSecret(r.Context(), body.Name, body.Value, replace)
	if err != nil {
		writeError(w, err)
		return
	}
	code := http.StatusCreated
	if replace {
		code = http.StatusOK
	}
	writeJSON(w, code, secretJSON{Name: m.Name, CreatedAt: m.CreatedAt, UpdatedAt: m.UpdatedAt})
}

func (h *Handler) listSecrets(w http.ResponseWriter, r *http.Request) {
	list, err := h.b.ListSecrets(r.Context())
	if err != nil {
		writeError(w, err)
		return
	}
	out := make([]secretJSON, 0, len(list))
	for _, m := range list {
		out = append(out, secretJSON{Name: m.Name, CreatedAt: m.CreatedAt, UpdatedAt: m.UpdatedAt})
	}
	writeJSON(w, http.StatusOK, out)
}

func (h *Handler) deleteSecret(w http.ResponseWriter, r *http.Request) {
	if err := h.b.DeleteSecret(r.Context(), r.PathValue("name")); err != nil {
		writeError(w, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}
