-- idem: the transactional outbox and the record of idempotent consumers (SQLite).
--
-- SQLite admits one writer at a time, so ids are given in commit order: the relay publishes
-- each topic's events in id order. Times are milliseconds since the Unix epoch.
--
-- Each statement creates only what is missing: a database whose event tables an earlier
-- release created together with the key table is adopted as it is.
CREATE TABLE IF NOT EXISTS idem_outbox (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    event_id     TEXT    NOT NULL,
    topic        TEXT    NOT NULL,
    payload      TEXT    NOT NULL,
    created_at   INTEGER NOT NULL,
    published_at INTEGER
);
CREATE INDEX IF NOT EXISTS idem_outbox_pending ON idem_outbox (topic, id) WHERE published_at IS NULL;
CREATE INDEX IF NOT EXISTS idem_outbox_published ON idem_outbox (published_at) WHERE published_at IS NOT NULL;

-- One row per topic the relay has seen. SQLite has no row locks: a relay leases the topic
-- (relay, leased_until) while it publishes that topic's events.
CREATE TABLE IF NOT EXISTS idem_outbox_topics (
    topic        TEXT PRIMARY KEY,
    relay        TEXT,
    leased_until INTEGER
);

-- The messages each consumer has processed, written in the consumer's transaction.
CREATE TABLE IF NOT EXISTS idem_consumed (
    consumer     TEXT    NOT NULL,
    message_id   TEXT    NOT NULL,
    processed_at INTEGER NOT NULL,
    PRIMARY KEY (consumer, message_id)
);
CREATE INDEX IF NOT EXISTS idem_consumed_processed_at ON idem_consumed (processed_at);

-- Failed attempts, counted outside the consumer's rolled-back transaction.
CREATE TABLE IF NOT EXISTS idem_consumer_failures (
    consumer   TEXT    NOT NULL,
    message_id TEXT    NOT NULL,
    attempts   INTEGER NOT NULL,
    last_error TEXT    NOT NULL,
    failed_at  INTEGER NOT NULL,
    PRIMARY KEY (consumer, message_id)
);
CREATE INDEX IF NOT EXISTS idem_consumer_failures_failed_at ON idem_consumer_failures (failed_at);
