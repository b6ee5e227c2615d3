//! Sealing every stored answer again with the sealing key ([`Store::rekey`]): the step of a
//! rotation that lets the old key be retired.

use crate::{
    backend::{Backend, Locked, LockedRow, Rewrite, SettledRow},
    error::{Error, Unopened},
    record::KeyRef,
    report::Rekeyed,
    seal::{self, EncryptionKeys},
    store::Store,
};

/// Rows one batch of [`Store::rekey`] reads, and at most locks and writes in one transaction.
const REKEY_BATCH: u32 = 200;

/// How many of the keys that did not open a [`Rekeyed`] names.
const UNOPENED_NAMED: usize = 10;

/// How long the rekey leaves the rows another transaction held before it tries them again: a
/// retry's takeover, or the purge's batch, is over by then.
const BUSY_PAUSE: std::time::Duration = std::time::Duration::from_secs(1);

impl<DB: Backend> Store<DB> {
    /// Seals again, with the first of this store's keys
    /// ([`StoreOptions::with_encryption_keys`](crate::StoreOptions::with_encryption_keys)),
    /// every stored answer and every recorded step sealed with another key or stored in the
    /// clear, while the service runs: the step of a rotation after which the other keys can be
    /// retired. With `dry_run`, it reads and opens them and writes nothing.
    ///
    /// Completed keys and parked claims are read a page at a time in the primary key's order;
    /// each row that needs it is locked, opened, sealed again and written back in a short
    /// transaction of its own. A row another transaction holds is skipped rather than waited
    /// for (on SQLite, whose writers exclude each other whole, the row's transaction waits for
    /// the database's writer instead), and tried once more a second after the last page.
    /// Claims in flight are left to their owner (their answer is sealed with the sealing key
    /// when they complete) and counted. A row that does not open (its key not given, or
    /// altered), or does not read as idem writes it, is left as it is, counted, and named in
    /// the log (by its key's log id) and in the report.
    ///
    /// # Errors
    ///
    /// [`Error::Setup`] when the store has no keys; [`Error::Database`] when a statement fails
    /// (the rows written before stay written: run it again to finish).
    pub async fn rekey(&self, dry_run: bool) -> Result<Rekeyed, Error> {
        let keys = self
            .options()
            .encryption_keys()
            .ok_or_else(|| Error::Setup {
                reason: "rekey seals with the store's first encryption key, and the store has none"
                    .to_owned(),
            })?;
        let mut report = Rekeyed {
            sealing_id: keys.sealing_id().to_owned(),
            dry_run,
            read: 0,
            resealed: 0,
            from_clear: 0,
            current: 0,
            unopened: Default::default(),
            corrupt: 0,
            unopened_keys: Vec::new(),
            busy: 0,
            gone: 0,
            in_flight_left: 0,
        };
        let mut after: Option<KeyRef> = None;
        let mut busy = Vec::new();
        loop {
            let rows = DB::settled_after(self.pool(), after.as_ref(), REKEY_BATCH).await?;
            let Some(last) = rows.last() else { break };
            after = Some(last.key.clone());
            let read = rows.len() as u64;
            let stale: Vec<KeyRef> = rows
                .into_iter()
                .filter(|row| !is_current(row, keys.sealing_id()))
                .map(|row| row.key)
                .collect();
            report.read += read;
            report.current += read - stale.len() as u64;
            report.current += self
                .reseal(keys, stale, dry_run, &mut report, &mut busy)
                .await?;
        }
        // Once more, the rows another transaction held: it was at work on them for an instant.
        let held = std::mem::take(&mut busy);
        if !held.is_empty() {
            tokio::time::sleep(BUSY_PAUSE).await;
        }
        for chunk in held.chunks(REKEY_BATCH as usize) {
            let current = self
                .reseal(keys, chunk.to_vec(), dry_run, &mut report, &mut busy)
                .await?;
            report.current += current;
        }
        report.busy = busy.len() as u64;
        report.in_flight_left = DB::in_flight_count(self.pool()).await?;
        if !report.is_complete() {
            tracing::warn!(
                sealing_id = %report.sealing_id, unopened = ?report.unopened,
                corrupt = report.corrupt, busy = report.busy,
                "rekey: stored answers left as they are, not sealed with the sealing key"
            );
        }
        Ok(report)
    }

    /// Locks `stale` rows, seals again what they hold, and counts it in `report`; the keys it
    /// could not lock are added to `busy`. Returns how many turned out current after all.
    async fn reseal(
        &self,
        keys: &EncryptionKeys,
        stale: Vec<KeyRef>,
        dry_run: bool,
        report: &mut Rekeyed,
        busy: &mut Vec<KeyRef>,
    ) -> Result<u64, Error> {
        if stale.is_empty() {
            return Ok(0);
        }
        let done = DB::rewrite(self.pool(), &stale, !dry_run, |key, row| {
            resealed(keys, key, row)
        })
        .await?;
        let mut current = 0;
        for (key, found) in stale.into_iter().zip(done) {
            let left = match found {
                Locked::Busy => {
                    busy.push(key);
                    continue;
                }
                Locked::Gone => {
                    report.gone += 1;
                    continue;
                }
                Locked::Read(Resealed::Written { from_clear }) => {
                    report.resealed += 1;
                    report.from_clear += u64::from(from_clear);
                    continue;
                }
                Locked::Read(Resealed::Current) => {
                    current += 1;
                    continue;
                }
                Locked::Read(Resealed::Unopened(unopened)) => {
                    tracing::debug!(
                        scope = %key.scope, key_id = %key.log_id(),
                        sealed_with = unopened.key_id(), %unopened,
                        "rekey: a stored answer does not open"
                    );
                    *report
                        .unopened
                        .entry(unopened.key_id().to_owned())
                        .or_default() += 1;
                    key
                }
                Locked::Corrupt(reason) => {
                    tracing::debug!(
                        scope = %key.scope, key_id = %key.log_id(), %reason,
                        "rekey: a row does not read as idem writes it"
                    );
                    report.corrupt += 1;
                    key
                }
            };
            if report.unopened_keys.len() < UNOPENED_NAMED {
                report.unopened_keys.push((left.scope, left.key));
            }
        }
        Ok(current)
    }
}

/// What the rekey made of one locked row.
#[derive(Debug)]
enum Resealed {
    /// Sealed again (or, on a dry run, would be); `from_clear` when something of it was in the
    /// clear.
    Written {
        /// Whether the answer, or a step's output, was stored in the clear.
        from_clear: bool,
    },
    /// Already sealed with the sealing key: it changed since it was read.
    Current,
    /// It does not open.
    Unopened(Unopened),
}

/// Whether `row` holds nothing that is not sealed with the key `sealing` (a row that does not
/// parse is not: its rewrite says why).
fn is_current(row: &SettledRow, sealing: &str) -> bool {
    let answer = row.headers.as_deref().is_none_or(|text| {
        serde_json::from_str::<Vec<(String, String)>>(text).is_ok_and(|headers| {
            matches!(headers.as_slice(), [(name, id)] if name == seal::SEALED_WITH && id == sealing)
        })
    });
    let steps = row.steps.as_deref().is_none_or(|text| {
        serde_json::from_str::<Vec<crate::record::RecordedStep>>(text)
            .is_ok_and(|steps| seal::steps_sealed_with(&steps, sealing))
    });
    answer && steps
}

/// What to write back to `row`, of `key`: its answer and its steps, each sealed again with the
/// sealing key where it is not already; nothing when one does not open.
fn resealed(keys: &EncryptionKeys, key: &KeyRef, row: LockedRow) -> (Rewrite, Resealed) {
    let sealing = keys.sealing_id();
    let mut rewrite = Rewrite::default();
    let mut from_clear = false;
    if let Some(answer) = row.answer
        && seal::sealed_with(&answer) != Some(sealing)
    {
        from_clear |= seal::sealed_with(&answer).is_none();
        match seal::open_response(Some(keys), answer, key) {
            Ok(clear) => rewrite.answer = Some(keys.seal_response(&clear, key)),
            Err(unopened) => return (Rewrite::default(), Resealed::Unopened(unopened)),
        }
    }
    if let Some(steps) = row.steps
        && !seal::steps_sealed_with(&steps, sealing)
    {
        from_clear |= !seal::steps_all_sealed(&steps);
        match seal::open_steps(Some(keys), steps, key) {
            Ok(clear) => rewrite.steps = Some(keys.seal_steps(&clear, key)),
            Err(unopened) => return (Rewrite::default(), Resealed::Unopened(unopened)),
        }
    }
    let outcome = if rewrite.answer.is_some() || rewrite.steps.is_some() {
        Resealed::Written { from_clear }
    } else {
        Resealed::Current
    };
    (rewrite, outcome)
}
