-- Operator pauses that last (`idem pause`, or the admin API with "persist"): every host of the
-- consumer stops consuming while paused_at is set, restarts included, until a resume clears it.
ALTER TABLE idem_consumers
  ADD COLUMN IF NOT EXISTS paused_at    timestamptz,
  ADD COLUMN IF NOT EXISTS pause_reason text;

-- Dead letters an operator archived (`idem dlq archive`, the console's Archive) before
-- discarding them from the dead-letter queue or stream: kept here, whole, for good.
CREATE TABLE IF NOT EXISTS idem_dead_letters (
  id          bigserial   PRIMARY KEY,
  pipeline    text        NOT NULL,
  -- Its id in the dead-letter queue (a digest) or stream (its sequence).
  dead_letter text        NOT NULL,
  archived_at timestamptz NOT NULL DEFAULT now(),
  error_kind  text,
  reason      text,
  message_id  text,
  subject     text        NOT NULL,
  -- [[name, value], …] as the dead letter carried them.
  headers     jsonb       NOT NULL,
  body        bytea       NOT NULL
);
