package main

import (
	"crypto/subtle"
	"encoding/json"
	"net/http"
	"time"
)

// fakeAPI is the one E2B control-plane call the SDK makes before it talks
// to a sandbox directly: Sandbox.connect(id) POSTs
// /v2/sandboxes/{id}/connect for the envd version and access token. This is
// not the control plane (cubemaster's E2B API, tested by the system
// suite); it answers for exactly one sandbox and nothing else.
type fakeAPI struct {
	apiKey      string
	sandboxID   string
	templateID  string
	envdVersion string
	accessToken string
	started     time.Time
}

func (a *fakeAPI) handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v2/sandboxes/{id}/connect", a.connect)
	return mux
}

func apiError(w http.ResponseWriter, code int, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(map[string]any{"code": code, "message": msg})
}

func (a *fakeAPI) connect(w http.ResponseWriter, r *http.Request) {
	if subtle.ConstantTimeCompare([]byte(r.Header.Get("X-API-KEY")), []byte(a.apiKey)) != 1 {
		apiError(w, http.StatusUnauthorized, "invalid API key")
		return
	}
	if r.PathValue("id") != a.sandboxID {
		apiError(w, http.StatusNotFound, "sandbox "+r.PathValue("id")+" not found")
		return
	}
	var body struct {
		Timeout *int `json:"timeout"`
	}
	if err := json.NewDecoder(r.Body).Decode(&body); err != nil {
		apiError(w, http.StatusBadRequest, "body: "+err.Error())
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusOK)
	_ = json.NewEncoder(w).Encode(map[string]any{
		"sandboxID":       a.sandboxID,
		"templateID":      a.templateID,
		"clientID":        "cube-e2e",
		"envdVersion":     a.envdVersion,
		"envdAccessToken": a.accessToken,
		"startedAt":       a.started.UTC().Format(time.RFC3339),
		"endAt":           a.started.Add(time.Hour).UTC().Format(time.RFC3339),
		"cpuCount":        1,
		"memoryMB":        512,
		"diskSizeMB":      0,
		"state":           "running",
	})
}
