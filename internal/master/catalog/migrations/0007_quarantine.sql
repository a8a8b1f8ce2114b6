-- Rows the master found undecodable when it started (a sandbox whose
-- network column is not the JSON it wrote), moved out of service with every
-- column as it was, for an operator to inspect (docs/control-plane.md).
CREATE TABLE IF NOT EXISTS quarantine (
  tbl VARCHAR(64) NOT NULL,
  row_key VARCHAR(128) NOT NULL,
  reason TEXT NOT NULL,
  at BIGINT NOT NULL,
  data TEXT NOT NULL,
  PRIMARY KEY (tbl, row_key)
);
