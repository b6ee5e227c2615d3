-- idem: the transactional outbox and the record of idempotent consumers (PostgreSQL).
--
-- idem_outbox holds the events handlers enqueue in their own transactions. The relay publishes
-- each topic in id order: an event whose transaction committed before another's began has the
-- smaller id, so it is published first.
--
-- Each statement creates only what is missing: a database whose event tables an earlier
-- release created together with the key table is adopted as it is.
CREATE TABLE IF NOT EXISTS idem_outbox (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id     text        NOT NULL,
    topic        text        NOT NULL,
    payload      text        NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    published_at timestamptz
);
CREATE INDEX IF NOT EXISTS idem_outbox_pending ON idem_outbox (topic, id) WHERE published_at IS NULL;
CREATE INDEX IF NOT EXISTS idem_outbox_published ON idem_outbox (published_at) WHERE published_at IS NOT NULL;

-- One row per topic the relay has seen: a relay locks it (FOR UPDATE SKIP LOCKED) while it
-- publishes that topic's events, so that relays share topics and each topic keeps its order.
-- relay and leased_until are used on SQLite only, which has no row locks.
CREATE TABLE IF NOT EXISTS idem_outbox_topics (
    topic        text PRIMARY KEY,
    relay        text,
    leased_until bigint
);

-- The messages each consumer has processed: written in the consumer's transaction, so that a
-- redelivered message finds its id here exactly when its effects were committed.
CREATE TABLE IF NOT EXISTS idem_consumed (
    consumer     text        NOT NULL,
    message_id   text        NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, message_id)
);
CREATE INDEX IF NOT EXISTS idem_consumed_processed_at ON idem_consumed (processed_at);

-- Failed attempts, counted outside the consumer's rolled-back transaction.
CREATE TABLE IF NOT EXISTS idem_consumer_failures (
    consumer   text        NOT NULL,
    message_id text        NOT NULL,
    attempts   integer     NOT NULL,
    last_error text        NOT NULL,
    failed_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, message_id)
);
CREATE INDEX IF NOT EXISTS idem_consumer_failures_failed_at ON idem_consumer_failures (failed_at);
