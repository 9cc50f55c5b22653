-- The database's own limit for one message per transaction: the loyalty consumer's claim,
-- credit and ledger writes, with no broker and no consumer process, driven by pgbench.
--
--   pgbench -n -M prepared -c C -j C -t ceil(M/C) -f bench/pgbench/message.sql \
--     -D i=0 -D clients=C -D messages=M -D orders=N -D customers=20 -D seed=S
--
-- The stream is the same data `idem-traffic --orders N --duplicates D` publishes
-- (M = N + round(N * D) messages): every order 1..N once, plus M - N redeliveries of orders
-- drawn uniformly from 1..N, in a shuffled order; customer_id = order_id % customers + 1 and
-- total_cents = 500 + (order_id * 7919) % 20000, as in idem-traffic. Message s (0 ≤ s < M)
-- is slot permute(s, M, seed) of the stream: slots below N are the orders themselves, the
-- rest are redeliveries. The C clients take the messages in turns (client c takes
-- s = c, c + C, c + 2C, …; `i` is each client's own counter, variables persist between a
-- client's transactions), so every message is processed exactly once, concurrently, and
-- redeliveries of one order may run at the same time as in the real consumers.
\set i :i + 1
\set s (:i - 1) * :clients + :client_id
\if :s < :messages
\set p permute(:s, :messages, :seed)
\set order_id CASE WHEN :p < :orders THEN :p + 1 ELSE (hash(:p, :seed) % :orders + :orders) % :orders + 1 END
\set customer_id :order_id % :customers + 1
\set points (500 + (:order_id * 7919) % 20000) / 100
-- One transaction, the guide's three writes: the claim, and only if it inserted a row, the
-- credit and the ledger row. A single statement is its own transaction (no BEGIN or COMMIT
-- around it, which would be two more round trips), so one round trip carries all three: the
-- least any client can pay per message.
WITH claim AS (
  INSERT INTO processed_messages (consumer, message_key)
  VALUES ('loyalty', 'order-completed:' || :order_id::bigint)
  ON CONFLICT DO NOTHING
  RETURNING 1
), credit AS (
  INSERT INTO balances (customer_id, points)
  SELECT :customer_id::bigint, :points::bigint FROM claim
  ON CONFLICT (customer_id) DO UPDATE SET points = balances.points + EXCLUDED.points
)
INSERT INTO point_ledger (customer_id, order_id, points)
SELECT :customer_id::bigint, :order_id::bigint, :points::bigint FROM claim;
\endif
