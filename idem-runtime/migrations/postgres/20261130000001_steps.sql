-- idem: recovery points of multi-step external-mode handlers (PostgreSQL).
--
-- steps holds the steps a claim recorded, in order: [{"step": name, "output": ...}]. A retry
-- that takes a lapsed claim over keeps them and resumes after the last one (idem_start below is
-- the previous version but for that); a row that expires loses them with the row.

ALTER TABLE idem_keys ADD COLUMN IF NOT EXISTS steps jsonb;

-- Claims (scope, key) for an external-mode handler; see 20261129000002_external_mode.sql.
CREATE OR REPLACE FUNCTION idem_start(
    p_scope text, p_key text, p_lock bigint, p_method text, p_path text, p_fingerprint bytea,
    p_lease double precision, p_retention double precision, p_token bigint
)
RETURNS TABLE (
    outcome text, taken_over boolean, status text, method text, path text, fingerprint bytea,
    response_status smallint, response_headers jsonb, response_body bytea, lease_left double precision
)
LANGUAGE plpgsql VOLATILE
AS $$
#variable_conflict use_column
DECLARE
    r idem_keys%ROWTYPE;
    replaced boolean;
BEGIN
    -- Completed keys answer without a lock, as in idem_claim.
    SELECT * INTO r FROM idem_keys k
    WHERE k.scope = p_scope AND k.key = p_key AND k.status = 'completed' AND k.expires_at > now();
    IF FOUND THEN
        RETURN QUERY SELECT 'found', false, r.status, r.method, r.path, r.fingerprint,
                            r.response_status, r.response_headers, r.response_body, NULL::float8;
        RETURN;
    END IF;

    IF NOT pg_try_advisory_xact_lock(p_lock) THEN
        RETURN QUERY SELECT 'busy', false, NULL::text, NULL::text, NULL::text, NULL::bytea,
                            NULL::smallint, NULL::jsonb, NULL::bytea, NULL::float8;
        RETURN;
    END IF;

    -- Fresh snapshot: see what the previous holder committed.
    SELECT * INTO r FROM idem_keys k WHERE k.scope = p_scope AND k.key = p_key;
    replaced := FOUND;
    IF FOUND AND r.expires_at > now()
       AND (r.status = 'completed' OR r.lease_until > now() OR r.fingerprint <> p_fingerprint) THEN
        RETURN QUERY SELECT 'found', false, r.status, r.method, r.path, r.fingerprint,
                            r.response_status, r.response_headers, r.response_body,
                            greatest(extract(epoch FROM r.lease_until - now()), 0)::float8;
        RETURN;
    END IF;

    -- Absent, expired, or abandoned by a claimant whose lease ran out: take it. The WHERE
    -- re-checks the row under its row lock, so a concurrent recovery that just renewed the
    -- lease wins and this claim reports 'found'.
    INSERT INTO idem_keys AS k (scope, key, method, path, fingerprint, status, created_at,
                                expires_at, locked_at, lease_until, claim_token)
    VALUES (p_scope, p_key, p_method, p_path, p_fingerprint, 'started', now(),
            now() + make_interval(secs => p_retention), now(),
            now() + make_interval(secs => p_lease), p_token)
    ON CONFLICT (scope, key) DO UPDATE SET
        method = EXCLUDED.method, path = EXCLUDED.path, fingerprint = EXCLUDED.fingerprint,
        status = 'started', created_at = EXCLUDED.created_at, expires_at = EXCLUDED.expires_at,
        locked_at = EXCLUDED.locked_at, lease_until = EXCLUDED.lease_until,
        claim_token = EXCLUDED.claim_token, response_status = NULL, response_headers = NULL,
        response_body = NULL,
        -- A lapsed claim of the same request keeps its recovery points; an expired row does
        -- not.
        steps = CASE WHEN k.expires_at <= now() THEN NULL ELSE k.steps END
    WHERE k.expires_at <= now() OR (k.status = 'started' AND k.lease_until <= now());
    IF FOUND THEN
        RETURN QUERY SELECT 'acquired', replaced, NULL::text, NULL::text, NULL::text, NULL::bytea,
                            NULL::smallint, NULL::jsonb, NULL::bytea, NULL::float8;
    ELSE
        SELECT * INTO r FROM idem_keys k WHERE k.scope = p_scope AND k.key = p_key;
        RETURN QUERY SELECT 'found', false, r.status, r.method, r.path, r.fingerprint,
                            r.response_status, r.response_headers, r.response_body,
                            greatest(extract(epoch FROM r.lease_until - now()), 0)::float8;
    END IF;
END
$$;
