//! Connections taken from the store's pool for one piece of work, which go back to the pool
//! only when that work ended with the connection in a known state.

use sqlx::{Database, pool::PoolConnection};

/// A pooled connection lent to one piece of the layer's work (a claim and its transaction, a
/// lookup, a completion). The work marks it settled once it ended with
/// the connection idle and outside any transaction; dropped unsettled (its deadline passed,
/// its request was cancelled, its handler panicked), the connection is closed instead of going
/// back to the pool.
///
/// A connection abandoned in the middle of a statement may still be inside a transaction
/// holding a key, with an answer on its way; and sqlx tests a returned connection with a round
/// trip that, on a database that stopped answering, waits as long as TCP does, holding a place
/// in the pool. Closed, the connection ends its session on the server (which rolls its
/// transaction back) and the pool opens a new one when it needs it.
#[derive(Debug)]
pub struct Checkout<DB: Database> {
    conn: PoolConnection<DB>,
    settled: bool,
}

impl<DB: Database> Checkout<DB> {
    pub(crate) fn new(conn: PoolConnection<DB>) -> Self {
        Self {
            conn,
            settled: false,
        }
    }

    /// The connection, and the flag that settles it, borrowed apart: a transaction can borrow
    /// the one while its owner keeps the other.
    pub(crate) fn parts(&mut self) -> (&mut PoolConnection<DB>, Settle<'_>) {
        (&mut self.conn, Settle(&mut self.settled))
    }

    /// The work on the connection ended with it idle, outside any transaction: it goes back
    /// to the pool when dropped.
    pub(crate) fn settle(&mut self) {
        self.settled = true;
    }
}

impl<DB: Database> std::ops::Deref for Checkout<DB> {
    type Target = DB::Connection;

    fn deref(&self) -> &DB::Connection {
        &self.conn
    }
}

impl<DB: Database> std::ops::DerefMut for Checkout<DB> {
    fn deref_mut(&mut self) -> &mut DB::Connection {
        &mut self.conn
    }
}

impl<DB: Database> Drop for Checkout<DB> {
    fn drop(&mut self) {
        if !self.settled {
            self.conn.close_on_drop();
        }
    }
}

/// Settles the [`Checkout`] it was borrowed from.
#[derive(Debug)]
pub(crate) struct Settle<'c>(&'c mut bool);

impl Settle<'_> {
    /// See [`Checkout::settle`].
    pub(crate) fn settle(&mut self) {
        *self.0 = true;
    }
}
