-- The snapshot a paused sandbox's node exported to the object store as it
-- paused (master store.export_on_pause): if that node is lost, the
-- sandbox resumes on another node from it. Empty: none.
ALTER TABLE sandboxes ADD COLUMN pause_snapshot VARCHAR(32) NOT NULL DEFAULT '';
