//! What a connection pooler in front of PostgreSQL lets through, found at start: the public
//! `idem_runtime::postgres` (documented there), the options a stock PgBouncer accepts, and the
//! refusal the flow, the migrations and the `idem` command explain.

use sqlx::{Connection, PgConnection, PgPool, postgres::PgConnectOptions};

/// How the connections of a pool reach PostgreSQL, as [`check_pooler`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pooling {
    /// Each client connection had a server connection of its own: a direct connection, or a
    /// pooler in session mode (or one in transaction mode that happened to give the two probe
    /// connections different server connections; the errors a request then meets are logged
    /// with the same explanation).
    Own,
    /// Two client connections were given the same server connection, one after the other, and
    /// sqlx's prepared statements worked on it: a pooler in transaction mode that keeps
    /// clients' prepared statements apart (PgBouncer 1.21+ with `max_prepared_statements`).
    /// Requests work; anything that needs a session does not ([`crate::backend::migrate`]'s advisory
    /// lock, a session `SET`, `LISTEN`).
    Shared,
}

/// The remedies, said once for every refusal.
const REMEDIES: &str = "use the pooler's session mode (PgBouncer: pool_mode = session), \
     PgBouncer 1.21 or newer with max_prepared_statements set, or a direct connection to \
     PostgreSQL";

/// Opens two connections of `pool`'s options (outside the pool, whatever its size), runs one
/// prepared statement on the first, then the same on the second while the first stays open,
/// and says what that showed. Leaves nothing behind: no session setting, no lock; the two
/// connections are closed.
///
/// # Errors
///
/// [`Error::Pooler`](crate::error::Error::Pooler) when the statements meet a pooler in transaction
/// mode that does not keep prepared statements apart (PostgreSQL answers `42P05`, `26000`, or
/// a `Bind` that does not fit its statement), with the cause and the remedies;
/// [`Error::Database`](crate::error::Error::Database) when PostgreSQL cannot be reached or fails
/// otherwise.
pub async fn check_pooler(pool: &PgPool) -> Result<Pooling, crate::error::Error> {
    let options = pool.connect_options();
    let mut first = PgConnection::connect_with(&options)
        .await
        .map_err(explained)?;
    let mut second = PgConnection::connect_with(&options)
        .await
        .map_err(explained)?;
    let first_pid = backend_pid(&mut first).await;
    let second_pid = backend_pid(&mut second).await;
    let _ = first.close().await;
    let _ = second.close().await;
    Ok(if first_pid? == second_pid? {
        Pooling::Shared
    } else {
        Pooling::Own
    })
}

/// The server process behind `conn`, asked in a prepared statement (sqlx names it
/// `sqlx_s_1` on a new connection, as on every other new connection).
async fn backend_pid(conn: &mut PgConnection) -> Result<i32, crate::error::Error> {
    sqlx::query_scalar::<_, i32>("SELECT pg_backend_pid()")
        .fetch_one(conn)
        .await
        .map_err(explained)
}

/// `error` as [`Error::Pooler`](crate::error::Error::Pooler) when [`pooler_refusal`] explains it.
fn explained(error: sqlx::Error) -> crate::error::Error {
    match pooler_refusal(&error) {
        Some(reason) => crate::error::Error::Pooler { reason },
        None => error.into(),
    }
}

/// The options idem connects to PostgreSQL with: `url`'s, without the startup parameter
/// `extra_float_digits` that sqlx sends by default and PgBouncer refuses unless its
/// `ignore_startup_parameters` lists it. PostgreSQL 12 and newer send floats exactly without
/// it; idem reads none as text.
///
/// # Errors
///
/// [`Error::Database`](crate::error::Error::Database) when `url` does not parse.
pub fn connect_options(url: &str) -> Result<PgConnectOptions, crate::error::Error> {
    let options: PgConnectOptions = url.parse()?;
    Ok(options.extra_float_digits(None))
}

/// What `error` means, with the remedies, when a pooler in front of PostgreSQL caused it:
/// PgBouncer's refusal of a startup parameter it does not know (`unsupported startup
/// parameter: …`, any mode); or, in transaction mode, a collision of sqlx's prepared
/// statements (a statement name taken by another client's, `42P05`; one that is not there,
/// `26000`; a `Bind` that met another statement than its own, `08P01` "bind message supplies
/// …"). `None` for any other error.
#[must_use]
pub fn pooler_refusal(error: &sqlx::Error) -> Option<String> {
    let sqlx::Error::Database(refusal) = error else {
        return None;
    };
    if let Some(parameter) = refusal
        .message()
        .strip_prefix("unsupported startup parameter")
    {
        return Some(startup_parameter_refused(parameter));
    }
    let prepared = match refusal.code().as_deref() {
        Some("42P05" | "26000") => true,
        Some("08P01") => refusal.message().starts_with("bind message"),
        _ => false,
    };
    prepared.then(|| {
        format!(
            "PostgreSQL answered \"{}\" ({}): a pooler in transaction mode (PgBouncer's \
             pool_mode = transaction, or Supavisor's, or RDS Proxy's) sits in front of \
             PostgreSQL and gives one server connection to several clients without keeping \
             their prepared statements apart, and sqlx prepares every statement it sends; \
             {REMEDIES}",
            refusal.message(),
            refusal.code().unwrap_or_default(),
        )
    })
}

/// The explanation of PgBouncer's refusal of a startup parameter; `rest` is what follows
/// `unsupported startup parameter` in its message (`: extra_float_digits`), the parameter's
/// name first.
fn startup_parameter_refused(rest: &str) -> String {
    let parameter = rest
        .trim_start_matches(|c: char| c == ':' || c.is_whitespace())
        .split(['=', ' '])
        .next()
        .filter(|name| !name.is_empty())
        .unwrap_or("?");
    let what = if parameter == "extra_float_digits" {
        "sqlx sends extra_float_digits on every connection unless told not to: connect with \
         idem_runtime::postgres::connect_options (sqlx's PgConnectOptions::extra_float_digits(None)), \
         or add it to PgBouncer's ignore_startup_parameters (pgbouncer.ini: \
         ignore_startup_parameters = extra_float_digits)"
    } else {
        "PgBouncer passes on only the startup parameters it tracks: set it another way (SET in \
         the session, or on the database or role), or add it to PgBouncer's \
         ignore_startup_parameters in pgbouncer.ini (which drops it: the setting is then not \
         applied)"
    };
    format!(
        "the pooler in front of PostgreSQL (PgBouncer) refused the connection: \
         \"unsupported startup parameter{rest}\", a parameter it does not know ({parameter}); \
         {what}"
    )
}

/// The explanation for migrations refused on a pool whose server connections are shared.
pub(crate) fn migrations_need_a_session() -> String {
    "the migrations hold a session-level advisory lock, which a pooler in transaction mode does \
     not keep (two connections of this pool were given one server connection): run them \
     through a direct connection to PostgreSQL, or the pooler's session mode"
        .to_owned()
}
