-- idem: recovery points of multi-step external-mode handlers (SQLite).
--
-- steps holds the steps a claim recorded, in order, as JSON: [{"step": name, "output": ...}].
-- A retry that takes a lapsed claim over keeps them and resumes after the last one; a row that
-- expires loses them with the row.
ALTER TABLE idem_keys ADD COLUMN steps TEXT;
