//! SQL written once with PostgreSQL's numbered parameters (`$1`), as MySQL and MariaDB spell it:
//! positional `?` parameters, and the few clauses they write otherwise. The example's MySQL
//! statements use [`in_order`]; the test suites' statements, written for PostgreSQL and SQLite,
//! use [`positional`] (this is the one copy of it).

/// What statements written for PostgreSQL and SQLite say otherwise on MySQL.
const SPELLINGS: &[(&str, &str)] = &[
    (
        "ON CONFLICT (id) DO NOTHING",
        "ON DUPLICATE KEY UPDATE id = id",
    ),
    ("AS BIGINT)", "AS SIGNED)"),
];

/// `sql` with MySQL's spelling of the clauses that differ (an upsert that keeps the first row,
/// a cast to a 64-bit integer).
pub fn spelled(sql: &str) -> String {
    SPELLINGS
        .iter()
        .fold(sql.to_owned(), |sql, (theirs, mine)| {
            sql.replace(theirs, mine)
        })
}

/// `sql`, written for PostgreSQL's numbered parameters, with MySQL's positional ones and its
/// spelling of the clauses that differ ([`spelled`]); and the order in which to bind the
/// numbered parameters for them (from 0: `$2, $1` binds the second value first).
///
/// # Panics
///
/// When a `$` is not followed by a parameter number.
pub fn positional(sql: &str) -> (String, Vec<usize>) {
    numbered(&spelled(sql))
}

/// `sql`, whose numbered parameters appear once each and in order (`$1`, `$2`, …, as all of the
/// example's shared statements do), with MySQL's positional ones: the values are bound in the
/// same order. Clauses are left as they are.
///
/// # Panics
///
/// When a `$` is not followed by a parameter number; in debug builds, when the numbers are not
/// `1, 2, …` in the order they appear: binding in order would then give a parameter another's
/// value.
pub fn in_order(sql: &str) -> String {
    let (out, order) = numbered(sql);
    debug_assert!(
        order.iter().copied().eq(0..order.len()),
        "the parameters of {sql:?} are not $1, $2, … in order"
    );
    out
}

/// `sql` with each `$<n>` made `?`, and the `n - 1` of each in the order they appear.
fn numbered(sql: &str) -> (String, Vec<usize>) {
    let mut out = String::with_capacity(sql.len());
    let mut order = Vec::new();
    let mut chars = sql.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '$' {
            out.push(c);
            continue;
        }
        let mut number = String::new();
        while let Some(digit) = chars.next_if(char::is_ascii_digit) {
            number.push(digit);
        }
        let n: usize = number
            .parse()
            .unwrap_or_else(|_| panic!("a `$` without a parameter number in {sql:?}"));
        order.push(n - 1);
        out.push('?');
    }
    (out, order)
}

#[cfg(test)]
mod tests {
    use super::{in_order, positional};

    #[test]
    fn numbered_parameters_become_positional_in_the_order_they_appear() {
        let (sql, order) = positional("SELECT $2, $1 WHERE a = $2 AND b = $10");
        assert_eq!(sql, "SELECT ?, ? WHERE a = ? AND b = ?");
        assert_eq!(order, [1, 0, 1, 9]);
        let (sql, _) = positional("INSERT INTO t (id) VALUES ($1) ON CONFLICT (id) DO NOTHING");
        assert_eq!(
            sql,
            "INSERT INTO t (id) VALUES (?) ON DUPLICATE KEY UPDATE id = id"
        );
    }

    #[test]
    fn numbered_parameters_in_order_become_question_marks() {
        assert_eq!(
            in_order("UPDATE t SET a = $1 WHERE b = $2 AND c = $3"),
            "UPDATE t SET a = ? WHERE b = ? AND c = ?"
        );
        assert_eq!(in_order("SELECT 1"), "SELECT 1");
    }

    #[test]
    #[should_panic(expected = "not $1, $2")]
    #[cfg(debug_assertions)]
    fn parameters_out_of_order_are_refused_where_they_are_bound_in_order() {
        in_order("UPDATE t SET a = $2 WHERE b = $1");
    }
}
