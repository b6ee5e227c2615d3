-- idem: claims the recovery gave up on (SQLite).
--
-- The recovery counts the rounds in which its hook did not settle a claim (recovery_attempts)
-- and keeps the hook's last reason (recovery_error). After RecoveryOptions::max_attempts rounds
-- it parks the claim: parked_at set (Unix milliseconds), its lease and owner cleared, so that no
-- retry takes it over and no pass hands it to the hook again until an operator resumes it
-- (`idem resume`) or releases it (`idem abandon`). A parked row outlives its expiry: the purge
-- passes over it, and a retry of its key is answered that a person must look.
ALTER TABLE idem_keys ADD COLUMN recovery_attempts INTEGER NOT NULL DEFAULT 0;
ALTER TABLE idem_keys ADD COLUMN recovery_error TEXT;
ALTER TABLE idem_keys ADD COLUMN parked_at INTEGER;
