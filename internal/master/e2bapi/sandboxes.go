package e2bapi

import (
	"encoding/json"
	"fmt"
	"maps"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/master"
	"github.com/cubesandbox/cube/internal/master/catalog"
)

func (h *Handler) domain() *string {
	if h.cfg.Domain == "" {
		return nil
	}
	d := h.cfg.Domain
	return &d
}

func (h *Handler) envdVersion(sb *catalog.Sandbox) string {
	if sb.EnvdVersion != "" {
		return sb.EnvdVersion
	}
	return h.cfg.EnvdVersion
}

func (h *Handler) sandboxJSON(sb *catalog.Sandbox) sandboxJSON {
	out := sandboxJSON{
		SandboxID: sb.ID, TemplateID: sb.TemplateID, Alias: sb.Alias, ClientID: sb.NodeID,
		EnvdVersion: h.envdVersion(sb), EnvdAccessToken: sb.EnvdAccessToken, Domain: h.domain(),
		Runtime: sb.Runtime,
	}
	if sb.TrafficAccessToken != "" {
		t := sb.TrafficAccessToken
		out.TrafficAccessToken = &t
	}
	return out
}

func cpuCount(milli int64) int64 { return max(1, (milli+999)/1000) }

func (h *Handler) listed(sb *catalog.Sandbox) listedSandbox {
	md := sb.Metadata
	if md == nil {
		md = map[string]string{}
	}
	return listedSandbox{
		SandboxID: sb.ID, TemplateID: sb.TemplateID, Alias: sb.Alias, ClientID: sb.NodeID,
		StartedAt: timeJSON(sb.StartedAt), EndAt: timeJSON(sb.EndAt),
		CPUCount: cpuCount(sb.MilliCPU), MemoryMB: sb.MemoryMiB, DiskSizeMB: sb.DiskMiB,
		EnvdVersion: h.envdVersion(sb), State: sb.State, Metadata: md, VolumeMounts: []volumeMount{},
		Runtime: sb.Runtime,
	}
}

func (h *Handler) detail(sb *catalog.Sandbox) sandboxDetail {
	d := sandboxDetail{
		listedSandbox: h.listed(sb), Domain: h.domain(), EnvdAccessToken: sb.EnvdAccessToken,
		AllowInternetAccess: sb.Network.AllowInternet,
		Lifecycle:           lifecycleJSON{AutoResume: sb.AutoResume, OnTimeout: "kill"},
	}
	if sb.AutoPause {
		d.Lifecycle.OnTimeout = "pause"
	}
	n := sb.Network
	if len(n.AllowOut) > 0 || len(n.DenyOut) > 0 || n.AllowPublicTraffic != nil {
		d.Network = &networkConfig{AllowOut: n.AllowOut, DenyOut: n.DenyOut, AllowPublicTraffic: n.AllowPublicTraffic}
	}
	return d
}

func unsupported(field string) error {
	return fmt.Errorf("%s is not supported by this server: %w", field, errdefs.ErrInvalidArgument)
}

func isSet(raw []byte) bool {
	s := strings.TrimSpace(string(raw))
	return s != "" && s != "null" && s != "{}" && s != "[]"
}

// createRequest checks a NewSandbox body and turns it into the master's
// request. Features cube cannot honour are refused, never ignored.
func createRequest(body *newSandbox, secure bool) (master.CreateRequest, error) {
	req := master.CreateRequest{
		Template: body.TemplateID, Metadata: body.Metadata, Env: body.EnvVars, Secure: secure,
		Runtime: body.Runtime,
	}
	if body.TemplateID == "" {
		return req, fmt.Errorf("templateID is required: %w", errdefs.ErrInvalidArgument)
	}
	var err error
	if req.Timeout, err = seconds("timeout", body.Timeout); err != nil {
		return req, err
	}
	if body.Timeout != nil && *body.Timeout == 0 {
		return req, fmt.Errorf("timeout: must be at least 1 second: %w", errdefs.ErrInvalidArgument)
	}
	if body.Secure != nil && *body.Secure {
		req.Secure = true
	}
	if req.IdleTimeout, err = seconds("idleTimeout", body.IdleTimeout); err != nil {
		return req, err
	}
	req.AutoPause = body.AutoPause != nil && *body.AutoPause
	if body.AutoResume != nil && body.AutoResume.Enabled {
		if !req.AutoPause {
			return req, fmt.Errorf("autoResume needs autoPause (onTimeout: pause): %w", errdefs.ErrInvalidArgument)
		}
		req.AutoResume = true
	}
	for _, m := range body.VolumeMounts {
		req.Volumes = append(req.Volumes, master.VolumeMount{Name: m.Name, Path: m.Path})
	}
	switch {
	case isSet(body.MCP):
		return req, unsupported("mcp")
	case isSet(body.IAM):
		return req, unsupported("iam")
	}
	req.Network.AllowInternet = body.AllowInternetAccess
	if n := body.Network; n != nil {
		switch {
		case isSet(n.EgressProxy):
			return req, unsupported("network.egressProxy")
		case n.MaskRequestHost != nil && *n.MaskRequestHost != "":
			return req, unsupported("network.maskRequestHost")
		case len(n.HTTPSPorts) > 0:
			return req, unsupported("network.httpsPorts")
		}
		req.Network.AllowOut, req.Network.DenyOut, req.Network.AllowPublicTraffic = n.AllowOut, n.DenyOut, n.AllowPublicTraffic
		req.Network.Credentials = credentialsFromJSON(n.Credentials)
		req.Network.Requests = requestRulesFromJSON(n.Requests)
		fromRules, err := credentialsFromRules("network.rules", n.Rules)
		if err != nil {
			return req, err
		}
		req.Network.Credentials = append(req.Network.Credentials, fromRules...)
	}
	return req, nil
}

// networkRule is components.schemas.SandboxNetworkRule: E2B's per-host
// header transforms, which are cube's credential rules (the node's egress
// proxy sets each header on the host's HTTPS requests; docs/network.md).
type networkRule struct {
	Transform *struct {
		Headers map[string]string `json:"headers"`
	} `json:"transform"`
}

// credentialsFromRules turns E2B's network.rules ({host: [{transform:
// {headers}}]}) into credential rules, in a stable order; nil when raw
// is absent or null. A rule without a transform injects nothing, as in
// E2B.
func credentialsFromRules(field string, raw json.RawMessage) ([]catalog.Credential, error) {
	if s := strings.TrimSpace(string(raw)); s == "" || s == "null" {
		return nil, nil
	}
	var rules map[string][]networkRule
	if err := json.Unmarshal(raw, &rules); err != nil {
		return nil, fmt.Errorf("%s: %v: %w", field, err, errdefs.ErrInvalidArgument)
	}
	out := []catalog.Credential{}
	for _, host := range slices.Sorted(maps.Keys(rules)) {
		for _, r := range rules[host] {
			if r.Transform == nil {
				continue
			}
			for _, h := range slices.Sorted(maps.Keys(r.Transform.Headers)) {
				out = append(out, catalog.Credential{Host: host, Header: h, Value: r.Transform.Headers[h]})
			}
		}
	}
	return out, nil
}

func (h *Handler) create(w http.ResponseWriter, r *http.Request, v2 bool) {
	var body newSandbox
	if err := decode(w, r, &body, true); err != nil {
		writeError(w, err)
		return
	}
	// /v2 is secured always; /v1 when the body asks.
	req, err := createRequest(&body, v2)
	if err != nil {
		writeError(w, err)
		return
	}
	if !v2 && body.Timeout == nil {
		req.Timeout = h.cfg.V1DefaultTimeout
	}
	req.APIKeyID = apiKeyID(r)
	sb, err := h.b.Create(r.Context(), req)
	if err != nil {
		writeError(w, err)
		return
	}
	h.b.Audit(r.Context(), sb.ID, "create", apiKey(r))
	writeJSON(w, http.StatusCreated, h.sandboxJSON(sb))
}

func (h *Handler) createV1(w http.ResponseWriter, r *http.Request) { h.create(w, r, false) }
func (h *Handler) createV2(w http.ResponseWriter, r *http.Request) { h.create(w, r, true) }

// parseMetadataQuery reads E2B's metadata filter: a query string
// ("user=abc&app=prod") whose keys and values are themselves URL-encoded.
func parseMetadataQuery(raw string) (map[string]string, error) {
	if raw == "" {
		return nil, nil
	}
	vals, err := url.ParseQuery(raw)
	if err != nil {
		return nil, fmt.Errorf("metadata %q: %v: %w", raw, err, errdefs.ErrInvalidArgument)
	}
	out := map[string]string{}
	for k, vs := range vals {
		key, err1 := url.QueryUnescape(k)
		val, err2 := url.QueryUnescape(vs[0])
		if err1 != nil || err2 != nil {
			return nil, fmt.Errorf("metadata %q: bad escape: %w", raw, errdefs.ErrInvalidArgument)
		}
		out[key] = val
	}
	return out, nil
}

func (h *Handler) listV1(w http.ResponseWriter, r *http.Request) {
	md, err := parseMetadataQuery(r.URL.Query().Get("metadata"))
	if err != nil {
		writeError(w, err)
		return
	}
	sbs, _, err := h.b.List(r.Context(), catalog.Query{States: []string{catalog.StateRunning}, Metadata: md})
	if err != nil {
		writeError(w, err)
		return
	}
	out := make([]listedSandbox, 0, len(sbs))
	for _, sb := range sbs {
		out = append(out, h.listed(sb))
	}
	writeJSON(w, http.StatusOK, out)
}

// maxPage is E2B's page size limit.
const maxPage = 100

func (h *Handler) listV2(w http.ResponseWriter, r *http.Request) {
	qv := r.URL.Query()
	q := catalog.Query{Limit: maxPage, After: qv.Get("nextToken"), TemplateID: qv.Get("template")}
	var err error
	if q.Metadata, err = parseMetadataQuery(qv.Get("metadata")); err != nil {
		writeError(w, err)
		return
	}
	for _, v := range qv["state"] {
		for _, st := range strings.Split(v, ",") {
			if st = strings.TrimSpace(st); st != "" {
				q.States = append(q.States, st)
			}
		}
	}
	if l := qv.Get("limit"); l != "" {
		n, err := strconv.Atoi(l)
		if err != nil || n < 1 || n > maxPage {
			writeError(w, fmt.Errorf("limit %q: want 1-%d: %w", l, maxPage, errdefs.ErrInvalidArgument))
			return
		}
		q.Limit = n
	}
	switch o := qv.Get("order"); o {
	case "", "desc":
	case "asc":
		q.Ascending = true
	default:
		writeError(w, fmt.Errorf("order %q: want asc or desc: %w", o, errdefs.ErrInvalidArgument))
		return
	}
	if s := qv.Get("startedAfter"); s != "" {
		if q.StartedAfter, err = time.Parse(time.RFC3339Nano, s); err != nil {
			writeError(w, fmt.Errorf("startedAfter %q: want RFC 3339: %w", s, errdefs.ErrInvalidArgument))
			return
		}
	}
	sbs, next, err := h.b.List(r.Context(), q)
	if err != nil {
		writeError(w, err)
		return
	}
	out := make([]listedSandbox, 0, len(sbs))
	for _, sb := range sbs {
		out = append(out, h.listed(sb))
	}
	if next != "" {
		w.Header().Set("X-Next-Token", next)
	}
	writeJSON(w, http.StatusOK, out)
}

// withID runs fn with the path's sandbox ID, answering a bad one.
func withID(w http.ResponseWriter, r *http.Request, fn func(id string) error) {
	id, err := pathID(r)
	if err == nil {
		err = fn(id)
	}
	if err != nil {
		writeError(w, err)
	}
}

func (h *Handler) get(w http.ResponseWriter, r *http.Request) {
	withID(w, r, func(id string) error {
		sb, err := h.b.Get(r.Context(), id)
		if err != nil {
			return err
		}
		d := h.detail(sb)
		vols, err := h.b.SandboxVolumes(r.Context(), id)
		if err != nil {
			return err
		}
		for _, v := range vols {
			d.VolumeMounts = append(d.VolumeMounts, volumeMount{Name: v.Name, Path: v.Path})
		}
		writeJSON(w, http.StatusOK, d)
		return nil
	})
}

func (h *Handler) kill(w http.ResponseWriter, r *http.Request) {
	withID(w, r, func(id string) error {
		if err := h.b.Kill(r.Context(), id); err != nil {
			return err
		}
		w.WriteHeader(http.StatusNoContent)
		return nil
	})
}

func (h *Handler) pause(w http.ResponseWriter, r *http.Request) {
	withID(w, r, func(id string) error {
		// memory=false (a disk-only pause) is served as a memory pause: a
		// frozen sandbox keeps strictly more than the client asked for.
		var body timeoutBody
		if err := decode(w, r, &body, false); err != nil {
			return err
		}
		if err := h.b.Pause(r.Context(), id); err != nil {
			return err
		}
		w.WriteHeader(http.StatusNoContent)
		return nil
	})
}

func (h *Handler) resume(w http.ResponseWriter, r *http.Request) {
	withID(w, r, func(id string) error {
		var body timeoutBody
		if err := decode(w, r, &body, false); err != nil {
			return err
		}
		d, err := seconds("timeout", body.Timeout)
		if err != nil {
			return err
		}
		sb, err := h.b.Resume(r.Context(), id, d)
		if err != nil {
			return err
		}
		writeJSON(w, http.StatusCreated, h.sandboxJSON(sb))
		return nil
	})
}

func (h *Handler) connect(w http.ResponseWriter, r *http.Request, required bool) {
	withID(w, r, func(id string) error {
		var body timeoutBody
		if err := decode(w, r, &body, required); err != nil {
			return err
		}
		if required && body.Timeout == nil {
			return fmt.Errorf("timeout is required: %w", errdefs.ErrInvalidArgument)
		}
		d, err := seconds("timeout", body.Timeout)
		if err != nil {
			return err
		}
		sb, resumed, err := h.b.Connect(r.Context(), id, d)
		if err != nil {
			return err
		}
		code := http.StatusOK
		if resumed {
			code = http.StatusCreated
		}
		writeJSON(w, code, h.sandboxJSON(sb))
		return nil
	})
}

func (h *Handler) connectV1(w http.ResponseWriter, r *http.Request) { h.connect(w, r, true) }
func (h *Handler) connectV2(w http.ResponseWriter, r *http.Request) { h.connect(w, r, false) }

func (h *Handler) setTimeout(w http.ResponseWriter, r *http.Request) {
	withID(w, r, func(id string) error {
		var body timeoutBody
		if err := decode(w, r, &body, true); err != nil {
			return err
		}
		if body.Timeout == nil {
			return fmt.Errorf("timeout is required: %w", errdefs.ErrInvalidArgument)
		}
		d, err := seconds("timeout", body.Timeout)
		if err != nil {
			return err
		}
		// E2B sets the timeout of running sandboxes only: a paused one is
		// 404, which SDKs before /connect existed (2.0–2.x) read as "paused:
		// resume it" in Sandbox.connect. Accepting it left them talking to
		// a paused sandbox.
		if sb, err := h.b.Get(r.Context(), id); err == nil && sb.State == catalog.StatePaused {
			return fmt.Errorf("sandbox %s is paused, not running: resume or connect to it first: %w", id, errdefs.ErrNotFound)
		}
		if err := h.b.SetTimeout(r.Context(), id, d); err != nil {
			return err
		}
		w.WriteHeader(http.StatusNoContent)
		return nil
	})
}

func (h *Handler) refresh(w http.ResponseWriter, r *http.Request) {
	withID(w, r, func(id string) error {
		var body refreshBody
		if err := decode(w, r, &body, false); err != nil {
			return err
		}
		d, err := seconds("duration", body.Duration)
		if err != nil {
			return err
		}
		if err := h.b.Refresh(r.Context(), id, d); err != nil {
			return err
		}
		w.WriteHeader(http.StatusNoContent)
		return nil
	})
}

func (h *Handler) network(w http.ResponseWriter, r *http.Request) {
	withID(w, r, func(id string) error {
		var body networkUpdate
		if err := decode(w, r, &body, true); err != nil {
			return err
		}
		if isSet(body.EgressProxy) {
			return unsupported("egressProxy")
		}
		n := catalog.Network{AllowInternet: body.AllowInternetAccess, AllowOut: body.AllowOut, DenyOut: body.DenyOut,
			Credentials: credentialsFromJSON(body.Credentials), Requests: requestRulesFromJSON(body.Requests)}
		// rules, when present, replace the credential rules with cube's
		// own (absent keeps them).
		fromRules, err := credentialsFromRules("rules", body.Rules)
		if err != nil {
			return err
		}
		if fromRules != nil {
			n.Credentials = append(append([]catalog.Credential{}, n.Credentials...), fromRules...)
		}
		if err := h.b.UpdateNetwork(r.Context(), id, n); err != nil {
			return err
		}
		w.WriteHeader(http.StatusNoContent)
		return nil
	})
}

func (h *Handler) snapshotJSON(s *catalog.Snapshot) snapshotInfo {
	names := []string{}
	if s.Name != "" {
		names = append(names, s.Name)
	}
	return snapshotInfo{SnapshotID: s.ID, Names: names}
}

func (h *Handler) snapshot(w http.ResponseWriter, r *http.Request) {
	withID(w, r, func(id string) error {
		var body snapshotRequest
		if err := decode(w, r, &body, false); err != nil {
			return err
		}
		snap, err := h.b.Snapshot(r.Context(), id, body.Name)
		if err != nil {
			return err
		}
		writeJSON(w, http.StatusCreated, h.snapshotJSON(snap))
		return nil
	})
}

func (h *Handler) listSnapshots(w http.ResponseWriter, r *http.Request) {
	qv := r.URL.Query()
	q := catalog.SnapshotQuery{SandboxID: qv.Get("sandboxID"), Name: qv.Get("name"), After: qv.Get("nextToken"), Limit: maxPage}
	if l := qv.Get("limit"); l != "" {
		n, err := strconv.Atoi(l)
		if err != nil || n < 1 || n > maxPage {
			writeError(w, fmt.Errorf("limit %q: want 1-%d: %w", l, maxPage, errdefs.ErrInvalidArgument))
			return
		}
		q.Limit = n
	}
	snaps, next, err := h.b.ListSnapshots(r.Context(), q)
	if err != nil {
		writeError(w, err)
		return
	}
	out := make([]snapshotInfo, 0, len(snaps))
	for _, s := range snaps {
		out = append(out, h.snapshotJSON(s))
	}
	if next != "" {
		w.Header().Set("X-Next-Token", next)
	}
	writeJSON(w, http.StatusOK, out)
}

func (h *Handler) fork(w http.ResponseWriter, r *http.Request) {
	withID(w, r, func(id string) error {
		var body timeoutBody
		if err := decode(w, r, &body, false); err != nil {
			return err
		}
		d, err := seconds("timeout", body.Timeout)
		if err != nil {
			return err
		}
		count := 1
		if body.Count != nil {
			count = *body.Count
			if count < 1 {
				return fmt.Errorf("count %d: want 1-100: %w", count, errdefs.ErrInvalidArgument)
			}
		}
		res, err := h.b.Fork(r.Context(), id, count, d)
		if err != nil {
			return err
		}
		out := make([]forkResult, 0, len(res))
		for _, fr := range res {
			if fr.Err != nil {
				code, ecode := statusOf(fr.Err)
				out = append(out, forkResult{Error: &errorBody{Code: code, Message: fr.Err.Error(), ErrorCode: ecode}})
				continue
			}
			sj := h.sandboxJSON(fr.Sandbox)
			out = append(out, forkResult{Sandbox: &sj})
		}
		writeJSON(w, http.StatusCreated, out)
		return nil
	})
}

func metricJSON(m master.Metric) sandboxMetric {
	return sandboxMetric{
		Timestamp: timeJSON(m.Timestamp), TimestampUnix: m.Timestamp.Unix(), CPUCount: m.CPUCount, CPUUsedPct: m.CPUUsedPct,
		MemUsed: m.MemUsed, MemTotal: m.MemTotal, MemCache: m.MemCache, DiskUsed: m.DiskUsed, DiskTotal: m.DiskTotal,
	}
}

// metrics serves a sandbox's samples between start and end (Unix seconds,
// both inclusive; absent = open), as the SDKs' getMetrics asks.
func (h *Handler) metrics(w http.ResponseWriter, r *http.Request) {
	withID(w, r, func(id string) error {
		qv := r.URL.Query()
		start, err := intParam(qv, "start", 0, 0, 1<<40)
		if err != nil {
			return err
		}
		end, err := intParam(qv, "end", 0, 0, 1<<40)
		if err != nil {
			return err
		}
		var from, to time.Time
		if start > 0 {
			from = time.Unix(start, 0)
		}
		if end > 0 {
			to = time.Unix(end, 0).Add(time.Second - time.Nanosecond) // the whole of second end
		}
		ms, err := h.b.Metrics(r.Context(), id, from, to)
		if err != nil {
			return err
		}
		out := make([]sandboxMetric, 0, len(ms))
		for _, m := range ms {
			out = append(out, metricJSON(m))
		}
		writeJSON(w, http.StatusOK, out)
		return nil
	})
}

func (h *Handler) metricsMany(w http.ResponseWriter, r *http.Request) {
	var ids []string
	for _, v := range r.URL.Query()["sandbox_ids"] {
		for _, id := range strings.Split(v, ",") {
			if id = strings.TrimSpace(id); id != "" {
				ids = append(ids, id)
			}
		}
	}
	if len(ids) == 0 || len(ids) > maxPage {
		writeError(w, fmt.Errorf("sandbox_ids: want 1-%d comma-separated IDs: %w", maxPage, errdefs.ErrInvalidArgument))
		return
	}
	out := sandboxesWithMetrics{Sandboxes: map[string]sandboxMetric{}}
	for _, id := range ids {
		ms, err := h.b.Metrics(r.Context(), id, time.Time{}, time.Time{})
		if errdefs.IsNotFound(err) || errdefs.IsInvalidArgument(err) {
			continue
		}
		if err != nil {
			writeError(w, err)
			return
		}
		if len(ms) > 0 {
			out.Sandboxes[id] = metricJSON(ms[len(ms)-1])
		}
	}
	writeJSON(w, http.StatusOK, out)
}

func intParam(qv url.Values, name string, def, lo, hi int64) (int64, error) {
	s := qv.Get(name)
	if s == "" {
		return def, nil
	}
	v, err := strconv.ParseInt(s, 10, 64)
	if err != nil || v < lo || v > hi {
		return 0, fmt.Errorf("%s %q: want %d-%d: %w", name, s, lo, hi, errdefs.ErrInvalidArgument)
	}
	return v, nil
}

func logEntry(e catalog.Event) sandboxLogEntry {
	f := e.Fields
	if f == nil {
		f = map[string]string{}
	}
	return sandboxLogEntry{Timestamp: timeJSON(e.At), Level: e.Level, Message: e.Message, Fields: f}
}

// logsV1 serves the sandbox's log: what cubemaster did to it and what ran
// in it (master.SandboxLog).
func (h *Handler) logsV1(w http.ResponseWriter, r *http.Request) {
	withID(w, r, func(id string) error {
		qv := r.URL.Query()
		start, err := intParam(qv, "start", 0, 0, 1<<50)
		if err != nil {
			return err
		}
		limit, err := intParam(qv, "limit", 1000, 1, 10000)
		if err != nil {
			return err
		}
		evs, err := h.b.SandboxLog(r.Context(), catalog.EventQuery{SandboxID: id, Since: msTime(start), Limit: int(limit)})
		if err != nil {
			return err
		}
		out := sandboxLogs{Logs: []sandboxLog{}, LogEntries: []sandboxLogEntry{}}
		for _, e := range evs {
			le := logEntry(e)
			out.LogEntries = append(out.LogEntries, le)
			out.Logs = append(out.Logs, sandboxLog{Timestamp: le.Timestamp, Line: e.Message})
		}
		writeJSON(w, http.StatusOK, out)
		return nil
	})
}

var levelRank = map[string]int{"debug": 0, "info": 1, "warn": 2, "error": 3}

func (h *Handler) logsV2(w http.ResponseWriter, r *http.Request) {
	withID(w, r, func(id string) error {
		qv := r.URL.Query()
		cursor, err := intParam(qv, "cursor", 0, 0, 1<<50)
		if err != nil {
			return err
		}
		limit, err := intParam(qv, "limit", 1000, 1, 10000)
		if err != nil {
			return err
		}
		q := catalog.EventQuery{SandboxID: id, Since: msTime(cursor)}
		switch d := qv.Get("direction"); d {
		case "", "forward":
		case "backward":
			q.Backward = true
		default:
			return fmt.Errorf("direction %q: want forward or backward: %w", d, errdefs.ErrInvalidArgument)
		}
		minLevel := 0
		if l := qv.Get("level"); l != "" {
			rank, ok := levelRank[l]
			if !ok {
				return fmt.Errorf("level %q: want debug, info, warn or error: %w", l, errdefs.ErrInvalidArgument)
			}
			minLevel = rank
		}
		evs, err := h.b.SandboxLog(r.Context(), q)
		if err != nil {
			return err
		}
		out := sandboxLogsV2{Logs: []sandboxLogEntry{}}
		search := qv.Get("search")
		for _, e := range evs {
			if levelRank[e.Level] < minLevel || (search != "" && !strings.Contains(e.Message, search)) {
				continue
			}
			if int64(len(out.Logs)) == limit {
				break
			}
			out.Logs = append(out.Logs, logEntry(e))
		}
		writeJSON(w, http.StatusOK, out)
		return nil
	})
}

func msTime(v int64) time.Time {
	if v == 0 {
		return time.Time{}
	}
	return time.UnixMilli(v)
}

// requestRulesFromJSON keeps nil (absent) apart from empty ([]).
func requestRulesFromJSON(in []requestRuleJSON) []catalog.RequestRule {
	if in == nil {
		return nil
	}
	out := make([]catalog.RequestRule, 0, len(in))
	for _, r := range in {
		out = append(out, catalog.RequestRule(r))
	}
	return out
}

// credentialsFromJSON keeps nil (absent) apart from empty ([]).
func credentialsFromJSON(in []credentialJSON) []catalog.Credential {
	if in == nil {
		return nil
	}
	out := make([]catalog.Credential, 0, len(in))
	for _, c := range in {
		out = append(out, catalog.Credential(c))
	}
	return out
}
