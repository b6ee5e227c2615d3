//! How the purge paces its statements: a fixed pause, or one it chooses from what it measures.

use std::time::Duration;

/// How a purge spaces its statements ([`PurgeOptions::with_pacing`](super::PurgeOptions::with_pacing)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Pacing {
    /// The purge chooses its pause after each statement from what it measures: none while the
    /// database has nothing else to do, so that a backlog clears at the database's speed; and,
    /// while other sessions are at work, a pause that leaves the database to them
    /// ([`Pacing::BUSY_SHARE`]).
    ///
    /// "Other sessions at work" is what the database reports (PostgreSQL's `pg_stat_activity`,
    /// MySQL's process list: sessions on the same database running a statement, the purge's
    /// own and the server's workers left out; what the database user may see), sampled after
    /// each statement. SQLite has no such list: there, a statement that took more than 1.5
    /// times what a row costs alone counts as the database being busy.
    Adaptive,
    /// The same pause after every statement, whatever the load.
    Fixed(Duration),
}

impl Pacing {
    /// The share of the time an adaptive purge keeps for itself while the database is busy:
    /// it pauses for nineteen times as long as its last statement took.
    pub const BUSY_SHARE: f64 = 0.05;
}

/// The longest pause an adaptive purge takes between two statements.
const MAX_PAUSE: Duration = Duration::from_secs(2);

/// A statement counts as slowed by other work when a row costs this many times the
/// cheapest row seen.
const SLOWED: f64 = 1.5;

/// How fast the cheapest cost seen drifts up, per statement, so that it follows rows that got
/// dearer for good (wider rows, a colder cache) instead of calling the database busy for ever.
const DRIFT: f64 = 1.02;

/// The adaptive pacing's state over one purge pass.
#[derive(Debug, Default)]
pub(crate) struct Pacer {
    /// The cheapest cost of a row seen, in seconds, drifting up.
    cheapest: Option<f64>,
    /// The pause chosen last.
    pause: Duration,
}

/// What the pacer learns from one statement.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Batch {
    /// How long the statement took.
    pub(crate) took: Duration,
    /// Rows it deleted.
    pub(crate) rows: u64,
    /// Whether it was a full batch (a short one ends the pass, and costs more per row).
    pub(crate) full: bool,
    /// Other sessions running a statement, where the database reports them.
    pub(crate) others_active: Option<u64>,
}

impl Pacer {
    /// The pause before the next statement, after `batch`.
    pub(crate) fn next(&mut self, batch: Batch) -> Duration {
        let mut slowed = false;
        if batch.full && batch.rows > 0 {
            let cost = batch.took.as_secs_f64() / batch.rows as f64;
            let cheapest = self.cheapest.map_or(cost, |c| (c * DRIFT).min(cost));
            slowed = cost > cheapest * SLOWED;
            self.cheapest = Some(cheapest);
        }
        // Where the database says what else runs, that decides: a statement's time varies with
        // more than the load (the cache, a checkpoint), and a false alarm slows a purge alone.
        let busy = match batch.others_active {
            Some(others) => others > 0,
            None => slowed,
        };
        self.pause = if busy {
            let share = (1.0 - Pacing::BUSY_SHARE) / Pacing::BUSY_SHARE;
            batch.took.mul_f64(share).min(MAX_PAUSE)
        } else {
            // Back to full speed in a few calm statements, not at once: a lull between two
            // bursts of requests is not an idle database.
            let halved = self.pause / 2;
            if halved < Duration::from_millis(1) {
                Duration::ZERO
            } else {
                halved
            }
        };
        self.pause
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(took_ms: u64, others_active: Option<u64>) -> Batch {
        Batch {
            took: Duration::from_millis(took_ms),
            rows: 1000,
            full: true,
            others_active,
        }
    }

    #[test]
    fn an_idle_database_gets_no_pause() {
        let mut pacer = Pacer::default();
        for _ in 0..10 {
            assert_eq!(pacer.next(batch(10, Some(0))), Duration::ZERO);
        }
    }

    #[test]
    fn other_sessions_at_work_get_nineteen_times_the_statement() {
        let mut pacer = Pacer::default();
        pacer.next(batch(10, Some(0)));
        assert_eq!(pacer.next(batch(10, Some(3))), Duration::from_millis(190));
        // Each pause follows its own statement: one slow statement does not slow the rest.
        assert_eq!(pacer.next(batch(500, Some(1))), MAX_PAUSE);
        assert_eq!(pacer.next(batch(5, Some(1))), Duration::from_millis(95));
    }

    #[test]
    fn statements_slower_than_alone_count_as_busy_where_no_activity_is_reported() {
        let mut pacer = Pacer::default();
        assert_eq!(pacer.next(batch(10, None)), Duration::ZERO);
        assert_eq!(pacer.next(batch(14, None)), Duration::ZERO, "within 1.5x");
        assert_eq!(pacer.next(batch(30, None)), Duration::from_millis(570));
    }

    #[test]
    fn the_pause_halves_back_to_nothing_once_calm() {
        let mut pacer = Pacer::default();
        pacer.next(batch(10, Some(0)));
        assert_eq!(pacer.next(batch(10, Some(1))), Duration::from_millis(190));
        assert_eq!(pacer.next(batch(10, Some(0))), Duration::from_millis(95));
        let mut pause = Duration::MAX;
        for _ in 0..10 {
            pause = pacer.next(batch(10, Some(0)));
        }
        assert_eq!(pause, Duration::ZERO);
    }

    #[test]
    fn a_short_last_batch_does_not_move_the_cheapest_cost() {
        let mut pacer = Pacer::default();
        pacer.next(batch(10, None));
        let short = Batch {
            took: Duration::from_millis(9),
            rows: 10,
            full: false,
            others_active: None,
        };
        assert_eq!(pacer.next(short), Duration::ZERO);
        assert_eq!(pacer.next(batch(12, None)), Duration::ZERO);
    }
}
