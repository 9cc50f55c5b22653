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
  credited_at timestamptz NOT NULL DEFAULT now(),
  -- The ledger row is itself an idempotency record (the guide's natural key): one credit
  -- per order. `claim = "natural"` pipelines rely on it; ledger-claim pipelines get a
  -- second line of defence from it.
  CONSTRAINT one_credit_per_order UNIQUE (order_id)
);
