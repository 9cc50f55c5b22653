-- Every consumer's retention window, recorded by each host at start: partition mode drops a
-- day only when it is past the longest window of every consumer sharing processed_messages.
-- Delete a consumer's row when it is retired for good.
CREATE TABLE IF NOT EXISTS idem_consumers (
  consumer         text        PRIMARY KEY,
  retention_window interval    NOT NULL,
  recorded_at      timestamptz NOT NULL DEFAULT now()
);
