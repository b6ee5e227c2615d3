//! What differs in the command's SQL from one database to the next: how a time becomes Unix
//! milliseconds, how `scope` and `key` are named and read back, the casts, the placeholders.
//! The statements themselves are written once, in `db`.

/// The SQL fragments of one database.
pub struct Dialect {
    /// The current time, in Unix milliseconds.
    pub now: &'static str,
    /// A time column, in Unix milliseconds.
    pub ms: fn(&str) -> String,
    /// The `key` column as a name (a reserved word on MySQL).
    pub key: &'static str,
    /// `scope` and `key` read back as text.
    pub scope_and_key: &'static str,
    /// The type a `CAST` turns an integer into, as a 64-bit signed integer.
    pub bigint: &'static str,
    /// The type a `CAST` turns JSON into, as text.
    pub text: &'static str,
    /// The placeholder of the `n`th parameter (from 1).
    pub param: fn(usize) -> String,
}

fn numbered(n: usize) -> String {
    format!("${n}")
}

fn question_mark(_: usize) -> String {
    "?".to_owned()
}

fn pg_ms(column: &str) -> String {
    format!("(EXTRACT(EPOCH FROM {column}) * 1000)::bigint")
}

/// SQLite stores Unix milliseconds already.
fn sqlite_ms(column: &str) -> String {
    column.to_owned()
}

/// `DATETIME(6)` in UTC, counted from the epoch as a naive time: no session time zone is
/// involved (`UNIX_TIMESTAMP` would read the column in the session's zone).
fn mysql_ms(column: &str) -> String {
    format!("(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', {column}) DIV 1000)")
}

/// PostgreSQL.
pub const POSTGRES: Dialect = Dialect {
    now: "(EXTRACT(EPOCH FROM now()) * 1000)::bigint",
    ms: pg_ms,
    key: "key",
    scope_and_key: "scope, key",
    bigint: "BIGINT",
    text: "TEXT",
    param: numbered,
};

/// SQLite.
pub const SQLITE: Dialect = Dialect {
    now: "CAST(unixepoch('subsec') * 1000 AS INTEGER)",
    ms: sqlite_ms,
    key: "key",
    scope_and_key: "scope, key",
    bigint: "BIGINT",
    text: "TEXT",
    param: numbered,
};

/// MySQL and MariaDB: `scope` and `key` are `VARBINARY`, which sqlx decodes only as bytes, so
/// they are read back converted to text; times are `DATETIME(6)` in UTC.
pub const MYSQL: Dialect = Dialect {
    now: "(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000)",
    ms: mysql_ms,
    key: "`key`",
    scope_and_key: "CONVERT(scope USING utf8mb4) AS scope, CONVERT(`key` USING utf8mb4) AS `key`",
    bigint: "SIGNED",
    text: "CHAR",
    param: question_mark,
};

impl Dialect {
    /// The columns of a [`Key`](crate::db::Key); the stored body only when `body`.
    pub fn key_columns(&self, body: bool) -> String {
        let ms = self.ms;
        format!(
            "{scope_and_key}, status, method, path, \
             CAST(response_status AS {bigint}) AS response_status, \
             {now} - {created} AS age_ms, {expires} - {now} AS expires_in_ms, \
             {now} - {locked} AS claimed_ms, {lease} - {now} AS lease_left_ms, \
             CAST(steps AS {text}) AS steps, {body} AS response_body",
            scope_and_key = self.scope_and_key,
            bigint = self.bigint,
            text = self.text,
            now = self.now,
            created = ms("created_at"),
            expires = ms("expires_at"),
            locked = ms("locked_at"),
            lease = ms("lease_until"),
            body = if body { "response_body" } else { "NULL" },
        )
    }

    /// `scope = ? AND key = ?`, with this database's placeholders 1 and 2.
    pub fn this_key(&self) -> String {
        format!(
            "scope = {} AND {} = {}",
            (self.param)(1),
            self.key,
            (self.param)(2)
        )
    }
}
