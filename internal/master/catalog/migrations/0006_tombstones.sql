-- Sandboxes the master removed on purpose (killed, a create undone, a row
-- whose sandbox was gone): a node that comes back holding one of them is
-- told to destroy it, while a recent managed sandbox the catalog never
-- had (rows lost with the catalog) is adopted. Kept as long as the
-- adoption window; pruned after.
CREATE TABLE sandbox_tombstones (
  id VARCHAR(64) NOT NULL PRIMARY KEY,
  deleted_at BIGINT NOT NULL
);

CREATE INDEX sandbox_tombstones_deleted_at ON sandbox_tombstones (deleted_at);
