//! The gated handlers of the timeout and wait tests: a body that makes its side effect, then
//! waits on a gate the test opens, so that the test can stop it, or send duplicates, while it
//! runs. The body is the same under every `#[idempotent(...)]` attribute those tests try; the
//! attribute is on a fn, so [`gated_handler!`](crate::gated_handler) declares one handler per
//! attribute around the body here.

use std::{
    collections::VecDeque,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
};

use axum::http::StatusCode;
use idem_runtime::{IdempotencyContext, Store};
use sqlx::Transaction;

use crate::{
    Tenant,
    test_app::{Param, TestBackend, run, run_on},
};

/// What the gated handlers share with the test (routed as an `Extension<Arc<Probe>>`).
#[derive(Debug)]
pub struct Probe {
    /// Bodies that started (and made their side effect).
    started: AtomicUsize,
    /// Bodies that got past the gate and answered.
    finished: AtomicUsize,
    /// Closed until the test opens it.
    gate: tokio::sync::Semaphore,
    /// The status each call answers, in order; 201 once the script is used up.
    script: Mutex<VecDeque<u16>>,
}

impl Probe {
    /// A probe with its gate closed and an empty script.
    pub fn new() -> Arc<Self> {
        Arc::new(Self {
            started: AtomicUsize::new(0),
            finished: AtomicUsize::new(0),
            gate: tokio::sync::Semaphore::new(0),
            script: Mutex::default(),
        })
    }

    /// How many bodies started.
    pub fn started(&self) -> usize {
        self.started.load(Ordering::SeqCst)
    }

    /// How many bodies got past the gate and answered.
    pub fn finished(&self) -> usize {
        self.finished.load(Ordering::SeqCst)
    }

    /// Lets `n` held bodies finish.
    pub fn open(&self, n: usize) {
        self.gate.add_permits(n);
    }

    /// The next call that is not scripted yet answers `status` (a call reads the script once
    /// past the gate).
    pub fn answer_next(&self, status: u16) {
        self.script
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_back(status);
    }

    /// Counts a body that started, waits on the gate, counts it finished; answers its scripted
    /// status with the call's number (`call 1`, `call 2`, …).
    pub async fn hold(&self) -> (StatusCode, String) {
        let call = self.started.fetch_add(1, Ordering::SeqCst) + 1;
        self.gate.acquire().await.expect("gate open").forget();
        self.finished.fetch_add(1, Ordering::SeqCst);
        let status = self
            .script
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop_front()
            .unwrap_or(201);
        (
            StatusCode::from_u16(status).expect("a status"),
            format!("call {call}"),
        )
    }

    /// The transactional body: writes its `test_effects` row (`route`, the tenant) in the
    /// handler's transaction, then [holds](Self::hold).
    pub async fn write_then_hold<DB: TestBackend>(
        &self,
        route: &str,
        tenant: &Tenant,
        tx: &mut Transaction<'_, DB>,
    ) -> (StatusCode, String) {
        let sql = "INSERT INTO test_effects (route, tenant) VALUES ($1, $2)";
        run(tx, sql, &[Param::Text(route), Param::Text(&tenant.0)])
            .await
            .expect("insert effect");
        self.hold().await
    }

    /// The external body: performs its side effect (a committed `test_effects` row whose route
    /// is the key derived as `effect`, as a downstream call would be keyed), then
    /// [holds](Self::hold).
    pub async fn effect_then_hold<DB: TestBackend>(
        &self,
        ctx: &IdempotencyContext,
        tenant: &Tenant,
        store: &Store<DB>,
    ) -> (StatusCode, String) {
        let sql = "INSERT INTO test_effects (route, tenant) VALUES ($1, $2)";
        let effect = ctx.derive("effect");
        run_on(
            store.pool(),
            sql,
            &[Param::Text(&effect), Param::Text(&tenant.0)],
        )
        .await
        .expect("insert effect");
        self.hold().await
    }
}

/// Declares a gated handler under the `#[idempotent(...)]` attribute given, generic over the
/// backend (route it as `post(name::<DB>)`, with an `Extension(Arc<Probe>)` layer):
///
/// - with `external` first among the arguments (which must then say `backend = DB`), the body
///   is [`Probe::effect_then_hold`];
/// - otherwise it is [`Probe::write_then_hold`] in the handler's transaction, its row's route
///   the handler's name.
///
/// Both are scoped by the `tenant` parameter (`scope = "tenant"`).
///
/// ```ignore
/// idem_tests::gated_handler! {
///     /// Writes a row in its transaction, then waits on the gate.
///     #[idempotent(scope = "tenant", retention = "1h", timeout = "3s")]
///     async fn stuck;
/// }
/// ```
#[macro_export]
macro_rules! gated_handler {
    (
        $(#[doc = $doc:literal])*
        #[idempotent(external, $($args:tt)*)]
        async fn $name:ident;
    ) => {
        $(#[doc = $doc])*
        #[::idem_runtime::idempotent(external, $($args)*)]
        async fn $name<DB: $crate::TestBackend>(
            tenant: $crate::Tenant,
            ctx: ::idem_runtime::IdempotencyContext,
            ::axum::Extension(probe): ::axum::Extension<::std::sync::Arc<$crate::Probe>>,
            ::axum::extract::State(store): ::axum::extract::State<::idem_runtime::Store<DB>>,
        ) -> (::axum::http::StatusCode, String) {
            probe.effect_then_hold(&ctx, &tenant, &store).await
        }
    };
    (
        $(#[doc = $doc:literal])*
        #[idempotent($($args:tt)*)]
        async fn $name:ident;
    ) => {
        $(#[doc = $doc])*
        #[::idem_runtime::idempotent($($args)*)]
        async fn $name<DB: $crate::TestBackend>(
            tenant: $crate::Tenant,
            ::axum::Extension(probe): ::axum::Extension<::std::sync::Arc<$crate::Probe>>,
            tx: &mut ::sqlx::Transaction<'_, DB>,
        ) -> (::axum::http::StatusCode, String) {
            probe.write_then_hold(stringify!($name), &tenant, tx).await
        }
    };
}
