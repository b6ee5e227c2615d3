-- idem: the transactional outbox and the record of idempotent consumers (MySQL 8, MariaDB 10.11).
--
-- idem_outbox holds the events handlers enqueue in their own transactions. The relay publishes
-- each topic in id order: an event whose transaction committed before another's began has the
-- smaller id, so it is published first.
--
-- Identifiers that must compare exactly (event ids, topics, consumer names, message ids) are
-- VARBINARY: a text collation would take 'A' for 'a' and ignore trailing spaces. Their lengths
-- are limits: event ids 64 bytes (UUIDs), topics 255 (MAX_TOPIC_LEN), consumer names 255,
-- message ids 1024 (a consumer's claim, an INSERT IGNORE, would cut a longer one). Times are
-- DATETIME(6) in UTC, written with UTC_TIMESTAMP(6) whatever the session's time zone.
--
-- MySQL commits each CREATE TABLE by itself, so a migration that fails halfway stays half
-- applied: every statement creates only what is missing (indexes with their tables), and running
-- the file again completes it. A database whose event tables an earlier release created is
-- adopted as it is.
CREATE TABLE IF NOT EXISTS idem_outbox (
    id           BIGINT         NOT NULL AUTO_INCREMENT PRIMARY KEY,
    event_id     VARBINARY(64)  NOT NULL,
    topic        VARBINARY(255) NOT NULL,
    payload      LONGTEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    created_at   DATETIME(6)    NOT NULL,
    published_at DATETIME(6),
    -- A topic's waiting events in order (topic, published_at IS NULL, id).
    INDEX idem_outbox_pending (topic, published_at, id),
    -- Whether any event waits, which topics have waiting events (NULLs first), and the
    -- published events past their retention.
    INDEX idem_outbox_published (published_at, topic)
) ENGINE=InnoDB;

-- One row per topic the relay has seen: a relay locks it (FOR UPDATE SKIP LOCKED) while it
-- publishes that topic's events, so that relays share topics and each topic keeps its order.
-- relay and leased_until are used on SQLite only, which has no row locks.
CREATE TABLE IF NOT EXISTS idem_outbox_topics (
    topic        VARBINARY(255) NOT NULL PRIMARY KEY,
    relay        VARBINARY(255),
    leased_until BIGINT
) ENGINE=InnoDB;

-- The messages each consumer has processed: written in the consumer's transaction, so that a
-- redelivered message finds its id here exactly when its effects were committed.
CREATE TABLE IF NOT EXISTS idem_consumed (
    consumer     VARBINARY(255)  NOT NULL,
    message_id   VARBINARY(1024) NOT NULL,
    processed_at DATETIME(6)     NOT NULL,
    PRIMARY KEY (consumer, message_id),
    INDEX idem_consumed_processed_at (consumer, processed_at)
) ENGINE=InnoDB;

-- Failed attempts, counted outside the consumer's rolled-back transaction.
CREATE TABLE IF NOT EXISTS idem_consumer_failures (
    consumer   VARBINARY(255)  NOT NULL,
    message_id VARBINARY(1024) NOT NULL,
    attempts   INT             NOT NULL,
    last_error LONGTEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    failed_at  DATETIME(6)     NOT NULL,
    PRIMARY KEY (consumer, message_id),
    INDEX idem_consumer_failures_failed_at (consumer, failed_at)
) ENGINE=InnoDB;
