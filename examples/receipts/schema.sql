-- Business table of the `receipts` pipeline: one row per receipt issued; the receipt itself
-- leaves through the outbox (idem_outbox) in the same transaction.
CREATE TABLE IF NOT EXISTS receipts (
  order_id    bigint      PRIMARY KEY,
  customer_id bigint      NOT NULL,
  total_cents bigint      NOT NULL CHECK (total_cents BETWEEN 0 AND 100000000),
  issued_at   timestamptz NOT NULL DEFAULT now()
);
