package catalog

import (
	"context"
	"database/sql"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
)

// Sandbox states the catalog records. A sandbox row exists from the moment
// the master decides to create it (Creating, before any node is asked) until
// it is gone from its node.
const (
	StateCreating = "creating"
	StateRunning  = "running"
	StatePaused   = "paused"
	// StateFailed: its node saw it die (or a verb fail beyond undo); the
	// row stays, with an event saying why, until a kill or its deadline.
	StateFailed = "failed"
)

// Network is a sandbox's egress configuration as the API gave it.
type Network struct {
	AllowInternet *bool    `json:"allow_internet,omitempty"`
	AllowOut      []string `json:"allow_out,omitempty"`
	DenyOut       []string `json:"deny_out,omitempty"`
	// AllowPublicTraffic=false means proxied traffic needs the traffic
	// access token.
	AllowPublicTraffic *bool `json:"allow_public_traffic,omitempty"`
	// Credentials are headers the node's egress proxy injects into HTTPS
	// requests to a host (docs/network.md "Credential injection"). A
	// literal Value is stored as given (not encrypted); a rule naming a
	// secret stores the name only. Never returned by the API.
	Credentials []Credential `json:"credentials,omitempty"`
	// Requests are method and path rules for hosts whose TLS the node's
	// egress proxy terminates (docs/network.md "Request rules").
	Requests []RequestRule `json:"requests,omitempty"`
}

// RequestRule lets through requests to Host whose method is one of
// Methods (none: any) and whose path matches one of Paths (none: any).
type RequestRule struct {
	Host    string   `json:"host"`
	Methods []string `json:"methods,omitempty"`
	Paths   []string `json:"paths,omitempty"`
}

// Credential sets Header on every HTTPS request to Host to Value, or to
// the value of the team's secret SecretName (one of the two).
type Credential struct {
	Host       string `json:"host"`
	Header     string `json:"header"`
	Value      string `json:"value,omitempty"`
	SecretName string `json:"secret_name,omitempty"`
}

// Sandbox is one catalog row.
type Sandbox struct {
	ID         string
	Version    int64 // optimistic-concurrency counter, managed by the catalog
	TemplateID string
	Alias      string // the name the client asked for, when it was an alias
	NodeID     string // empty until placed
	State      string
	MilliCPU   int64
	MemoryMiB  int64
	DiskMiB    int64
	StartedAt  time.Time
	// EndAt is the deadline: a running sandbox past it is killed, or
	// paused when AutoPause.
	EndAt              time.Time
	AutoPause          bool
	AutoResume         bool
	EnvdAccessToken    string
	TrafficAccessToken string
	EnvdVersion        string // what the sandbox's agent reports
	Network            Network
	APIKeyID           string
	Metadata           map[string]string
	// IdleTimeout pauses a running sandbox after this long without
	// traffic (the master's idle loop); 0: never.
	IdleTimeout time.Duration
	// Runtime is the driver the sandbox runs on (runc, gvisor, vm): the
	// one the client asked for, else what its node chose.
	Runtime string
	// Team owns the sandbox (the team of the API key that made it); ""
	// at create is DefaultTeam. It never changes.
	Team string
	// PauseSnapshot is the snapshot of this paused sandbox its node
	// exported to the object store as it paused (store.export_on_pause);
	// "" when none. It is dropped from the store when the sandbox runs
	// again or goes.
	PauseSnapshot string
}

const sandboxCols = `id, version, template_id, alias, node_id, state, milli_cpu, memory_mib, disk_mib, started_at, end_at,
auto_pause, auto_resume, envd_access_token, traffic_access_token, envd_version, network, api_key_id, idle_timeout_ms, runtime, pause_snapshot, team`

func scanSandbox(s interface{ Scan(...any) error }) (*Sandbox, error) {
	var sb Sandbox
	var started, end int64
	var ap, ar int
	var network string
	var idle int64
	if err := s.Scan(&sb.ID, &sb.Version, &sb.TemplateID, &sb.Alias, &sb.NodeID, &sb.State, &sb.MilliCPU, &sb.MemoryMiB,
		&sb.DiskMiB, &started, &end, &ap, &ar, &sb.EnvdAccessToken, &sb.TrafficAccessToken, &sb.EnvdVersion, &network, &sb.APIKeyID, &idle, &sb.Runtime, &sb.PauseSnapshot, &sb.Team); err != nil {
		return nil, err
	}
	sb.StartedAt, sb.EndAt = fromMS(started), fromMS(end)
	sb.AutoPause, sb.AutoResume = ap != 0, ar != 0
	sb.IdleTimeout = time.Duration(idle) * time.Millisecond
	if network != "" {
		if err := json.Unmarshal([]byte(network), &sb.Network); err != nil {
			return nil, fmt.Errorf("sandbox %s: network column: %w", sb.ID, err)
		}
	}
	return &sb, nil
}

func (s *Sandbox) args() []any {
	network, _ := json.Marshal(s.Network)
	return []any{s.ID, s.Version, s.TemplateID, s.Alias, s.NodeID, s.State, s.MilliCPU, s.MemoryMiB, s.DiskMiB,
		ms(s.StartedAt), ms(s.EndAt), b2i(s.AutoPause), b2i(s.AutoResume), s.EnvdAccessToken, s.TrafficAccessToken,
		s.EnvdVersion, string(network), s.APIKeyID, s.IdleTimeout.Milliseconds(), s.Runtime, s.PauseSnapshot}
}

// CreateSandbox inserts a sandbox and its metadata. AlreadyExists if the ID
// is taken; ResourceExhausted (a *QuotaError) if the row would take its
// team over a quota. The quota is checked in the transaction that inserts
// the row, after taking the team's row lock (checkQuota), so concurrent
// creates of one team, on any number of masters, cannot exceed it.
func (c *Catalog) CreateSandbox(ctx context.Context, s *Sandbox) error {
	s.Version = 1
	if s.Team == "" {
		s.Team = DefaultTeam
	}
	// A quota set between this read and the transaction applies from the
	// next create on.
	limited, err := c.teamLimited(ctx, s.Team)
	if err != nil {
		return err
	}
	err = c.tx(ctx, func(tx *sql.Tx) error {
		if limited {
			if err := checkQuota(ctx, tx, s); err != nil {
				return err
			}
		}
		if _, err := tx.ExecContext(ctx, `INSERT INTO sandboxes (`+sandboxCols+`) VALUES (`+placeholders(22)+`)`, append(s.args(), s.Team)...); err != nil { //nolint:gosec // G202: constant column lists and placeholders; values are bound as args
			return err
		}
		return putMetadata(ctx, tx, s.ID, s.Metadata)
	})
	if isDuplicate(err) {
		return fmt.Errorf("sandbox %q: %w", s.ID, errdefs.ErrAlreadyExists)
	}
	return err
}

func putMetadata(ctx context.Context, tx *sql.Tx, id string, md map[string]string) error {
	keys := make([]string, 0, len(md))
	for k := range md {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		if _, err := tx.ExecContext(ctx, `INSERT INTO sandbox_metadata (sandbox_id, k, v) VALUES (?, ?, ?)`, id, k, md[k]); err != nil {
			return err
		}
	}
	return nil
}

// GetSandbox returns one sandbox with its metadata.
func (c *Catalog) GetSandbox(ctx context.Context, id string) (*Sandbox, error) {
	s, err := scanSandbox(c.db.QueryRowContext(ctx, `SELECT `+sandboxCols+` FROM sandboxes WHERE id = ?`, id))
	if errors.Is(err, sql.ErrNoRows) {
		return nil, fmt.Errorf("sandbox %q: %w", id, errdefs.ErrNotFound)
	}
	if err != nil {
		return nil, err
	}
	if err := c.loadMetadata(ctx, []*Sandbox{s}); err != nil {
		return nil, err
	}
	return s, nil
}

func (c *Catalog) loadMetadata(ctx context.Context, sbs []*Sandbox) error {
	if len(sbs) == 0 {
		return nil
	}
	byID := make(map[string]*Sandbox, len(sbs))
	args := make([]any, 0, len(sbs))
	for _, s := range sbs {
		byID[s.ID] = s
		s.Metadata = map[string]string{}
		args = append(args, s.ID)
	}
	rows, err := c.db.QueryContext(ctx, `SELECT sandbox_id, k, v FROM sandbox_metadata WHERE sandbox_id IN (`+placeholders(len(args))+`)`, args...) //nolint:gosec // G202: constant column lists and placeholders; values are bound as args
	if err != nil {
		return err
	}
	defer rows.Close()
	for rows.Next() {
		var id, k, v string
		if err := rows.Scan(&id, &k, &v); err != nil {
			return err
		}
		byID[id].Metadata[k] = v
	}
	return rows.Err()
}

// ErrConflict means a row changed between read and write more times than
// Update retries; the caller may retry the whole operation.
var ErrConflict = fmt.Errorf("catalog: concurrent update: %w", errdefs.ErrAborted)

// UpdateSandbox reads a sandbox, lets fn change it, and writes it back if
// nobody else wrote it meanwhile (else it re-reads and calls fn again).
// fn may return an error to abort. Metadata is not rewritten.
func (c *Catalog) UpdateSandbox(ctx context.Context, id string, fn func(*Sandbox) error) (*Sandbox, error) {
	return c.updateSandbox(ctx, id, "", nil, nil, fn)
}

// updateSandbox is UpdateSandbox whose write also requires guard (SQL
// appended to the UPDATE's WHERE, with guardArgs) in the same statement;
// when a write changes nothing, refused (when not nil) says whether the
// guard failed, and that error is returned instead of reading again.
func (c *Catalog) updateSandbox(ctx context.Context, id, guard string, guardArgs []any, refused func() error, fn func(*Sandbox) error) (*Sandbox, error) {
	for attempt := range 8 {
		if attempt > 0 {
			// Lost a race: back off a little, with jitter, so the writers
			// do not collide again in lockstep.
			time.Sleep(time.Duration(rand.IntN(1<<attempt)) * time.Millisecond) //nolint:gosec // G404: retry jitter, not a secret
		}
		s, err := c.GetSandbox(ctx, id)
		if err != nil {
			return nil, err
		}
		if err := fn(s); err != nil {
			return nil, err
		}
		s.ID = id
		old := s.Version
		s.Version++
		a := s.args()
		res, err := c.exec(ctx, `UPDATE sandboxes SET version = ?, template_id = ?, alias = ?, node_id = ?, state = ?,
milli_cpu = ?, memory_mib = ?, disk_mib = ?, started_at = ?, end_at = ?, auto_pause = ?, auto_resume = ?,
envd_access_token = ?, traffic_access_token = ?, envd_version = ?, network = ?, api_key_id = ?, idle_timeout_ms = ?, runtime = ?, pause_snapshot = ? WHERE id = ? AND version = ?`+guard,
			append(append(a[1:], id, old), guardArgs...)...)
		if err != nil {
			return nil, err
		}
		if n, _ := res.RowsAffected(); n == 1 {
			return s, nil
		}
		if refused != nil {
			if err := refused(); err != nil {
				return nil, err
			}
		}
	}
	return nil, fmt.Errorf("sandbox %q: %w", id, ErrConflict)
}

// DeleteSandbox removes a sandbox, its metadata and its events, and
// leaves a tombstone (Tombstoned) in the same transaction: the removal
// was on purpose, and a node that still holds the sandbox must destroy
// it rather than have it adopted.
func (c *Catalog) DeleteSandbox(ctx context.Context, id string) error {
	return c.tx(ctx, func(tx *sql.Tx) error {
		res, err := tx.ExecContext(ctx, `DELETE FROM sandboxes WHERE id = ?`, id)
		if err != nil {
			return err
		}
		if n, _ := res.RowsAffected(); n == 0 {
			return fmt.Errorf("sandbox %q: %w", id, errdefs.ErrNotFound)
		}
		for _, q := range []string{`DELETE FROM sandbox_metadata WHERE sandbox_id = ?`, `DELETE FROM sandbox_events WHERE sandbox_id = ?`} {
			if _, err := tx.ExecContext(ctx, q, id); err != nil {
				return err
			}
		}
		// An upsert, not a delete and an insert: deleting a tombstone
		// that is not there locks its gap in InnoDB, and two deletes
		// inserting into each other's gaps deadlock.
		upsert := `INSERT INTO sandbox_tombstones (id, deleted_at) VALUES (?, ?) ON CONFLICT(id) DO UPDATE SET deleted_at = excluded.deleted_at`
		if c.driver == MySQL {
			upsert = `INSERT INTO sandbox_tombstones (id, deleted_at) VALUES (?, ?) ON DUPLICATE KEY UPDATE deleted_at = VALUES(deleted_at)`
		}
		_, err = tx.ExecContext(ctx, upsert, id, ms(time.Now()))
		return err
	})
}

// Tombstoned reports whether the sandbox id was removed with
// DeleteSandbox since the tombstones were last pruned.
func (c *Catalog) Tombstoned(ctx context.Context, id string) (bool, error) {
	var n int
	if err := c.db.QueryRowContext(ctx, `SELECT COUNT(*) FROM sandbox_tombstones WHERE id = ?`, id).Scan(&n); err != nil {
		return false, err
	}
	return n > 0, nil
}

// PruneTombstones forgets removals made before before.
func (c *Catalog) PruneTombstones(ctx context.Context, before time.Time) (int64, error) {
	res, err := c.exec(ctx, `DELETE FROM sandbox_tombstones WHERE deleted_at < ?`, ms(before))
	if err != nil {
		return 0, err
	}
	return res.RowsAffected()
}

// Query selects sandboxes. Zero fields do not filter.
type Query struct {
	// Team: only this team's sandboxes.
	Team         string
	States       []string
	Metadata     map[string]string // every pair must match
	TemplateID   string            // the template ID or the alias used
	NodeID       string
	StartedAfter time.Time
	Ascending    bool // oldest first; default newest first
	Limit        int  // 0 = no limit
	// After is the cursor of the last row of the previous page (NextToken).
	After string
}

// cursor is an opaque page token: the (started_at, id) of the last row.
func encodeCursor(s *Sandbox) string {
	return base64.RawURLEncoding.EncodeToString([]byte(strconv.FormatInt(ms(s.StartedAt), 10) + "." + s.ID))
}

func decodeCursor(tok string) (int64, string, error) {
	b, err := base64.RawURLEncoding.DecodeString(tok)
	if err == nil {
		at, id, ok := strings.Cut(string(b), ".")
		if v, perr := strconv.ParseInt(at, 10, 64); ok && perr == nil && id != "" {
			return v, id, nil
		}
	}
	return 0, "", fmt.Errorf("nextToken %q is not a valid page token: %w", tok, errdefs.ErrInvalidArgument)
}

// ListSandboxes returns a page of matching sandboxes ordered by start time
// (then ID), and the cursor of the next page ("" when this is the last).
func (c *Catalog) ListSandboxes(ctx context.Context, q Query) ([]*Sandbox, string, error) {
	var where []string
	var args []any
	if q.Team != "" {
		where = append(where, `team = ?`)
		args = append(args, q.Team)
	}
	if len(q.States) > 0 {
		where = append(where, `state IN (`+placeholders(len(q.States))+`)`)
		for _, s := range q.States {
			args = append(args, s)
		}
	}
	keys := make([]string, 0, len(q.Metadata))
	for k := range q.Metadata {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		where = append(where, `EXISTS (SELECT 1 FROM sandbox_metadata m WHERE m.sandbox_id = sandboxes.id AND m.k = ? AND m.v = ?)`)
		args = append(args, k, q.Metadata[k])
	}
	if q.TemplateID != "" {
		where = append(where, `(template_id = ? OR alias = ?)`)
		args = append(args, q.TemplateID, q.TemplateID)
	}
	if q.NodeID != "" {
		where = append(where, `node_id = ?`)
		args = append(args, q.NodeID)
	}
	if !q.StartedAfter.IsZero() {
		where = append(where, `started_at >= ?`)
		args = append(args, ms(q.StartedAfter))
	}
	order, cmp := "DESC", "<"
	if q.Ascending {
		order, cmp = "ASC", ">"
	}
	if q.After != "" {
		at, id, err := decodeCursor(q.After)
		if err != nil {
			return nil, "", err
		}
		where = append(where, `(started_at `+cmp+` ? OR (started_at = ? AND id `+cmp+` ?))`)
		args = append(args, at, at, id)
	}
	stmt := `SELECT ` + sandboxCols + ` FROM sandboxes`
	if len(where) > 0 {
		stmt += ` WHERE ` + strings.Join(where, ` AND `)
	}
	stmt += ` ORDER BY started_at ` + order + `, id ` + order
	if q.Limit > 0 {
		// One extra row tells whether there is a next page.
		stmt += ` LIMIT ` + strconv.Itoa(q.Limit+1)
	}
	out, err := c.querySandboxes(ctx, stmt, args...)
	if err != nil {
		return nil, "", err
	}
	next := ""
	if q.Limit > 0 && len(out) > q.Limit {
		out = out[:q.Limit]
		next = encodeCursor(out[len(out)-1])
	}
	if err := c.loadMetadata(ctx, out); err != nil {
		return nil, "", err
	}
	return out, next, nil
}

func (c *Catalog) querySandboxes(ctx context.Context, stmt string, args ...any) ([]*Sandbox, error) {
	rows, err := c.db.QueryContext(ctx, stmt, args...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []*Sandbox
	for rows.Next() {
		s, err := scanSandbox(rows)
		if err != nil {
			return nil, err
		}
		out = append(out, s)
	}
	return out, rows.Err()
}

// Expired returns running sandboxes whose deadline is at or before now,
// earliest first, at most limit.
func (c *Catalog) Expired(ctx context.Context, now time.Time, limit int) ([]*Sandbox, error) {
	return c.querySandboxes(ctx, `SELECT `+sandboxCols+` FROM sandboxes WHERE state IN (?, ?) AND end_at <= ? ORDER BY end_at LIMIT `+strconv.Itoa(limit),
		StateRunning, StateFailed, ms(now))
}

// ExpiredNodes returns the nodes that hold a running or failed sandbox
// whose deadline is at or before now, so expiry can work on each node on
// its own (one node's backlog never hides another's).
func (c *Catalog) ExpiredNodes(ctx context.Context, now time.Time) ([]string, error) {
	rows, err := c.db.QueryContext(ctx, `SELECT DISTINCT node_id FROM sandboxes WHERE state IN (?, ?) AND end_at <= ? ORDER BY node_id`,
		StateRunning, StateFailed, ms(now))
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []string
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			return nil, err
		}
		out = append(out, id)
	}
	return out, rows.Err()
}

// ExpiredOn is Expired for the sandboxes of one node.
func (c *Catalog) ExpiredOn(ctx context.Context, nodeID string, now time.Time, limit int) ([]*Sandbox, error) {
	return c.querySandboxes(ctx, `SELECT `+sandboxCols+` FROM sandboxes WHERE node_id = ? AND state IN (?, ?) AND end_at <= ? ORDER BY end_at LIMIT `+strconv.Itoa(limit),
		nodeID, StateRunning, StateFailed, ms(now))
}

// CountByNode returns how many sandboxes the catalog places on each node.
func (c *Catalog) CountByNode(ctx context.Context) (map[string]int, error) {
	rows, err := c.db.QueryContext(ctx, `SELECT node_id, COUNT(*) FROM sandboxes GROUP BY node_id`)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	out := map[string]int{}
	for rows.Next() {
		var id string
		var n int
		if err := rows.Scan(&id, &n); err != nil {
			return nil, err
		}
		out[id] = n
	}
	return out, rows.Err()
}
