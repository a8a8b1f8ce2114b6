package e2bapi

import (
	"encoding/json"
	"time"
)

// JSON shapes of the E2B REST API, field for field as the e2b SDK's
// bundled OpenAPI types name them (e2b@2.51.0, dist/index.d.ts,
// components.schemas). Only what cube serves is here.

// errorBody is components.schemas.Error.
type errorBody struct {
	Code      int    `json:"code"`
	Message   string `json:"message"`
	ErrorCode string `json:"error_code,omitempty"`
}

// sandboxJSON is components.schemas.Sandbox (create, connect, resume).
type sandboxJSON struct {
	SandboxID          string  `json:"sandboxID"`
	TemplateID         string  `json:"templateID"`
	Alias              string  `json:"alias,omitempty"`
	ClientID           string  `json:"clientID"`
	EnvdVersion        string  `json:"envdVersion"`
	EnvdAccessToken    string  `json:"envdAccessToken,omitempty"`
	TrafficAccessToken *string `json:"trafficAccessToken"`
	Domain             *string `json:"domain"`
	// Runtime is cube's extension: the driver the sandbox runs on.
	Runtime string `json:"runtime,omitempty"`
}

// listedSandbox is components.schemas.ListedSandbox.
type listedSandbox struct {
	SandboxID    string            `json:"sandboxID"`
	TemplateID   string            `json:"templateID"`
	Alias        string            `json:"alias,omitempty"`
	ClientID     string            `json:"clientID"`
	StartedAt    string            `json:"startedAt"`
	EndAt        string            `json:"endAt"`
	CPUCount     int64             `json:"cpuCount"`
	MemoryMB     int64             `json:"memoryMB"`
	DiskSizeMB   int64             `json:"diskSizeMB"`
	EnvdVersion  string            `json:"envdVersion"`
	State        string            `json:"state"`
	Metadata     map[string]string `json:"metadata"`
	VolumeMounts []volumeMount     `json:"volumeMounts"`
	// Runtime is cube's extension: the driver the sandbox runs on (runc,
	// gvisor, vm).
	Runtime string `json:"runtime,omitempty"`
}

// sandboxDetail is components.schemas.SandboxDetail (GET /sandboxes/{id}).
type sandboxDetail struct {
	listedSandbox
	Domain              *string        `json:"domain"`
	EnvdAccessToken     string         `json:"envdAccessToken,omitempty"`
	AllowInternetAccess *bool          `json:"allowInternetAccess"`
	Lifecycle           lifecycleJSON  `json:"lifecycle"`
	Network             *networkConfig `json:"network,omitempty"`
}

type lifecycleJSON struct {
	AutoResume bool   `json:"autoResume"`
	OnTimeout  string `json:"onTimeout"` // "kill" | "pause"
}

type volumeMount struct {
	Name string `json:"name"`
	Path string `json:"path"`
}

// networkConfig is components.schemas.SandboxNetworkConfig; the fields
// cube cannot honour yet are read only to refuse them.
type networkConfig struct {
	AllowOut           []string        `json:"allowOut,omitempty"`
	DenyOut            []string        `json:"denyOut,omitempty"`
	AllowPublicTraffic *bool           `json:"allowPublicTraffic,omitempty"`
	MaskRequestHost    *string         `json:"maskRequestHost,omitempty"`
	HTTPSPorts         []int           `json:"httpsPorts,omitempty"`
	EgressProxy        json.RawMessage `json:"egressProxy,omitempty"`
	Rules              json.RawMessage `json:"rules,omitempty"`
	// Credentials is cube's extension: headers the node's egress proxy
	// injects (docs/network.md). Accepted, never returned.
	Credentials []credentialJSON `json:"credentials,omitempty"`
	// Requests is cube's extension: method and path rules for hosts whose
	// TLS the node's egress proxy terminates (docs/network.md).
	Requests []requestRuleJSON `json:"requests,omitempty"`
}

// requestRuleJSON is one request rule in a request.
type requestRuleJSON struct {
	Host    string   `json:"host"`
	Methods []string `json:"methods,omitempty"`
	Paths   []string `json:"paths,omitempty"`
}

// credentialJSON is one credential rule in a request.
type credentialJSON struct {
	Host   string `json:"host"`
	Header string `json:"header"`
	Value  string `json:"value"`
	// SecretName names a secret of the caller's team (POST /secrets)
	// whose value is injected, in place of Value.
	SecretName string `json:"secretName"`
}

// networkUpdate is components.schemas.SandboxNetworkUpdateConfig.
type networkUpdate struct {
	AllowInternetAccess *bool           `json:"allow_internet_access"`
	AllowOut            []string        `json:"allowOut"`
	DenyOut             []string        `json:"denyOut"`
	EgressProxy         json.RawMessage `json:"egressProxy"`
	Rules               json.RawMessage `json:"rules"`
	// Credentials replaces the sandbox's credential rules; absent keeps
	// them, [] removes them.
	Credentials []credentialJSON `json:"credentials"`
	// Requests replaces the sandbox's request rules; absent keeps them,
	// [] removes them.
	Requests []requestRuleJSON `json:"requests"`
}

// newSandbox is components.schemas.NewSandbox and NewSandboxV2.
type newSandbox struct {
	TemplateID          string            `json:"templateID"`
	Timeout             *int64            `json:"timeout"`
	AutoPause           *bool             `json:"autoPause"`
	AutoPauseMemory     *bool             `json:"autoPauseMemory"`
	AutoResume          *autoResume       `json:"autoResume"`
	Secure              *bool             `json:"secure"`
	AllowInternetAccess *bool             `json:"allow_internet_access"`
	Network             *networkConfig    `json:"network"`
	Metadata            map[string]string `json:"metadata"`
	EnvVars             map[string]string `json:"envVars"`
	MCP                 json.RawMessage   `json:"mcp"`
	IAM                 json.RawMessage   `json:"iam"`
	VolumeMounts        []volumeMount     `json:"volumeMounts"`
	// IdleTimeout (seconds) is cube's extension: pause the sandbox after
	// this long without API or proxied traffic and nothing in flight.
	IdleTimeout *int64 `json:"idleTimeout"`
	// Runtime is cube's extension: the driver to run on (runc, gvisor,
	// vm); empty: the template's, else the node's default.
	Runtime string `json:"runtime"`
}

type autoResume struct {
	Enabled bool `json:"enabled"`
}

// timeoutBody covers ConnectSandbox(V2), ResumedSandbox,
// SandboxTimeoutRequest and SandboxForkRequest.
type timeoutBody struct {
	Timeout   *int64 `json:"timeout"`
	Memory    *bool  `json:"memory"`
	AutoPause *bool  `json:"autoPause"`
	Count     *int   `json:"count"`
}

type refreshBody struct {
	Duration *int64 `json:"duration"`
}

type snapshotRequest struct {
	Name string `json:"name"`
}

// snapshotInfo is components.schemas.SnapshotInfo.
type snapshotInfo struct {
	SnapshotID string   `json:"snapshotID"`
	Names      []string `json:"names"`
}

// forkResult is components.schemas.SandboxForkResult.
type forkResult struct {
	Sandbox *sandboxJSON `json:"sandbox,omitempty"`
	Error   *errorBody   `json:"error,omitempty"`
}

// sandboxMetric is components.schemas.SandboxMetric.
type sandboxMetric struct {
	Timestamp     string  `json:"timestamp"`
	TimestampUnix int64   `json:"timestampUnix"`
	CPUCount      int     `json:"cpuCount"`
	CPUUsedPct    float64 `json:"cpuUsedPct"`
	MemUsed       int64   `json:"memUsed"`
	MemTotal      int64   `json:"memTotal"`
	MemCache      int64   `json:"memCache"`
	DiskUsed      int64   `json:"diskUsed"`
	DiskTotal     int64   `json:"diskTotal"`
}

type sandboxesWithMetrics struct {
	Sandboxes map[string]sandboxMetric `json:"sandboxes"`
}

// Logs: components.schemas.SandboxLogs (v1) and SandboxLogsV2Response.
type sandboxLog struct {
	Timestamp string `json:"timestamp"`
	Line      string `json:"line"`
}

type sandboxLogEntry struct {
	Timestamp string            `json:"timestamp"`
	Level     string            `json:"level"`
	Message   string            `json:"message"`
	Fields    map[string]string `json:"fields"`
}

type sandboxLogs struct {
	Logs       []sandboxLog      `json:"logs"`
	LogEntries []sandboxLogEntry `json:"logEntries"`
}

type sandboxLogsV2 struct {
	Logs []sandboxLogEntry `json:"logs"`
}

// templateJSON is components.schemas.Template.
type templateJSON struct {
	TemplateID    string    `json:"templateID"`
	BuildID       string    `json:"buildID"`
	BuildStatus   string    `json:"buildStatus"`
	BuildCount    int       `json:"buildCount"`
	CPUCount      int64     `json:"cpuCount"`
	MemoryMB      int64     `json:"memoryMB"`
	DiskSizeMB    int64     `json:"diskSizeMB"`
	EnvdVersion   string    `json:"envdVersion"`
	Public        bool      `json:"public"`
	Aliases       []string  `json:"aliases"`
	Names         []string  `json:"names"`
	CreatedAt     string    `json:"createdAt"`
	UpdatedAt     string    `json:"updatedAt"`
	CreatedBy     *struct{} `json:"createdBy"`
	LastSpawnedAt *string   `json:"lastSpawnedAt"`
	SpawnCount    int64     `json:"spawnCount"`
	// Cube's extensions: the runtime every node's copy is for (omitted
	// when they differ or follow their node's default), and whether every
	// copy is warm (creates restore a memory snapshot instead of booting).
	Runtime string `json:"runtime,omitempty"`
	Warm    bool   `json:"warm"`
}

// templateBuild is components.schemas.TemplateBuild.
type templateBuild struct {
	BuildID     string `json:"buildID"`
	Status      string `json:"status"`
	CPUCount    int64  `json:"cpuCount"`
	MemoryMB    int64  `json:"memoryMB"`
	DiskSizeMB  int64  `json:"diskSizeMB"`
	EnvdVersion string `json:"envdVersion"`
	CreatedAt   string `json:"createdAt"`
	UpdatedAt   string `json:"updatedAt"`
	FinishedAt  string `json:"finishedAt"`
}

// templateWithBuilds is components.schemas.TemplateWithBuilds.
type templateWithBuilds struct {
	TemplateID    string          `json:"templateID"`
	Aliases       []string        `json:"aliases"`
	Names         []string        `json:"names"`
	Public        bool            `json:"public"`
	CreatedAt     string          `json:"createdAt"`
	UpdatedAt     string          `json:"updatedAt"`
	LastSpawnedAt *string         `json:"lastSpawnedAt"`
	SpawnCount    int64           `json:"spawnCount"`
	Builds        []templateBuild `json:"builds"`
	Runtime       string          `json:"runtime,omitempty"` // as in templateJSON
	Warm          bool            `json:"warm"`
}

type templateAlias struct {
	TemplateID string `json:"templateID"`
	Public     bool   `json:"public"`
}

// timeJSON formats times as E2B does: RFC 3339, UTC, milliseconds.
func timeJSON(t time.Time) string { return t.UTC().Format("2006-01-02T15:04:05.000Z07:00") }
