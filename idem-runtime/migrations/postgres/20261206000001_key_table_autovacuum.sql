-- idem: autovacuum settings of the key table (PostgreSQL).
--
-- The key table churns: every first request inserts a row, and the purge deletes it one
-- retention later, around the clock. A deleted row's space is reused only once a vacuum has
-- passed, and PostgreSQL's default waits for dead rows to reach 20% of the table
-- (autovacuum_vacuum_scale_factor = 0.2) before it vacuums: on a table of millions of keys, the
-- heap and its indexes grow by a fifth of the live rows before the first vacuum, and again
-- whenever a vacuum falls behind. At 1% (plus 1000 rows) a vacuum follows the purge within a
-- minute or two at any rate, each one short (the pages of the keys that have not expired are
-- all-visible and skipped), and the table holds its size: `idem-bench churn` measures both.
-- The analysis follows at 2%, so that the planner's view of expires_at (the purge's index)
-- stays current. These are storage parameters of this table only; autovacuum itself must be
-- on (the server's `autovacuum`, on by default).
ALTER TABLE idem_keys SET (
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_analyze_scale_factor = 0.02
);
