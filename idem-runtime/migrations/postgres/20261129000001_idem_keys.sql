-- idem: the idempotency key table and its claim function (PostgreSQL).
--
-- One row per (scope, key). In the single-transaction mode a row is written only when the
-- handler's transaction commits, already 'completed'; while the handler runs, the key is held
-- by a transaction-scoped advisory lock instead of a row, so a crash, a rollback or a dropped
-- connection can never leave a key stuck. 'started' rows belong to the external mode.

CREATE TABLE IF NOT EXISTS idem_keys (
    scope            text        NOT NULL,   -- the caller ('' for keys declared global)
    key              text        NOT NULL,   -- the client's Idempotency-Key
    method           text        NOT NULL,   -- of the first request, for the 422 detail
    path             text        NOT NULL,   -- path and query of the first request
    fingerprint      bytea       NOT NULL,   -- SHA-256 of method, path, query, canonical body
    status           text        NOT NULL CHECK (status IN ('started', 'completed')),
    response_status  smallint,               -- the stored response, once completed
    response_headers jsonb,                  -- [[name, value], ...]: Content-Type, Location
    response_body    bytea,
    created_at       timestamptz NOT NULL DEFAULT now(),
    expires_at       timestamptz NOT NULL,   -- created_at + the handler's retention
    locked_at        timestamptz,            -- when a 'started' claim was taken
    PRIMARY KEY (scope, key)
);

-- The purge task deletes rows past expires_at in batches, oldest first.
CREATE INDEX IF NOT EXISTS idem_keys_expires_at_idx ON idem_keys (expires_at);

-- Claims (scope, key) inside the caller's transaction, in one round trip, without waiting.
--
-- Returns exactly one row:
--   acquired = false, status = 'completed'  a live, finished key: replay or 422, no lock taken
--   acquired = false, status IS NULL         another transaction holds the key: 409
--   acquired = true,  status IS NULL         the caller owns the key until it commits or rolls back
--   acquired = true,  status IS NOT NULL     the key was finished (or started) by someone else
--
-- VOLATILE matters: in READ COMMITTED each query below takes a fresh snapshot, so the read after
-- pg_try_advisory_xact_lock sees a completion that the previous holder committed just before the
-- lock was granted. The transaction must be READ COMMITTED; idem begins it so.
CREATE OR REPLACE FUNCTION idem_claim(p_scope text, p_key text, p_lock bigint)
RETURNS TABLE (
    acquired boolean, status text, method text, path text, fingerprint bytea,
    response_status smallint, response_headers jsonb, response_body bytea
)
LANGUAGE plpgsql VOLATILE
AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
        SELECT false, k.status, k.method, k.path, k.fingerprint,
               k.response_status, k.response_headers, k.response_body
        FROM idem_keys k
        WHERE k.scope = p_scope AND k.key = p_key
          AND k.status = 'completed' AND k.expires_at > now();
    IF FOUND THEN
        RETURN;
    END IF;

    IF NOT pg_try_advisory_xact_lock(p_lock) THEN
        RETURN QUERY SELECT false, NULL::text, NULL::text, NULL::text, NULL::bytea,
                            NULL::smallint, NULL::jsonb, NULL::bytea;
        RETURN;
    END IF;

    -- Mark the claim in the transaction: the completion checks the mark, so a handler that
    -- ends the transaction itself (COMMIT, ROLLBACK) cannot have its outcome stored.
    PERFORM set_config('idem.claim', p_lock::text, true);

    RETURN QUERY
        SELECT true, k.status, k.method, k.path, k.fingerprint,
               k.response_status, k.response_headers, k.response_body
        FROM idem_keys k
        WHERE k.scope = p_scope AND k.key = p_key AND k.expires_at > now();
    IF NOT FOUND THEN
        RETURN QUERY SELECT true, NULL::text, NULL::text, NULL::text, NULL::bytea,
                            NULL::smallint, NULL::jsonb, NULL::bytea;
    END IF;
END
$$;
