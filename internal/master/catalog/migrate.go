package catalog

import (
	"context"
	"database/sql"
	"embed"
	"fmt"
	"io/fs"
	"path"
	"sort"
	"strconv"
	"strings"
	"time"
)

//go:embed migrations/*.sql
var migrationFS embed.FS

// Migration is one embedded schema change, NNNN_name.sql.
type Migration struct {
	Version    int
	Name       string
	Statements []string
}

// Migrations returns the embedded migrations in version order.
func Migrations() ([]Migration, error) {
	ents, err := fs.ReadDir(migrationFS, "migrations")
	if err != nil {
		return nil, err
	}
	var out []Migration
	for _, e := range ents {
		num, name, ok := strings.Cut(strings.TrimSuffix(e.Name(), ".sql"), "_")
		v, err := strconv.Atoi(num)
		if !ok || err != nil || v <= 0 {
			return nil, fmt.Errorf("migration %s: want NNNN_name.sql", e.Name())
		}
		body, err := migrationFS.ReadFile(path.Join("migrations", e.Name()))
		if err != nil {
			return nil, err
		}
		out = append(out, Migration{Version: v, Name: name, Statements: splitStatements(string(body))})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Version < out[j].Version })
	for i := range out {
		if out[i].Version != i+1 {
			return nil, fmt.Errorf("migrations: version %d missing", i+1)
		}
	}
	return out, nil
}

// splitStatements splits a migration at semicolons that end a line and
// drops "--" comment lines: the MySQL driver runs one statement per Exec.
func splitStatements(body string) []string {
	var out []string
	var cur strings.Builder
	for _, line := range strings.Split(body, "\n") {
		t := strings.TrimSpace(line)
		if t == "" || strings.HasPrefix(t, "--") {
			continue
		}
		cur.WriteString(line)
		cur.WriteByte('\n')
		if strings.HasSuffix(t, ";") {
			out = append(out, strings.TrimSuffix(strings.TrimSpace(cur.String()), ";"))
			cur.Reset()
		}
	}
	if s := strings.TrimSpace(cur.String()); s != "" {
		out = append(out, s)
	}
	return out
}

// migrate applies the migrations newer than the schema_migrations record.
// Each migration and its record commit together on SQLite; MySQL commits
// DDL implicitly, so there a migration that fails half-way must be
// repaired by hand (the error names it).
func (c *Catalog) migrate(ctx context.Context) error {
	if _, err := c.exec(ctx, `CREATE TABLE IF NOT EXISTS schema_migrations (
  version INTEGER NOT NULL PRIMARY KEY,
  name VARCHAR(128) NOT NULL,
  applied_at BIGINT NOT NULL
)`); err != nil {
		return fmt.Errorf("catalog: schema_migrations: %w", err)
	}
	applied, err := c.SchemaVersion(ctx)
	if err != nil {
		return err
	}
	ms, err := Migrations()
	if err != nil {
		return err
	}
	if applied > len(ms) {
		return fmt.Errorf("catalog: database schema version %d is newer than this binary's %d", applied, len(ms))
	}
	for _, m := range ms[applied:] {
		err := c.tx(ctx, func(tx *sql.Tx) error {
			for _, st := range m.Statements {
				if _, err := tx.ExecContext(ctx, st); err != nil {
					return fmt.Errorf("%w\n%s", err, st)
				}
			}
			_, err := tx.ExecContext(ctx, `INSERT INTO schema_migrations (version, name, applied_at) VALUES (?, ?, ?)`,
				m.Version, m.Name, time.Now().UnixMilli())
			return err
		})
		if err != nil {
			return fmt.Errorf("catalog: migration %04d_%s: %w", m.Version, m.Name, err)
		}
	}
	return nil
}

// SchemaVersion is the highest migration applied.
func (c *Catalog) SchemaVersion(ctx context.Context) (int, error) {
	var v sql.NullInt64
	if err := c.db.QueryRowContext(ctx, `SELECT MAX(version) FROM schema_migrations`).Scan(&v); err != nil {
		return 0, fmt.Errorf("catalog: schema version: %w", err)
	}
	return int(v.Int64), nil
}
