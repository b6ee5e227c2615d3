//! Scopes the database cannot store, from a route whose scope comes from the path.

use super::*;

/// A test-only route whose scope comes from the path, as an application's `Path` extractor
/// gives it: percent-decoded, so `%00` arrives as NUL.
macro_rules! path_scoped {
    ($db:ty) => {
        use axum::{Router, extract::Path, http::StatusCode, routing::post};
        use idem_runtime::{Store, idempotent};
        use sqlx::Transaction;

        /// `POST /accounts/{account}/touch`.
        pub fn router(store: Store<$db>) -> Router {
            Router::new()
                .route("/accounts/{account}/touch", post(touch))
                .with_state(store)
        }

        #[idempotent(scope = "account", retention = "1h")]
        async fn touch(
            Path(account): Path<String>,
            tx: &mut Transaction<'_, $db>,
        ) -> (StatusCode, String) {
            sqlx::query("SELECT 1")
                .execute(&mut **tx)
                .await
                .expect("select");
            (StatusCode::CREATED, format!("touched {}", account.len()))
        }
    };
}

mod path_scoped_postgres {
    path_scoped!(sqlx::Postgres);
}

mod path_scoped_sqlite {
    path_scoped!(sqlx::Sqlite);
}

mod path_scoped_mysql {
    path_scoped!(sqlx::MySql);
}

fn path_scoped_router(app: &App) -> axum::Router {
    match &app.db {
        idem_tests::Db::Postgres(pool) => {
            path_scoped_postgres::router(idem_runtime::Store::new(pool.clone()))
        }
        idem_tests::Db::Sqlite(pool) => {
            path_scoped_sqlite::router(idem_runtime::Store::new(pool.clone()))
        }
        idem_tests::Db::MySql(pool) => {
            path_scoped_mysql::router(idem_runtime::Store::new(pool.clone()))
        }
    }
}

/// Sends `path` to the path-scoped route with a fresh key.
async fn touch(app: &App, path: &str) -> idem_tests::Reply {
    use tower::ServiceExt;
    let request = idem_tests::Req::post(path).key("touch-1").build();
    let response = path_scoped_router(app)
        .oneshot(request)
        .await
        .expect("the router is infallible");
    idem_tests::Reply::read(response).await
}

/// A scope value PostgreSQL cannot store (NUL from `%00`, or one too long for the key's index)
/// is the caller's input, not a store outage: it is answered 400 `InvalidScope` on every
/// database, never 503 `StoreUnavailable` ("retry with the same key", which cannot succeed).
async fn unstorable_scopes_are_400_invalid_scope(app: App) {
    let long = format!("/accounts/{}/touch", Rng(5).word(3000));
    for path in ["/accounts/a%00b/touch", long.as_str()] {
        let reply = touch(&app, path).await;
        assert_eq!(
            reply.problem(axum::http::StatusCode::BAD_REQUEST),
            ProblemKind::InvalidScope.type_uri(),
            "{}",
            &path[..path.len().min(40)],
        );
    }
}

#[sqlx::test(migrations = false)]
async fn postgres_unstorable_scopes_are_400_invalid_scope(
    _: sqlx::postgres::PgPoolOptions,
    connect: sqlx::postgres::PgConnectOptions,
) {
    let app = service::app(TestDb::Postgres(Box::new(connect))).await;
    unstorable_scopes_are_400_invalid_scope(app).await;
}

#[tokio::test]
async fn sqlite_unstorable_scopes_are_400_invalid_scope() {
    let app = service::app(TestDb::sqlite()).await;
    unstorable_scopes_are_400_invalid_scope(app).await;
}

#[tokio::test]
async fn mysql_unstorable_scopes_are_400_invalid_scope() {
    let database = idem_tests::MySqlDb::create().await;
    let name = database.name().to_owned();
    {
        let app = service::app(TestDb::MySql(Box::new(database))).await;
        unstorable_scopes_are_400_invalid_scope(app).await;
    }
    idem_tests::MySqlDb::drop_named(&name).await;
}
