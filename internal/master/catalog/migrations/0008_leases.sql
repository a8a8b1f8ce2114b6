-- Leases: the right to run a singleton (the master's lifecycle loops) held
-- by one replica at a time. holder is the holding process (replica ID and
-- a per-process suffix), replica its configured ID, token the fencing
-- token (raised at every change of holder), expires_at when another
-- replica may take it (unix milliseconds of the database's clock).
CREATE TABLE leases (
  name VARCHAR(64) NOT NULL PRIMARY KEY,
  holder VARCHAR(255) NOT NULL,
  replica VARCHAR(255) NOT NULL,
  token BIGINT NOT NULL,
  expires_at BIGINT NOT NULL
);

-- Route changes (a sandbox paused, resumed, killed, failed) made by any
-- replica of a shared catalog: every replica reads them and tells the
-- route caches watching it, wherever the verb ran. Kept a few minutes.
CREATE TABLE route_events (
  id VARCHAR(32) NOT NULL PRIMARY KEY,
  sandbox_id VARCHAR(64) NOT NULL,
  at_ms BIGINT NOT NULL
);

CREATE INDEX route_events_at ON route_events (at_ms);

-- Traffic each replica saw per sandbox (proxied requests, API verbs), for
-- the idle policy the lease's holder enforces: the last activity, the
-- requests open now, and when the replica wrote the row.
CREATE TABLE sandbox_activity (
  sandbox_id VARCHAR(64) NOT NULL,
  replica VARCHAR(255) NOT NULL,
  last_ms BIGINT NOT NULL,
  open_n BIGINT NOT NULL,
  at_ms BIGINT NOT NULL,
  PRIMARY KEY (sandbox_id, replica)
);
