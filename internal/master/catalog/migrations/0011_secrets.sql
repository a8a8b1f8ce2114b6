-- A team's named secrets (values credential rules reference by name).
-- sealed is the value encrypted by cubemaster (AES-256-GCM, bound to team
-- and name) under the master key key_id names; the value is never stored
-- in clear. Times are unix milliseconds.
CREATE TABLE secrets (
  team VARCHAR(128) NOT NULL,
  name VARCHAR(64) NOT NULL,
  key_id VARCHAR(16) NOT NULL,
  sealed TEXT NOT NULL,
  created_ms BIGINT NOT NULL,
  updated_ms BIGINT NOT NULL,
  PRIMARY KEY (team, name)
);
