-- One-time tokens with which a new node obtains its certificate (cube
-- join). id is public (it names the token), secret_hash the SHA-256 of
-- its secret (hex); node_id, when not empty, the only node ID it may be
-- used for; expires_ms and used_ms unix milliseconds of the database's
-- clock (used_ms 0: not used yet).
CREATE TABLE join_tokens (
  id VARCHAR(32) NOT NULL PRIMARY KEY,
  secret_hash VARCHAR(64) NOT NULL,
  node_id VARCHAR(64) NOT NULL,
  created_ms BIGINT NOT NULL,
  expires_ms BIGINT NOT NULL,
  used_ms BIGINT NOT NULL,
  used_by VARCHAR(64) NOT NULL
);
