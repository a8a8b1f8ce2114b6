-- Idle policy (cubeproxy, issue 7): pause a running sandbox after this many
-- milliseconds without proxied or API traffic and with nothing in flight.
-- 0 means no idle policy.
ALTER TABLE sandboxes ADD COLUMN idle_timeout_ms BIGINT NOT NULL DEFAULT 0;
