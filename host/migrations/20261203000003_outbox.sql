-- The transactional outbox (the guide's Step 6): rows written in a message's transaction by
-- `outbox` effects, delivered after commit by the relay in `idem run`.
CREATE TABLE IF NOT EXISTS idem_outbox (
  id              bigserial   PRIMARY KEY,
  consumer        text        NOT NULL,
  message_key     text        NOT NULL,
  destination     text        NOT NULL,
  -- Sent as `Idempotency-Key` (HTTP) or `message-id` (AMQP); one row per destination and key.
  idempotency_key text        NOT NULL,
  payload         bytea       NOT NULL,
  headers         jsonb       NOT NULL DEFAULT '{}',
  created_at      timestamptz NOT NULL DEFAULT now(),
  attempts        integer     NOT NULL DEFAULT 0,
  next_attempt_at timestamptz NOT NULL DEFAULT now(),
  last_error      text,
  delivered_at    timestamptz,
  -- Set after the last allowed attempt failed; `last_error` says why.
  parked_at       timestamptz,
  CONSTRAINT idem_outbox_once UNIQUE (destination, idempotency_key)
);

-- The relay's queue: pending rows in delivery order.
CREATE INDEX IF NOT EXISTS idem_outbox_pending ON idem_outbox (next_attempt_at, id)
  WHERE delivered_at IS NULL AND parked_at IS NULL;
-- Retention of delivered rows.
CREATE INDEX IF NOT EXISTS idem_outbox_delivered ON idem_outbox (delivered_at)
  WHERE delivered_at IS NOT NULL;
