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
