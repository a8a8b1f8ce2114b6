// Package agentproto is the wire contract between cube-agent (inside every
// sandbox) and the host side that drives it (cubelet, the control plane,
// the route): the agent's port, its cubelet-only endpoints and their JSON
// bodies, and the environment names both sides agree on. It is a leaf: the
// host links it without linking the in-sandbox server.
package agentproto

import (
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"time"
)

// Port is where cube-agent serves the envd API inside every sandbox (and
// the vsock port of a VM's agent): envd's port, which E2B clients hard-code.
const Port = 49983

// Paths of the internal endpoints.
const (
	PathInfo    = InternalPrefix + "info"
	PathFreeze  = InternalPrefix + "fsfreeze"
	PathThaw    = InternalPrefix + "fsthaw"
	PathClock   = InternalPrefix + "clock"
	PathQuiesce = InternalPrefix + "quiesce"
	PathReinit  = InternalPrefix + "reinit"
	PathPrepare = InternalPrefix + "prepare"
	PathLogs    = InternalPrefix + "logs"
)

// Variables cubelet puts in every sandbox's environment.
const (
	EnvSandboxID  = "CUBE_SANDBOX_ID"
	EnvTemplateID = "CUBE_TEMPLATE_ID"
)

// InternalPrefix is the path prefix of the endpoints only cubelet calls.
// cubeproxy must never route it (docs/envd.md): a sandbox's clients have
// no business freezing its disk or setting its clock.
const InternalPrefix = "/_cube/"

// Info is GET /_cube/info: what cubelet (and the control plane, which
// passes envdVersion on to the SDKs) needs to know about the agent.
type Info struct {
	EnvdVersion  string `json:"envdVersion"`
	AgentVersion string `json:"agentVersion"`
	PID          int    `json:"pid"`
	Frozen       bool   `json:"frozen"`
}

// FreezeRequest is POST /_cube/fsfreeze's optional body.
type FreezeRequest struct {
	// TimeoutMs is when the agent thaws by itself; default 30 s.
	TimeoutMs int64 `json:"timeout_ms,omitempty"`
}

// ClockRequest is POST /_cube/clock's body: the host's time now.
type ClockRequest struct {
	Timestamp time.Time `json:"timestamp"`
}

// ClockResponse says what the sync did.
type ClockResponse struct {
	Adjusted bool    `json:"adjusted"`
	OffsetMs float64 `json:"offset_ms"` // host minus sandbox, before the sync
}

// QuiesceRequest is POST /_cube/quiesce's optional body.
type QuiesceRequest struct {
	// TimeoutMs is when the agent listens again unwoken; default 5 min.
	TimeoutMs int64 `json:"timeout_ms,omitempty"`
}

// QuiesceResponse answers a quiesce; on refusal it comes with status 409.
type QuiesceResponse struct {
	Quiesced bool `json:"quiesced"`
	// Sockets are the TCP sockets open in the sandbox that are not the
	// agent's (a refusal lists them).
	Sockets []Socket `json:"sockets,omitempty"`
	Error   string   `json:"error,omitempty"`
}

// Socket is one line of /proc/net/tcp{,6}.
type Socket struct {
	Local  string `json:"local"`
	Remote string `json:"remote"`
	State  string `json:"state"`
}

// ReinitRequest is POST /_cube/reinit's body: what must differ in a clone
// restored from another sandbox's memory image. Every field is optional.
type ReinitRequest struct {
	Hostname string `json:"hostname,omitempty"`
	// Env is merged into the sandbox-wide variables every new process
	// gets (CUBE_SANDBOX_ID and the like), and into the agent's own.
	Env map[string]string `json:"env,omitempty"`
	// TimeUnixNs is the host's clock; the sandbox's is set from it when
	// off by more than the agent's clock tolerance and the sandbox may set it.
	TimeUnixNs int64 `json:"time_unix_ns,omitempty"`
	// Entropy (base64) is mixed into the kernel's pool, and credited
	// where the agent may (RNDADDENTROPY needs CAP_SYS_ADMIN): a clone
	// must not share the original's random state.
	Entropy string `json:"entropy,omitempty"`
	// MAC is eth0's new address (VMs: each clone has its own NIC).
	MAC string `json:"mac,omitempty"`
	// AccessToken, when present, replaces the agent's access token ("" =
	// none): a clone restored from memory holds its source's token until
	// this request, which must carry that token, gives it its own.
	AccessToken *string `json:"access_token,omitempty"`
}

// ReinitResponse says, per item, what was applied and what was skipped
// and why: which items a sandbox permits depends on its runtime.
type ReinitResponse struct {
	Applied []string          `json:"applied"`
	Skipped map[string]string `json:"skipped,omitempty"`
}

// AccessTokenHeader carries a sandbox's access token on every request to
// its agent (envd's name).
const AccessTokenHeader = "X-Access-Token"

// The access token a sandbox is created with reaches its agent before
// the agent serves, as a SHA-256 verifier only: in PID 1's environment
// (containers) or on the kernel command line (VMs), both of which code in
// the sandbox can read, so neither may hold the token itself. From its
// first request the agent refuses any token that does not hash to it, and
// learns the token itself from the first request that presents it.
const (
	// TokenHashEnv holds the hex SHA-256 in a container's PID 1 environment.
	TokenHashEnv = "CUBE_AGENT_TOKEN_SHA256" //nolint:gosec // G101: a variable's name, not a credential
	// TokenHashParam holds it on a VM's kernel command line.
	TokenHashParam = "cube.token_sha256" //nolint:gosec // G101: a parameter's name, not a credential
)

// TokenHash is the verifier of token that TokenHashEnv and TokenHashParam
// carry: its SHA-256 in lowercase hex.
func TokenHash(token string) string {
	sum := sha256.Sum256([]byte(token))
	return hex.EncodeToString(sum[:])
}

// The nameserver cube-agent writes into the sandbox's /etc/resolv.conf
// before it serves (network-agent's DNS forwarder, the same address in
// every sandbox): in PID 1's environment (containers) or on the kernel
// command line (VMs). Absent: the file stays as the image has it.
const (
	ResolverEnv   = "CUBE_AGENT_RESOLVER"
	ResolverParam = "cube.resolver"
)

// A CA certificate cube-agent adds to the sandbox's trust store before it
// serves (network-agent's egress CA), unpadded standard base64 of its DER
// (EncodeCA): in PID 1's environment (containers) or on the kernel
// command line (VMs, ~560 characters for a P-256 CA).
const (
	EgressCAEnv   = "CUBE_AGENT_EGRESS_CA"
	EgressCAParam = "cube.egress_ca"
)

// EncodeCA is a CA certificate's form in EgressCAEnv and EgressCAParam.
func EncodeCA(der []byte) string { return base64.RawStdEncoding.EncodeToString(der) }

// DecodeCA reverses EncodeCA.
func DecodeCA(s string) ([]byte, error) { return base64.RawStdEncoding.DecodeString(s) }

// DropSysAdminEnv, set to 1 in PID 1's environment, makes cube-agent drop
// CAP_SYS_ADMIN from its bounding set before it serves (agent.DropSysAdminBound):
// the gVisor spec grants PID 1 the capability for the hostname only.
const DropSysAdminEnv = "CUBE_AGENT_DROP_SYS_ADMIN"

// WorkdirEnv gives the agent the template's working directory (its
// image's WORKDIR, a template build's setWorkdir): where commands and
// relative paths start until /init names another, as in E2B. The agent
// removes it from its environment before anything starts.
const WorkdirEnv = "CUBE_AGENT_WORKDIR"

// AgentOnlyEnv, in PID 1's environment, lists (comma-separated) the
// variables the runtime set for cube-agent's own Go runtime: the agent
// unsets them first thing, so nothing it starts inherits them.
const AgentOnlyEnv = "CUBE_AGENT_ONLY_ENV"

// AgentGOMAXPROCS is the GOMAXPROCS containers start cube-agent with when
// their template sets none. An idle agent is most of an idle sandbox's
// memory, and with one P the Go runtime keeps one set of per-P caches and
// starts fewer threads (each a kernel stack and a task): 0.2 MiB less
// anonymous memory and 2-3 threads fewer per sandbox. The agent relays
// work (processes, files, streams) that runs in the processes it starts,
// which the setting does not reach.
const AgentGOMAXPROCS = "1"

// DetachConsoleEnv, set to 1 in PID 1's environment, makes cube-agent
// point its stdout and stderr at /dev/null once it listens. gVisor's
// sentry lets root in the sandbox open a non-dumpable process's
// /proc/<pid>/fd, so as long as the agent holds the console (a file on
// the host) anything inside could write to it without bound.
const DetachConsoleEnv = "CUBE_AGENT_DETACH_CONSOLE"

// GET /_cube/logs: the sandbox's log, which the agent keeps in memory up
// to a size cap (the oldest lines go first): the output lines of the
// processes started through envd (pipes; a PTY is a terminal, not a log)
// and the agent's own log. Query: start and end (Unix milliseconds,
// inclusive; absent = open), after (a sequence number: entries after it,
// for exact paging), limit (entries, default and most 1000),
// direction=backward for the newest first (from end back).

// Log sources.
const (
	LogSourceAgent   = "agent"   // the agent's own log (PID 1, the init)
	LogSourceProcess = "process" // a process started through envd
)

// LogEntry is one line of a sandbox's log.
type LogEntry struct {
	Seq    uint64    `json:"seq"`
	Time   time.Time `json:"ts"`
	Source string    `json:"source"`
	Stream string    `json:"stream"` // stdout or stderr
	PID    uint32    `json:"pid,omitempty"`
	Cmd    string    `json:"cmd,omitempty"`
	Line   string    `json:"line"`
}

// LogsResponse answers GET /_cube/logs.
type LogsResponse struct {
	Entries []LogEntry `json:"entries"`
	// Dropped is how many lines the cap has pushed out since the agent
	// started.
	Dropped uint64 `json:"dropped"`
}
