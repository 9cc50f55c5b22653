-- The W3C trace context of the message span that wrote an outbox row (`traceparent`, and
-- `tracestate` when there is one), sent on the row's HTTP or AMQP delivery so the trace goes
-- on past idem. Nullable and without a default: adding them rewrites nothing.
ALTER TABLE idem_outbox
  ADD COLUMN IF NOT EXISTS traceparent text,
  ADD COLUMN IF NOT EXISTS tracestate  text;
