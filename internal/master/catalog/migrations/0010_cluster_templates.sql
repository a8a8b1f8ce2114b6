-- Templates imported through a master (its template store): which exist
-- cluster-wide, whichever replica imported them. digest is the image's
-- manifest digest; object the object-store manifest ID of its blobs (''
-- when the importing replica has no object store: only it can serve
-- them); replica the replica that imported it; created_ms unix
-- milliseconds.
CREATE TABLE cluster_templates (
  id VARCHAR(64) NOT NULL PRIMARY KEY,
  digest VARCHAR(80) NOT NULL,
  blob_bytes BIGINT NOT NULL,
  source VARCHAR(1024) NOT NULL,
  runtime VARCHAR(32) NOT NULL,
  warm BOOLEAN NOT NULL,
  object VARCHAR(160) NOT NULL,
  replica VARCHAR(128) NOT NULL,
  created_ms BIGINT NOT NULL
);
