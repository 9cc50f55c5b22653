-- The table {{name}}'s statement writes to. Apply it once: psql "$DATABASE_URL" -f schema.sql
CREATE TABLE IF NOT EXISTS placed_orders (
  order_id    bigint PRIMARY KEY,
  customer_id bigint NOT NULL,
  total_cents bigint NOT NULL
);
