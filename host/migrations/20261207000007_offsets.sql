-- Where each consumer resumes in a log it reads by offset (a Kafka topic's partitions): the
-- offset below which every message of the partition is settled, recorded as the source
-- commits it to the broker. A group whose own offsets expired or were reset, or a group
-- renamed, resumes here instead of reading again what the claims may have forgotten since.
CREATE TABLE IF NOT EXISTS idem_offsets (
  consumer    text        NOT NULL,
  topic       text        NOT NULL,
  partition   int4        NOT NULL,
  next_offset int8        NOT NULL,
  recorded_at timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY (consumer, topic, partition)
);
