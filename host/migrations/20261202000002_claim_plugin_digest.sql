-- Which plugin build (sha256 of the component) applied each claim, so an operator can tell
-- which code produced which effect. Nullable: claims written before this column have none.
ALTER TABLE processed_messages ADD COLUMN IF NOT EXISTS plugin_digest text;
