-- Per-sandbox runtime (issues 9 and 10): the driver the sandbox runs on
-- (runc, gvisor, vm), as its node reported it. Snapshots record theirs so
-- a create from one can be checked against the runtime the client asked
-- for. Empty in rows written before this migration: unknown.
ALTER TABLE sandboxes ADD COLUMN runtime VARCHAR(32) NOT NULL DEFAULT '';

ALTER TABLE snapshots ADD COLUMN runtime VARCHAR(32) NOT NULL DEFAULT '';
