-- idem: the idempotency key table (SQLite). Times are Unix milliseconds.
--
-- One row per (scope, key). In the transactional mode a row is written only when the handler's
-- transaction commits, already 'completed'; while the handler runs, the key is held by the
-- process (a duplicate gets 409 at once) and by SQLite's write lock (BEGIN IMMEDIATE). External
-- mode commits a 'started' row with a lease first.

CREATE TABLE IF NOT EXISTS idem_keys (
    scope            TEXT    NOT NULL,   -- the caller ('' for keys declared global)
    key              TEXT    NOT NULL,   -- the client's Idempotency-Key
    method           TEXT    NOT NULL,
    path             TEXT    NOT NULL,   -- path and query of the first request
    fingerprint      BLOB    NOT NULL,   -- SHA-256 of method, path, query, canonical body
    status           TEXT    NOT NULL CHECK (status IN ('started', 'completed')),
    response_status  INTEGER,
    response_headers TEXT,               -- JSON: [[name, value], ...]
    response_body    BLOB,
    created_at       INTEGER NOT NULL,
    expires_at       INTEGER NOT NULL,
    locked_at        INTEGER,            -- external mode: when the claim was taken
    lease_until      INTEGER,            -- external mode: end of the claim's lease
    claim_token      INTEGER,            -- external mode: the claim's owner
    PRIMARY KEY (scope, key)
);

-- The purge task deletes rows past expires_at in batches, oldest first.
CREATE INDEX IF NOT EXISTS idem_keys_expires_at_idx ON idem_keys (expires_at);

-- The recovery task's scan: started claims by lease end.
CREATE INDEX IF NOT EXISTS idem_keys_started_lease_idx
    ON idem_keys (lease_until) WHERE status = 'started';
