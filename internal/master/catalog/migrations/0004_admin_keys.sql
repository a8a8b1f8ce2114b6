-- Admin API keys: the E2B API's admin operations (template delete) need a
-- key created as admin (cubecli apikey create --admin). Keys written
-- before this migration are not admin.
ALTER TABLE api_keys ADD COLUMN admin INTEGER NOT NULL DEFAULT 0;
