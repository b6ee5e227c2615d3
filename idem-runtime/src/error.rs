//! The error of idem's own operations: migrations, the background tasks, and the store behind
//! every request.

/// What went wrong in the idempotency store.
///
/// Requests never see it: the layer answers them with a problem (503 `StoreUnavailable` and the
/// like) and logs it. It is what [`migrate`](crate::backend::migrate) and the
/// [`tasks`](crate::tasks) return.
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The database failed or could not be reached.
    #[error("the idempotency store's database failed: {0}")]
    Database(#[from] sqlx::Error),
    /// Creating or upgrading idem's tables failed; nothing of the failed migration is applied.
    #[error("migrating idem's tables failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// The database did not answer within the store's
    /// [`database_timeout`](crate::store::StoreOptions::database_timeout): the operation was abandoned and
    /// its connection closed.
    #[error("the idempotency store's database did not answer within {}", crate::attribute::attribute_duration(*.after))]
    TimedOut {
        /// The timeout that passed.
        after: std::time::Duration,
    },
    /// The database takes no writes: a standby, or a primary that a failover demoted, reached
    /// through a connection opened before the failover or a router that has not caught up. A
    /// fault that passes: the request is answered 503 with `Retry-After` before its handler
    /// runs.
    #[error(
        "the idempotency store's database is read-only (a standby, or a primary demoted by a failover)"
    )]
    ReadOnly,
    /// PostgreSQL is reached through a pooler that cannot carry what idem needs: one in
    /// transaction mode that does not keep sqlx's prepared statements apart, or, for the
    /// migrations, one that shares server connections at all. `reason` says which, and what to
    /// use instead.
    #[error("{reason}")]
    Pooler {
        /// The cause and the remedies.
        reason: String,
    },
    /// A step of setting up was missed or got wrong: the key table does not exist, a URL
    /// names no database this build supports. No retry fixes it; `reason` says what does.
    #[error("{reason}")]
    Setup {
        /// What is missing, and what to do.
        reason: String,
    },
    /// A row of the key table breaks idem's invariants (written by something other than idem,
    /// or by an incompatible version of it).
    #[error("a row of idem_keys is not one idem wrote: {reason}")]
    CorruptRow {
        /// What is wrong with it.
        reason: String,
    },
    /// A stored answer or step output is sealed and does not open with the store's keys.
    #[error("a sealed value of idem_keys cannot be opened: {0}")]
    Unopened(#[from] Unopened),
}

/// The variant and what it holds, but for the errors whose text is written for a person (a
/// pooler in the way, a step of setting up missed, a row idem did not write): those show their
/// text as it is, unescaped, so that one returned from `main` (which prints `Error: ` and the
/// error's `Debug`) reads as the message and its remedies.
impl std::fmt::Debug for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Database(error) => f.debug_tuple("Database").field(error).finish(),
            Self::Migrate(error) => f.debug_tuple("Migrate").field(error).finish(),
            Self::TimedOut { after } => f.debug_struct("TimedOut").field("after", after).finish(),
            Self::ReadOnly => f.write_str("ReadOnly"),
            Self::Pooler { .. }
            | Self::Setup { .. }
            | Self::CorruptRow { .. }
            | Self::Unopened(_) => std::fmt::Display::fmt(self, f),
        }
    }
}

/// Whether a SQLSTATE says that a transaction lost a conflict with another and was rolled back
/// for it: class 40 (a serialization failure, a deadlock; MySQL and MariaDB answer both with
/// `40001`, and so does a Galera cluster to the transaction that loses certification).
pub(crate) fn is_conflict_code(code: Option<&str>) -> bool {
    code.is_some_and(|code| code.starts_with("40"))
}

impl Error {
    /// Whether the database refused the statement because its transaction lost a conflict with
    /// another transaction (SQLSTATE class 40: a serialization failure, a deadlock), and rolled
    /// the transaction back for it.
    pub(crate) fn is_conflict(&self) -> bool {
        match self {
            Self::Database(sqlx::Error::Database(error)) => {
                is_conflict_code(error.code().as_deref())
            }
            _ => false,
        }
    }

    /// Whether the database says that idem's key table does not exist: [`migrate`](crate::backend::migrate)
    /// was not run on it.
    pub fn is_missing_key_table(&self) -> bool {
        let Self::Database(sqlx::Error::Database(error)) = self else {
            return false;
        };
        // PostgreSQL: undefined_table, or undefined_function for the claim functions the
        // migrations create (`idem_start`); MySQL: ER_NO_SUCH_TABLE (SQLSTATE 42S02); SQLite:
        // "no such table: idem_keys" (SQLITE_ERROR).
        let message = error.message();
        match error.code().as_deref() {
            Some("42P01" | "42S02") => message.contains("idem_keys"),
            Some("42883") => message.contains("idem_"),
            _ => message.contains("no such table: idem_keys"),
        }
    }

    /// What to do about this error, when it says a step of setting up was missed: the key
    /// table's absence names [`migrate`](crate::backend::migrate).
    pub(crate) fn setup_hint(&self) -> Option<&'static str> {
        self.is_missing_key_table().then_some(
            "the idempotency key table does not exist: run `idem_runtime::migrate(&pool)` on \
             this database when the service starts",
        )
    }

    /// Whether the database did not answer in time ([`Error::TimedOut`]).
    pub fn is_timed_out(&self) -> bool {
        matches!(self, Self::TimedOut { .. })
    }

    pub(crate) fn corrupt(reason: impl Into<String>) -> Self {
        Self::CorruptRow {
            reason: reason.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_error_written_for_a_person_reads_as_its_text_when_main_returns_it() {
        let reason =
            "PostgreSQL is reached through \"pgbouncer\" in transaction mode:\nuse a session";
        let error = Error::Pooler {
            reason: reason.to_owned(),
        };
        assert_eq!(format!("{error:?}"), reason);
        assert_eq!(format!("{:?}", Error::ReadOnly), "ReadOnly");
    }
}

/// A stored answer or step output that cannot be opened.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unopened {
    /// It was sealed with a key this store does not have.
    #[error("it was sealed with key id {id:?}, which is not among this store's keys ({have})")]
    KeyNotConfigured {
        /// The key id it names.
        id: String,
        /// The ids this store has, or "none".
        have: String,
    },
    /// Its bytes do not open with the key it names: altered, or moved from another key's row.
    #[error("it does not open with key id {id:?}: its bytes were altered or belong to another key")]
    Altered {
        /// The key id it names.
        id: String,
    },
}

impl Unopened {
    /// The key id the sealed value names.
    pub fn key_id(&self) -> &str {
        match self {
            Self::KeyNotConfigured { id, .. } | Self::Altered { id } => id,
        }
    }
}
