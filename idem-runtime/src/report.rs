//! What the operator's statements report (the `admin` module): the table's counts, one key, a
//! parked claim, and what a release or a resume came to. The backends build them; the `idem`
//! command and an admin endpoint print them.

use serde::Serialize;

/// The counts of the key table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Stats {
    /// Keys with a stored response.
    pub completed: i64,
    /// Claims in flight: `started` rows with a lease (external mode; a transactional claim is
    /// never visible outside its transaction).
    pub started: i64,
    /// The age of the oldest claim in flight, in milliseconds.
    pub oldest_started_ms: Option<i64>,
    /// Rows past their expiry that the purge has not deleted yet (parked claims, which the
    /// purge passes over, not counted).
    pub expired: i64,
    /// Claims the recovery gave up on, waiting for an operator
    /// ([`Store::parked`](crate::store::Store::parked)).
    pub parked: i64,
}

/// A claim the recovery gave up on
/// ([`RecoveryOptions::max_attempts`](crate::tasks::RecoveryOptions::max_attempts)): its
/// request's route, never its body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct ParkedClaim {
    /// The scope (the caller).
    pub scope: String,
    /// The `Idempotency-Key`.
    pub key: String,
    /// The first request's method.
    pub method: String,
    /// The first request's path and query.
    pub path: String,
    /// The rounds the recovery's hook had at it.
    pub attempts: i64,
    /// The hook's last reason ([`Verdict::Failed`](crate::tasks::Verdict::Failed)); `None` when
    /// it only ever kept the claim.
    pub last_error: Option<String>,
    /// Since it was parked, in milliseconds.
    pub parked_ms: i64,
    /// Since its claim was taken, in milliseconds.
    pub claimed_ms: Option<i64>,
}

/// What [`Store::resume_parked`](crate::store::Store::resume_parked) or [`Store::abandon_parked`](crate::store::Store::abandon_parked) found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unparked {
    /// Done: resumed (the recovery's next pass hands it to the hook again) or abandoned (the
    /// next retry runs the handler).
    Done,
    /// The key exists but is not a parked claim: nothing done.
    NotParked,
    /// No such key.
    Missing,
}

/// One key's row, as an operator sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct KeyInfo {
    /// The scope (the caller).
    pub scope: String,
    /// The `Idempotency-Key`.
    pub key: String,
    /// `started` or `completed`.
    pub status: String,
    /// The first request's method.
    pub method: String,
    /// The first request's path and query.
    pub path: String,
    /// The stored response's status.
    pub response_status: Option<i64>,
    /// Since the row was written, in milliseconds.
    pub age_ms: i64,
    /// Until it expires (negative: expired), in milliseconds.
    pub expires_in_ms: i64,
    /// Since the claim was taken, in milliseconds.
    pub claimed_ms: Option<i64>,
    /// Until the claim's lease ends (negative: ended), in milliseconds.
    pub lease_left_ms: Option<i64>,
    /// The recorded steps (recovery points), as JSON: `[{"step": name, "output": …}]`. Read
    /// with the body, sealed outputs are opened with the store's keys; otherwise as stored
    /// (a sealed output is `{"idem-sealed": <key id>, "data": …}`).
    pub steps: Option<String>,
    /// The id of the key the stored answer is sealed with
    /// ([`EncryptionKeys`](crate::seal::EncryptionKeys)); `None` for an answer stored in the
    /// clear, or none at all. Read with or without the body.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sealed_with: Option<String>,
    /// The stored response's headers, only when asked for (with the body); a sealed answer's
    /// opened, or `None` when it does not open ([`unopened`](Self::unopened)).
    #[serde(skip)]
    pub response_headers: Option<Vec<(String, String)>>,
    /// The stored response's body, only when asked for; a sealed answer's opened, or `None`
    /// when it does not open ([`unopened`](Self::unopened)).
    #[serde(skip)]
    pub response_body: Option<Vec<u8>>,
    /// Why a sealed answer, or a sealed step output, read with the body could not be opened
    /// with the store's keys: no keys, not the key it names, or altered (the answer's reason
    /// when both do not open). `None` otherwise.
    #[serde(skip)]
    pub unopened: Option<crate::seal::Unopened>,
}

/// A gRPC call's stored answer, as an operator reads it (see [`KeyInfo::grpc_answer`]).
#[cfg(feature = "grpc")]
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum GrpcAnswer {
    /// The method's message, protobuf-encoded: its type is the service's, unknown here.
    Message(Vec<u8>),
    /// The method's status: its code and message.
    Status(tonic::Code, String),
}

#[cfg(feature = "grpc")]
impl KeyInfo {
    /// The stored answer of a gRPC call (a key whose method is `GRPC`), read from the body
    /// fetched with the key ([`Store::inspect`](crate::store::Store::inspect) with `with_body`): `None` for an HTTP key, a
    /// claim without an answer, or a key read without its body. The key's `response_status`
    /// is only the HTTP status the answer is kept under (several codes share one).
    #[must_use]
    pub fn grpc_answer(&self) -> Option<GrpcAnswer> {
        if self.method != crate::stored_grpc::GRPC_METHOD {
            return None;
        }
        let body = self.response_body.as_deref()?;
        match self.response_status? {
            200 => Some(GrpcAnswer::Message(body.to_vec())),
            _ => crate::stored_grpc::stored_status(body)
                .map(|(code, message)| GrpcAnswer::Status(code, message)),
        }
    }
}

/// What [`Store::release_claim`](crate::store::Store::release_claim) found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Released {
    /// The claim in flight was deleted: the next retry runs the handler again.
    Done,
    /// The key has a stored response, which retries replay: not released.
    Completed,
    /// The claim was parked by the recovery: not released here; [`Store::abandon_parked`](crate::store::Store::abandon_parked)
    /// is the operator's way to let it go (or [`Store::resume_parked`](crate::store::Store::resume_parked)).
    Parked,
    /// No such key.
    Missing,
    /// Another transaction is writing the key's row this instant (a completion, a renewal, a
    /// transactional claim on MySQL): not released; ask again to see where it stands.
    Busy,
}

/// What [`Store::rekey`](crate::store::Store::rekey) did, or with `dry_run` would do: the
/// stored answers and recorded steps it sealed again with the sealing key, and what it left.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Rekeyed {
    /// The id of the key it sealed with (the store's first).
    pub sealing_id: String,
    /// Whether it only looked: nothing was written.
    pub dry_run: bool,
    /// Completed keys and parked claims read.
    pub read: u64,
    /// Of those, rows sealed again (with `dry_run`, that would be): stored in the clear, or
    /// sealed with another key.
    pub resealed: u64,
    /// Of `resealed`, rows that held something in the clear (an answer, or a step's output):
    /// stored before the store had keys, or written into the table by someone else; once
    /// sealed, the two cannot be told apart.
    pub from_clear: u64,
    /// Of those read, rows already sealed with the sealing key (or with nothing to seal).
    pub current: u64,
    /// Rows that did not open, by the key id they name: sealed with a key the store does not
    /// have, or altered. Left as they are; a retry of one is answered 500 (`answerunreadable`).
    pub unopened: std::collections::BTreeMap<String, u64>,
    /// Rows whose headers, steps or status do not read as idem writes them: left as they are.
    pub corrupt: u64,
    /// Up to ten of the keys that did not open or did not read, as `(scope, key)`, for
    /// `idem inspect`.
    pub unopened_keys: Vec<(String, String)>,
    /// Rows another transaction held, twice over (a retry taking an expired key over at that
    /// instant): left as they are; run it again.
    pub busy: u64,
    /// Rows gone between their reading and their sealing (purged, forgotten, taken over by a
    /// retry): nothing of them is left to seal.
    pub gone: u64,
    /// Claims in flight left: their handler or the recovery is at work, and writes their row.
    /// Their answer is sealed with the sealing key when they complete; steps they recorded
    /// before the sealing key changed keep their key until then.
    pub in_flight_left: u64,
}

impl Rekeyed {
    /// Whether every completed key and parked claim is now (with `dry_run`, would be) sealed
    /// with the sealing key: nothing unopened, unreadable or busy.
    pub fn is_complete(&self) -> bool {
        self.unopened.is_empty() && self.corrupt == 0 && self.busy == 0
    }
}

/// What [`Store::forget`](crate::store::Store::forget) did to a scope: the completed keys it
/// deleted, and the claims of the scope it left, which are not answers to erase but work whose
/// outcome is not known yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Forgotten {
    /// Completed keys deleted (expired or not): a retry of one runs the handler again.
    pub deleted: u64,
    /// Claims in flight left (`started`, not parked): a handler or the recovery is at work on
    /// them, and deleting one would let a retry run the side effect twice.
    pub in_flight_left: u64,
    /// Parked claims left: the recovery gave up on them, and a person decides
    /// (`idem resume`, `idem abandon`).
    pub parked_left: u64,
}
