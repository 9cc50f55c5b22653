-- Business tables of the demo `loyalty` pipeline (the guide's example).
-- Idempotent: `scripts/demo.sh` and the tests apply it to their own database.
CREATE TABLE IF NOT EXISTS balances (
  customer_id bigint PRIMARY KEY,
  points      bigint NOT NULL DEFAULT 0
);

CREATE TABLE IF NOT EXISTS point_ledger (
  customer_id bigint      NOT NULL,
  order_id    bigint      NOT NULL,
  points      bigint      NOT NULL CHECK (points >= 0),
  credited_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS point_ledger_order ON point_ledger (order_id);
