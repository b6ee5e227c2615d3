-- idem: the idempotency key table (MySQL, MariaDB).
--
-- One row per (scope, key), as on PostgreSQL, with the same columns and meaning. While a
-- transactional handler runs, its transaction holds an uncommitted 'started' row of the key,
-- already expired: a duplicate's INSERT finds the row locked and is refused at once (409), the
-- completion turns the row 'completed' in the handler's commit, and a rollback, a crash or a
-- dropped connection leaves nothing. 'started' rows with a lease belong to the external mode.
--
-- scope and key are VARBINARY: they compare byte for byte (the server's default collation
-- ignores case and trailing spaces). Times are DATETIME(6) in UTC, written with
-- UTC_TIMESTAMP(6) whatever the session's time zone. InnoDB: row locks, and the only engine a
-- Galera cluster replicates.

CREATE TABLE IF NOT EXISTS idem_keys (
    scope            VARBINARY(1024) NOT NULL,   -- the caller ('' for keys declared global)
    `key`            VARBINARY(255)  NOT NULL,   -- the client's Idempotency-Key
    method           VARCHAR(255)    NOT NULL,   -- of the first request, for the 422 detail
    path             TEXT            NOT NULL,   -- path and query of the first request
    fingerprint      VARBINARY(64)   NOT NULL,   -- SHA-256 of method, path, query, canonical body
    status           VARCHAR(16)     NOT NULL CHECK (status IN ('started', 'completed')),
    response_status  SMALLINT,                   -- the stored response, once completed
    response_headers JSON,                       -- [[name, value], ...]: Content-Type, Location
    response_body    LONGBLOB,
    created_at       DATETIME(6)     NOT NULL,
    expires_at       DATETIME(6)     NOT NULL,   -- created_at + the handler's retention
    locked_at        DATETIME(6),                -- when a 'started' claim was taken
    lease_until      DATETIME(6),                -- external mode: the claim's lease
    claim_token      BIGINT,                     -- the owner of a 'started' claim
    steps            JSON,                       -- recorded steps: [{"step": name, "output": ...}]
    PRIMARY KEY (scope, `key`),
    -- The purge task deletes rows past expires_at in batches, oldest first.
    KEY idem_keys_expires_at_idx (expires_at),
    -- The recovery task's scan: started claims by lease end.
    KEY idem_keys_started_lease_idx (status, lease_until)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4;
