-- Teams (E2B's tenancy model): an API key belongs to a team, and so do the
-- sandboxes and snapshots made with it. Another team's objects are not
-- found. Quotas bound a team's sandboxes (every row: creating, running,
-- paused) by count, total milli-CPU and total memory; 0 is no limit.
-- Keys and rows written before this migration belong to the team
-- "default", which has no limits.
CREATE TABLE teams (
  name VARCHAR(128) NOT NULL PRIMARY KEY,
  created_at BIGINT NOT NULL,
  max_sandboxes BIGINT NOT NULL,
  max_milli_cpu BIGINT NOT NULL,
  max_memory_mib BIGINT NOT NULL,
  creates BIGINT NOT NULL
);

INSERT INTO teams (name, created_at, max_sandboxes, max_milli_cpu, max_memory_mib, creates) VALUES ('default', 0, 0, 0, 0, 0);

ALTER TABLE api_keys ADD COLUMN team VARCHAR(128) NOT NULL DEFAULT 'default';

ALTER TABLE sandboxes ADD COLUMN team VARCHAR(128) NOT NULL DEFAULT 'default';

ALTER TABLE snapshots ADD COLUMN team VARCHAR(128) NOT NULL DEFAULT 'default';

CREATE INDEX sandboxes_team ON sandboxes (team, state);

CREATE INDEX snapshots_team_name ON snapshots (team, name);
