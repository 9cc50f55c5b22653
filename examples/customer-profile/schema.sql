-- Business table of the `customer-profile` pipeline (claim = "none"): a read model kept by
-- version-guarded upserts. Idempotent: the demo and the tests apply it to their own database.
CREATE TABLE IF NOT EXISTS customer_profiles (
  customer_id bigint      PRIMARY KEY,
  version     bigint      NOT NULL,
  name        text        NOT NULL,
  email       text        NOT NULL,
  updated_at  timestamptz NOT NULL DEFAULT now()
);
