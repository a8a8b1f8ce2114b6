-- A team's volumes: an ext4 image on one node's storage pool (node_id,
-- '' until the first sandbox that mounts it is placed), size_mib its
-- capacity. sandbox_id is the sandbox that holds it (one at a time; a
-- holder whose row is gone no longer holds it) and mount_path where that
-- sandbox mounts it. token is what E2B's SDK is handed for the volume
-- content API. Times are unix milliseconds.
CREATE TABLE volumes (
  id VARCHAR(64) NOT NULL PRIMARY KEY,
  team VARCHAR(128) NOT NULL,
  name VARCHAR(128) NOT NULL,
  size_mib BIGINT NOT NULL,
  node_id VARCHAR(128) NOT NULL DEFAULT '',
  sandbox_id VARCHAR(64) NOT NULL DEFAULT '',
  mount_path VARCHAR(1024) NOT NULL DEFAULT '',
  token VARCHAR(64) NOT NULL,
  created_ms BIGINT NOT NULL
);

CREATE UNIQUE INDEX volumes_team_name ON volumes (team, name);

CREATE INDEX volumes_sandbox ON volumes (sandbox_id);
