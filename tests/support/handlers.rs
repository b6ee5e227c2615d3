//! Test-only handlers, over each database: they count their calls, write a row, and fail on
//! purpose (a 5xx, a panic) or wait for the test.

/// The test handlers and their routes over one database type.
macro_rules! test_handlers {
    ($db:ty) => {
        use std::sync::{Arc, atomic::Ordering};

        use axum::{
            Extension, Router,
            http::{StatusCode, header},
            response::IntoResponse,
            routing::post,
        };
        use idem_examples::auth::Tenant;
        use idem_runtime::{Store, idempotent};
        use sqlx::Transaction;

        use crate::{Account, Calls};

        /// `/test/flaky`, `/test/panic`, `/test/global`, `/test/slow`, `/test/external-slow`,
        /// `/test/redirect`, `/test/aborted`, `/test/deferred`, `/test/account`, and
        /// `/test/nest-a/x`, `/test/nest-b/x` (one handler nested under two prefixes).
        pub fn routes(calls: Arc<Calls>, gate: Arc<tokio::sync::Semaphore>) -> Router<Store<$db>> {
            let nested = || Router::new().route("/x", post(slow));
            Router::new()
                .route("/test/flaky", post(flaky))
                .route("/test/panic", post(panicky))
                .route("/test/global", post(global))
                .route("/test/slow", post(slow))
                .route("/test/external-slow", post(external_slow))
                .route("/test/redirect", post(redirect))
                .route("/test/aborted", post(aborted))
                .route("/test/deferred", post(deferred))
                .route("/test/account", post(account))
                .nest("/test/nest-a", nested())
                .nest("/test/nest-b", nested())
                .layer(Extension(calls))
                .layer(Extension(gate))
                .layer(tower_http::catch_panic::CatchPanicLayer::new())
        }

        async fn record_effect(tx: &mut Transaction<'_, $db>, route: &str, tenant: &Tenant) {
            sqlx::query("INSERT INTO test_effects (route, tenant) VALUES ($1, $2)")
                .bind(route)
                .bind(&tenant.0)
                .execute(&mut **tx)
                .await
                .expect("insert effect");
        }

        /// Writes, then answers 503 on its first call and 201 afterwards.
        #[idempotent(scope = "tenant", retention = "1h")]
        async fn flaky(
            tenant: Tenant,
            Extension(calls): Extension<Arc<Calls>>,
            tx: &mut Transaction<'_, $db>,
        ) -> impl IntoResponse {
            record_effect(tx, "flaky", &tenant).await;
            let call = calls.flaky.fetch_add(1, Ordering::SeqCst) + 1;
            if call == 1 {
                (StatusCode::SERVICE_UNAVAILABLE, format!("call {call}"))
            } else {
                (StatusCode::CREATED, format!("call {call}"))
            }
        }

        /// Writes, then panics on its first call; answers 201 afterwards.
        #[idempotent(scope = "tenant", retention = "1h")]
        async fn panicky(
            tenant: Tenant,
            Extension(calls): Extension<Arc<Calls>>,
            tx: &mut Transaction<'_, $db>,
        ) -> (StatusCode, String) {
            record_effect(tx, "panic", &tenant).await;
            let call = calls.panic.fetch_add(1, Ordering::SeqCst) + 1;
            assert!(call > 1, "the handler panics on its first call");
            (StatusCode::CREATED, format!("call {call}"))
        }

        /// Keys shared by every caller.
        #[idempotent(global, retention = "1h")]
        async fn global(
            Extension(calls): Extension<Arc<Calls>>,
            tx: &mut Transaction<'_, $db>,
            body: String,
        ) -> (StatusCode, String) {
            sqlx::query("SELECT 1")
                .execute(&mut **tx)
                .await
                .expect("select");
            let call = calls.global.fetch_add(1, Ordering::SeqCst) + 1;
            (StatusCode::CREATED, format!("call {call}: {body}"))
        }

        /// Writes, then waits for the test to open the gate.
        #[idempotent(scope = "tenant", retention = "1h")]
        async fn slow(
            tenant: Tenant,
            Extension(calls): Extension<Arc<Calls>>,
            Extension(gate): Extension<Arc<tokio::sync::Semaphore>>,
            tx: &mut Transaction<'_, $db>,
        ) -> (StatusCode, String) {
            record_effect(tx, "slow", &tenant).await;
            calls.slow.fetch_add(1, Ordering::SeqCst);
            gate.acquire().await.expect("gate open").forget();
            (StatusCode::CREATED, "done".to_owned())
        }

        /// Writes, then answers 303 See Other with a `Location`.
        #[idempotent(scope = "tenant", retention = "1h")]
        async fn redirect(
            tenant: Tenant,
            Extension(calls): Extension<Arc<Calls>>,
            tx: &mut Transaction<'_, $db>,
        ) -> (StatusCode, [(header::HeaderName, String); 1], String) {
            record_effect(tx, "redirect", &tenant).await;
            let call = calls.redirect.fetch_add(1, Ordering::SeqCst) + 1;
            (
                StatusCode::SEE_OTHER,
                [(header::LOCATION, format!("/test/elsewhere/{call}"))],
                format!("see call {call}"),
            )
        }

        /// Writes, then runs a statement that fails (a duplicate primary key), ignores the
        /// error and answers 201 anyway.
        #[idempotent(scope = "tenant", retention = "1h")]
        async fn aborted(
            tenant: Tenant,
            Extension(calls): Extension<Arc<Calls>>,
            tx: &mut Transaction<'_, $db>,
        ) -> (StatusCode, String) {
            record_effect(tx, "aborted", &tenant).await;
            let call = calls.aborted.fetch_add(1, Ordering::SeqCst) + 1;
            for _ in 0..2 {
                let _ignored = sqlx::query("INSERT INTO test_unique (id) VALUES (1)")
                    .execute(&mut **tx)
                    .await;
            }
            (StatusCode::CREATED, format!("call {call}"))
        }

        /// Writes a row whose deferred foreign key has no parent: the database refuses the
        /// transaction at COMMIT, not before.
        #[idempotent(scope = "tenant", retention = "1h")]
        async fn deferred(
            tenant: Tenant,
            Extension(calls): Extension<Arc<Calls>>,
            tx: &mut Transaction<'_, $db>,
        ) -> (StatusCode, String) {
            record_effect(tx, "deferred", &tenant).await;
            calls.deferred.fetch_add(1, Ordering::SeqCst);
            sqlx::query("INSERT INTO test_child (parent) VALUES (999)")
                .execute(&mut **tx)
                .await
                .expect("a deferred constraint is checked at COMMIT only");
            (StatusCode::CREATED, "written".to_owned())
        }

        /// Scoped by the `X-Account` header, which may be empty.
        #[idempotent(scope = "account", retention = "1h")]
        async fn account(account: Account, tx: &mut Transaction<'_, $db>) -> (StatusCode, String) {
            sqlx::query("SELECT 1")
                .execute(&mut **tx)
                .await
                .expect("select");
            (StatusCode::CREATED, format!("account {:?}", account.0))
        }

        /// External mode: counts its calls; the first waits for the test to open the gate.
        #[idempotent(scope = "tenant", retention = "1h", lease = "5s", backend = $db)]
        async fn external_slow(
            tenant: Tenant,
            Extension(calls): Extension<Arc<Calls>>,
            Extension(gate): Extension<Arc<tokio::sync::Semaphore>>,
        ) -> (StatusCode, String) {
            let call = calls.external.fetch_add(1, Ordering::SeqCst) + 1;
            if call == 1 {
                gate.acquire().await.expect("gate open").forget();
            }
            (StatusCode::CREATED, format!("call {call} for {}", tenant.0))
        }
    };
}

/// Over PostgreSQL.
pub mod postgres {
    test_handlers!(sqlx::Postgres);
}

/// Over SQLite.
pub mod sqlite {
    test_handlers!(sqlx::Sqlite);
}
