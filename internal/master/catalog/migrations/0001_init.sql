-- Portable SQL: it runs unchanged on SQLite and MySQL/MariaDB. Times are
-- unix milliseconds (BIGINT), booleans SMALLINT 0/1, maps JSON text or
-- rows of their own. Keys are VARCHAR (MySQL cannot index TEXT).
-- Statements end with a semicolon at the end of a line.

CREATE TABLE nodes (
  id VARCHAR(64) NOT NULL PRIMARY KEY,
  address VARCHAR(255) NOT NULL,
  report MEDIUMTEXT NOT NULL,
  schedulable SMALLINT NOT NULL,
  registered_at BIGINT NOT NULL,
  last_heartbeat BIGINT NOT NULL
);

CREATE TABLE node_templates (
  node_id VARCHAR(64) NOT NULL,
  template_id VARCHAR(64) NOT NULL,
  digest VARCHAR(128) NOT NULL,
  size_bytes BIGINT NOT NULL,
  created_at BIGINT NOT NULL,
  PRIMARY KEY (node_id, template_id)
);

CREATE INDEX node_templates_template ON node_templates (template_id);

CREATE TABLE sandboxes (
  id VARCHAR(64) NOT NULL PRIMARY KEY,
  version BIGINT NOT NULL,
  template_id VARCHAR(64) NOT NULL,
  alias VARCHAR(128) NOT NULL,
  node_id VARCHAR(64) NOT NULL,
  state VARCHAR(16) NOT NULL,
  milli_cpu BIGINT NOT NULL,
  memory_mib BIGINT NOT NULL,
  disk_mib BIGINT NOT NULL,
  started_at BIGINT NOT NULL,
  end_at BIGINT NOT NULL,
  auto_pause SMALLINT NOT NULL,
  auto_resume SMALLINT NOT NULL,
  envd_access_token VARCHAR(128) NOT NULL,
  traffic_access_token VARCHAR(128) NOT NULL,
  envd_version VARCHAR(32) NOT NULL,
  network TEXT NOT NULL,
  api_key_id VARCHAR(64) NOT NULL
);

CREATE INDEX sandboxes_expiry ON sandboxes (state, end_at);

CREATE INDEX sandboxes_started ON sandboxes (started_at, id);

CREATE INDEX sandboxes_node ON sandboxes (node_id);

CREATE TABLE sandbox_metadata (
  sandbox_id VARCHAR(64) NOT NULL,
  k VARCHAR(128) NOT NULL,
  v VARCHAR(512) NOT NULL,
  PRIMARY KEY (sandbox_id, k)
);

CREATE INDEX sandbox_metadata_kv ON sandbox_metadata (k, v);

CREATE TABLE sandbox_events (
  sandbox_id VARCHAR(64) NOT NULL,
  at BIGINT NOT NULL,
  level VARCHAR(8) NOT NULL,
  message TEXT NOT NULL,
  fields TEXT NOT NULL,
  PRIMARY KEY (sandbox_id, at)
);

CREATE TABLE snapshots (
  id VARCHAR(64) NOT NULL PRIMARY KEY,
  name VARCHAR(128) NOT NULL,
  sandbox_id VARCHAR(64) NOT NULL,
  node_id VARCHAR(64) NOT NULL,
  template_id VARCHAR(64) NOT NULL,
  has_memory SMALLINT NOT NULL,
  envd_access_token VARCHAR(128) NOT NULL,
  created_at BIGINT NOT NULL
);

CREATE INDEX snapshots_name ON snapshots (name);

CREATE INDEX snapshots_sandbox ON snapshots (sandbox_id);

CREATE TABLE api_keys (
  id VARCHAR(32) NOT NULL PRIMARY KEY,
  name VARCHAR(128) NOT NULL,
  prefix VARCHAR(16) NOT NULL,
  hash CHAR(64) NOT NULL,
  created_at BIGINT NOT NULL,
  last_used_at BIGINT NOT NULL
);

CREATE UNIQUE INDEX api_keys_hash ON api_keys (hash);

CREATE UNIQUE INDEX api_keys_name ON api_keys (name);
