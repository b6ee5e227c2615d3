-- idem: claims the recovery gave up on (PostgreSQL).
--
-- The recovery counts the rounds in which its hook did not settle a claim (recovery_attempts)
-- and keeps the hook's last reason (recovery_error). After RecoveryOptions::max_attempts rounds
-- it parks the claim: parked_at set, its lease and owner cleared, so that no retry takes it over
-- and no pass hands it to the hook again until an operator resumes it (`idem resume`: the count
-- reset, the lease ended) or releases it (`idem abandon`). A parked row outlives its expiry:
-- the purge passes over it, and a retry of its key is answered that a person must look.
-- The recovery's scan and its count of parked claims read idem_keys_started_lease_idx.

ALTER TABLE idem_keys ADD COLUMN IF NOT EXISTS recovery_attempts bigint NOT NULL DEFAULT 0;
ALTER TABLE idem_keys ADD COLUMN IF NOT EXISTS recovery_error text;
ALTER TABLE idem_keys ADD COLUMN IF NOT EXISTS parked_at timestamptz;

-- Claims (scope, key) for an external-mode handler; see 20261129000002_external_mode.sql. As
-- 20261130000001_steps.sql's, but that a parked claim is found (status 'parked') and never taken
-- over, and that an expired row taken over starts its recovery count afresh.
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
    -- Parked by the recovery: an operator's, whatever its expiry.
    IF FOUND AND r.status = 'started' AND r.parked_at IS NOT NULL THEN
        RETURN QUERY SELECT 'found', false, 'parked'::text, r.method, r.path, r.fingerprint,
                            NULL::smallint, NULL::jsonb, NULL::bytea, NULL::float8;
        RETURN;
    END IF;
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
        -- A lapsed claim of the same request keeps its recovery points and the recovery's
        -- count of rounds; an expired row does not.
        steps = CASE WHEN k.expires_at <= now() THEN NULL ELSE k.steps END,
        recovery_attempts = CASE WHEN k.expires_at <= now() THEN 0 ELSE k.recovery_attempts END,
        recovery_error = CASE WHEN k.expires_at <= now() THEN NULL ELSE k.recovery_error END
    WHERE (k.expires_at <= now() OR (k.status = 'started' AND k.lease_until <= now()))
      AND k.parked_at IS NULL;
    IF FOUND THEN
        RETURN QUERY SELECT 'acquired', replaced, NULL::text, NULL::text, NULL::text, NULL::bytea,
                            NULL::smallint, NULL::jsonb, NULL::bytea, NULL::float8;
    ELSE
        SELECT * INTO r FROM idem_keys k WHERE k.scope = p_scope AND k.key = p_key;
        RETURN QUERY SELECT 'found', false,
                            CASE WHEN r.status = 'started' AND r.parked_at IS NOT NULL
                                 THEN 'parked' ELSE r.status END,
                            r.method, r.path, r.fingerprint,
                            r.response_status, r.response_headers, r.response_body,
                            greatest(extract(epoch FROM r.lease_until - now()), 0)::float8;
    END IF;
END
$$;
