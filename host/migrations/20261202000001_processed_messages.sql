-- The claim ledger (the guide's Step 1): one row per applied message effect.
-- `consumer` lets several consumers share the table without blocking each other.
CREATE TABLE IF NOT EXISTS processed_messages (
  consumer     text        NOT NULL,
  message_key  text        NOT NULL,
  processed_at timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY (consumer, message_key)
);
-- Supports time-based cleanup (the guide's Step 5).
CREATE INDEX IF NOT EXISTS processed_messages_time ON processed_messages (processed_at);
