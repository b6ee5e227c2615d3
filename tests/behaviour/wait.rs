//! Duplicates that wait for the first request's outcome (`Prefer: wait`, RFC 7240), on both
//! backends and over real HTTP: the stored outcome as a replay marked `Preference-Applied`, the
//! handler run by a waiter when the first ended without a stored outcome, 409 when the wait is
//! over, and what never waits (a malformed key, another request under the key, a handler
//! without `wait`). Waiting holds no pooled connection: 200 waiters on a pool of 10, and a
//! waiter on one instance answered by a completion on another.
//!
//! The handlers here write their row, then wait on a gate the test opens; the tests synchronise
//! on counters (bodies started, requests waiting), never on time.

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use axum::{Extension, Router, http::StatusCode, routing::post as route_post};
use idem_client::{IdempotentRetry, RetryPolicy};
use idem_runtime::Store;
use idem_tests::{
    AnyStore, App, Building, Options, Parts, Probe, Service, TestBackend, TestDb, backend_tests,
    wait_until,
};
use tokio::task::JoinHandle;

/// The service of these tests: the routes below over the store it is given.
struct Waiting {
    probe: Arc<Probe>,
    /// Requests the service received, answered or not.
    requests: Arc<AtomicUsize>,
}

impl Service for Waiting {
    fn build(&self, parts: Parts) -> Building<'_> {
        Box::pin(async move {
            match parts.store {
                AnyStore::Postgres(store) => self.routes(store).await,
                AnyStore::Sqlite(store) => self.routes(store).await,
                AnyStore::MySql(store) => self.routes(store).await,
            }
        })
    }
}

impl Waiting {
    async fn routes<DB: TestBackend>(&self, store: Store<DB>) -> Router {
        idem_tests::migrate_and_create_tables(store.pool()).await;
        Router::new()
            .route("/wait", route_post(waits::<DB>))
            .route("/no-wait", route_post(no_wait::<DB>))
            .route("/wait-external", route_post(waits_external::<DB>))
            .layer(Extension(Arc::clone(&self.probe)))
            .layer(axum::middleware::map_request({
                let requests = Arc::clone(&self.requests);
                move |request: axum::extract::Request| {
                    requests.fetch_add(1, Ordering::SeqCst);
                    std::future::ready(request)
                }
            }))
            .with_state(store)
    }
}

idem_tests::gated_handler! {
    /// Writes its row in its transaction, then waits on the gate; duplicates may wait 5 s.
    #[idempotent(scope = "tenant", retention = "1h", wait = "5s")]
    async fn waits;
}

idem_tests::gated_handler! {
    /// As `/wait`, without `wait`: duplicates get 409 at once.
    #[idempotent(scope = "tenant", retention = "1h")]
    async fn no_wait;
}

idem_tests::gated_handler! {
    /// External mode: its side effect (a committed row under the derived key), then the gate.
    #[idempotent(external, scope = "tenant", lease = "30s", wait = "5s", backend = DB)]
    async fn waits_external;
}

/// A test's service, on its database and served over TCP.
struct Served {
    probe: Arc<Probe>,
    /// Requests the service received, answered or not.
    requests: Arc<AtomicUsize>,
    app: App,
    /// Its base URL.
    base: String,
}

/// The service on `db` with `options`, served over TCP.
async fn served(db: TestDb, options: Options) -> Served {
    let probe = Probe::new();
    let requests = Arc::new(AtomicUsize::new(0));
    let service = Waiting {
        probe: Arc::clone(&probe),
        requests: Arc::clone(&requests),
    };
    let app = App::serving(db, options, service).await;
    let base = serve(&app).await;
    Served {
        probe,
        requests,
        app,
        base,
    }
}

/// An instance of the service on `db`, served over TCP, with its base URL.
async fn serve(app: &App) -> String {
    format!("http://{}", app.serve().await)
}

/// Starts a request to `path` under `key` without `Prefer`, and returns once its body started
/// (it is then held at the gate).
async fn start_held(
    probe: &Probe,
    base: &str,
    path: &'static str,
    key: &'static str,
) -> JoinHandle<Answer> {
    let before = probe.started();
    let request = spawn_post(base, path, key, None);
    wait_until(&format!("the body of {path} {key} to start"), || async {
        probe.started() == before + 1
    })
    .await;
    request
}

/// Starts a duplicate under `k1` with `Prefer: {prefer}`, and returns once `app` counts it as
/// its one waiting request.
async fn start_waiter(
    app: &App,
    base: &str,
    path: &'static str,
    prefer: &'static str,
) -> JoinHandle<Answer> {
    let waiter = spawn_post(base, path, "k1", Some(prefer));
    wait_until("the duplicate to wait", || async { waiting(app) == 1 }).await;
    waiter
}

/// With the first request ended without a stored outcome (and its body the first of
/// `probe`'s): the waiter runs the handler itself, which answers with a first execution of
/// its own.
async fn assert_the_waiter_runs_the_handler(probe: &Probe, waiter: JoinHandle<Answer>) {
    wait_until("the waiter to run the handler", || async {
        probe.started() == 2
    })
    .await;
    probe.open(1);
    let waiter = waiter.await.expect("the waiter");
    assert_eq!(waiter.status, StatusCode::CREATED, "{}", waiter.body);
    assert!(!waiter.replayed(), "a first execution of its own");
    assert_eq!(waiter.body, "call 2");
}

/// An HTTP reply, read whole.
#[derive(Debug)]
struct Answer {
    status: StatusCode,
    headers: reqwest::header::HeaderMap,
    body: String,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    fn replayed(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }
}

/// POSTs to `path` of `base` as tenant `t1` with `key`, the JSON `body`, and a `Prefer` header
/// when given.
async fn post(base: &str, path: &str, key: &str, body: &str, prefer: Option<&str>) -> Answer {
    post_as("t1", base, path, key, body, prefer).await
}

/// [`post`] as `tenant`.
async fn post_as(
    tenant: &str,
    base: &str,
    path: &str,
    key: &str,
    body: &str,
    prefer: Option<&str>,
) -> Answer {
    let mut request = reqwest::Client::new()
        .post(format!("{base}{path}"))
        .header("authorization", format!("Bearer {tenant}"))
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(body.to_owned());
    if let Some(prefer) = prefer {
        request = request.header("prefer", prefer);
    }
    let response = request.send().await.expect("the service answers");
    let status = response.status();
    let headers = response.headers().clone();
    let body = response.text().await.expect("a body");
    Answer {
        status,
        headers,
        body,
    }
}

/// Starts a request in a task of its own.
fn spawn_post(
    base: &str,
    path: &'static str,
    key: &'static str,
    prefer: Option<&'static str>,
) -> tokio::task::JoinHandle<Answer> {
    let base = base.to_owned();
    tokio::spawn(async move { post(&base, path, key, r#"{"n":1}"#, prefer).await })
}

/// POSTs as [`post`] does, and checks that the request was answered without waiting: it is
/// never counted among `app`'s waiting requests.
async fn at_once(app: &App, base: &str, path: &str, key: &str, body: &str, prefer: &str) -> Answer {
    let request = tokio::spawn({
        let (base, path, key, body, prefer) = (
            base.to_owned(),
            path.to_owned(),
            key.to_owned(),
            body.to_owned(),
            prefer.to_owned(),
        );
        async move { post(&base, &path, &key, &body, Some(&prefer)).await }
    });
    wait_until("the request to be answered, or to wait", || async {
        request.is_finished() || waiting(app) > 0
    })
    .await;
    assert_eq!(
        waiting(app),
        0,
        "{path} {key} with `Prefer: {prefer}` waited"
    );
    request.await.expect("the request")
}

/// How many of `app`'s requests wait for a duplicate in flight.
fn waiting(app: &App) -> usize {
    match app.store() {
        AnyStore::Postgres(store) => store.waiting(),
        AnyStore::Sqlite(store) => store.waiting(),
        AnyStore::MySql(store) => store.waiting(),
    }
}

backend_tests! {
    async fn a_waiting_duplicate_gets_the_first_outcome_as_a_replay_marked_preference_applied(db) {
        let Served { probe, app, base, .. } = served(db, Options::default()).await;
        let first = start_held(&probe, &base, "/wait", "k1").await;
        let waiter = start_waiter(&app, &base, "/wait", "wait=5").await;

        probe.open(1);
        let first = first.await.expect("the first request");
        assert_eq!(first.status, StatusCode::CREATED, "{}", first.body);
        let waiter = waiter.await.expect("the waiter");
        assert_eq!(waiter.status, StatusCode::CREATED, "{}", waiter.body);
        assert!(waiter.replayed(), "the first's outcome, replayed");
        assert_eq!(waiter.body, "call 1");
        assert_eq!(waiter.header("preference-applied"), Some("wait=5"));
        assert_eq!(probe.started(), 1, "the handler ran once");
        assert_eq!(app.count("test_effects").await, 1);
    }

    async fn the_wait_is_the_smaller_of_the_clients_and_the_handlers(db) {
        let Served { probe, app, base, .. } = served(db, Options::default()).await;
        let first = start_held(&probe, &base, "/wait", "k1").await;
        // The handler allows 5 s; the client asks for 60.
        let waiter = start_waiter(&app, &base, "/wait", "respond-async, wait=60").await;
        probe.open(1);
        let waiter = waiter.await.expect("the waiter");
        assert!(waiter.replayed(), "{}: {}", waiter.status, waiter.body);
        assert_eq!(waiter.header("preference-applied"), Some("wait=5"));
        assert_eq!(first.await.expect("first").status, StatusCode::CREATED);
    }

    async fn a_waiter_runs_the_handler_when_the_first_ends_without_a_stored_outcome(db) {
        let Served { probe, app, base, .. } = served(db, Options::default()).await;
        // The first call answers 500, which is not stored; the next ones 201.
        probe.answer_next(500);
        let first = start_held(&probe, &base, "/wait", "k1").await;
        let waiter = start_waiter(&app, &base, "/wait", "wait=5").await;

        probe.open(1);
        let first = first.await.expect("the first request");
        assert_eq!(first.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_the_waiter_runs_the_handler(&probe, waiter).await;
        assert_eq!(app.count("test_effects").await, 1, "only the waiter's write committed");
        assert_eq!(app.key_status("k1").await.as_deref(), Some("completed"));
    }

    async fn a_waiter_gets_409_with_retry_after_when_its_wait_is_over(db) {
        let Served { probe, app: _app, base, .. } = served(db, Options::default()).await;
        let first = start_held(&probe, &base, "/wait", "k1").await;
        let waiter = post(&base, "/wait", "k1", r#"{"n":1}"#, Some("wait=1")).await;
        assert_eq!(waiter.status, StatusCode::CONFLICT, "{}", waiter.body);
        assert!(waiter.header("retry-after").is_some(), "{:?}", waiter.headers);
        assert_eq!(waiter.header("preference-applied"), None, "no outcome to mark");
        assert_eq!(probe.started(), 1, "the first still runs; the waiter did not run it");
        probe.open(1);
        assert_eq!(first.await.expect("first").status, StatusCode::CREATED);
    }

    async fn what_may_not_wait_is_answered_at_once(db) {
        let Served { probe, app, base, .. } = served(db, Options::default()).await;
        let first = start_held(&probe, &base, "/wait", "k1").await;

        // Each of these is answered while the first request still runs (the gate is closed),
        // without waiting.
        let different = at_once(&app, &base, "/wait", "k1", r#"{"n":2}"#, "wait=5").await;
        assert_eq!(different.status, StatusCode::CONFLICT, "another request never waits");
        let long_key = "k".repeat(300);
        let malformed = at_once(&app, &base, "/wait", &long_key, r#"{"n":1}"#, "wait=5").await;
        assert_eq!(malformed.status, StatusCode::BAD_REQUEST, "{}", malformed.body);
        let no_prefer = at_once(&app, &base, "/wait", "k1", r#"{"n":1}"#, "return=minimal").await;
        assert_eq!(no_prefer.status, StatusCode::CONFLICT, "a client that did not ask");
        let zero = at_once(&app, &base, "/wait", "k1", r#"{"n":1}"#, "wait=0").await;
        assert_eq!(zero.status, StatusCode::CONFLICT, "a wait of 0");
        probe.open(1);
        assert_eq!(first.await.expect("first").status, StatusCode::CREATED);
        // Once the first's fingerprint is stored, the other request gets 422.
        let different = post(&base, "/wait", "k1", r#"{"n":2}"#, Some("wait=5")).await;
        assert_eq!(different.status, StatusCode::UNPROCESSABLE_ENTITY);

        // A handler without `wait` answers 409 at once whatever the client prefers.
        let other = start_held(&probe, &base, "/no-wait", "k2").await;
        let unwilling = at_once(&app, &base, "/no-wait", "k2", r#"{"n":1}"#, "wait=5").await;
        assert_eq!(unwilling.status, StatusCode::CONFLICT, "a handler without `wait`");
        probe.open(1);
        assert_eq!(other.await.expect("other").status, StatusCode::CREATED);
    }

    async fn two_hundred_waiters_on_one_key_share_a_pool_of_ten_with_other_requests(db) {
        let options = Options { connections: Some(10), ..Options::default() };
        let Served { probe, app, base, .. } = served(db, options).await;
        // Another tenant's finished key, to replay while the waiters wait.
        probe.open(1);
        let done = post_as("t2", &base, "/no-wait", "done", r#"{"n":1}"#, None).await;
        assert_eq!(done.status, StatusCode::CREATED);

        let first = start_held(&probe, &base, "/wait", "k1").await;
        let waiters: Vec<_> = (0..200)
            .map(|_| spawn_post(&base, "/wait", "k1", Some("wait=10")))
            .collect();
        wait_until("200 duplicates to wait", || async { waiting(&app) == 200 }).await;
        // Another tenant's request is served meanwhile: the waiters hold no pooled connection.
        let replay = post_as("t2", &base, "/no-wait", "done", r#"{"n":1}"#, None).await;
        assert!(replay.replayed(), "{}: {}", replay.status, replay.body);
        assert_eq!(waiting(&app), 200, "the waiters still wait");

        probe.open(1);
        assert_eq!(first.await.expect("first").status, StatusCode::CREATED);
        for waiter in waiters {
            let waiter = waiter.await.expect("a waiter");
            assert_eq!(waiter.status, StatusCode::CREATED, "{}", waiter.body);
            assert!(waiter.replayed());
            assert_eq!(waiter.body, "call 2");
        }
        assert_eq!(probe.started(), 2, "the key's handler ran once");
        assert_eq!(app.count("test_effects").await, 2);
    }

    async fn a_waiter_on_one_instance_gets_the_outcome_completed_on_another(db) {
        let Served { probe, app, base, .. } = served(db, Options::default()).await;
        let other = app.sibling().await;
        let other_base = serve(&other).await;
        let first = start_held(&probe, &base, "/wait", "k1").await;
        // PostgreSQL, MySQL: the other instance looks again now and then, holding no
        // connection. SQLite: it waits inside the database, for the file's write lock.
        let waiter = start_waiter(&other, &other_base, "/wait", "wait=5").await;
        probe.open(1);
        assert_eq!(first.await.expect("first").status, StatusCode::CREATED);
        let waiter = waiter.await.expect("the waiter");
        assert_eq!(waiter.status, StatusCode::CREATED, "{}", waiter.body);
        assert!(waiter.replayed());
        assert_eq!(waiter.body, "call 1");
        assert_eq!(waiter.header("preference-applied"), Some("wait=5"));
        assert_eq!(probe.started(), 1);
    }

    async fn an_external_waiter_gets_the_outcome_stored_under_the_claim(db) {
        let Served { probe, app, base, .. } = served(db, Options::default()).await;
        let first = start_held(&probe, &base, "/wait-external", "k1").await;
        let waiters: Vec<_> = (0..3)
            .map(|_| spawn_post(&base, "/wait-external", "k1", Some("wait=5")))
            .collect();
        wait_until("the duplicates to wait", || async { waiting(&app) == 3 }).await;
        probe.open(1);
        assert_eq!(first.await.expect("first").status, StatusCode::CREATED);
        for waiter in waiters {
            let waiter = waiter.await.expect("a waiter");
            assert!(waiter.replayed(), "{}: {}", waiter.status, waiter.body);
            assert_eq!(waiter.header("preference-applied"), Some("wait=5"));
        }
        assert_eq!(probe.started(), 1);
        // A retry long after is a plain replay.
        let later = post(&base, "/wait-external", "k1", r#"{"n":1}"#, Some("wait=5")).await;
        assert!(later.replayed());
        assert_eq!(later.header("preference-applied"), None, "it did not wait");
    }

    async fn an_external_waiter_runs_the_handler_when_the_first_releases_its_claim(db) {
        let Served { probe, app, base, .. } = served(db, Options::default()).await;
        // The first call answers 500, which is not stored: its claim is released.
        probe.answer_next(500);
        let first = start_held(&probe, &base, "/wait-external", "k1").await;
        let waiter = start_waiter(&app, &base, "/wait-external", "wait=5").await;
        probe.open(1);
        assert_eq!(first.await.expect("first").status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_the_waiter_runs_the_handler(&probe, waiter).await;
        assert_eq!(app.key_status("k1").await.as_deref(), Some("completed"));
    }

    async fn an_external_waiter_gets_409_with_the_leases_retry_after_when_its_wait_is_over(db) {
        let Served { probe, app: _app, base, .. } = served(db, Options::default()).await;
        let first = start_held(&probe, &base, "/wait-external", "k1").await;
        let waiter = post(&base, "/wait-external", "k1", r#"{"n":1}"#, Some("wait=1")).await;
        assert_eq!(waiter.status, StatusCode::CONFLICT, "{}", waiter.body);
        let after: u64 = waiter
            .header("retry-after")
            .expect("Retry-After")
            .parse()
            .expect("seconds");
        assert!(after > 1 && after <= 30, "the lease's remaining time: {after}");
        assert_eq!(probe.started(), 1);
        probe.open(1);
        assert_eq!(first.await.expect("first").status, StatusCode::CREATED);
    }

    async fn a_client_that_prefers_to_wait_gets_the_first_outcome_without_a_retry(db) {
        let Served { probe, requests, app, base } = served(db, Options::default()).await;
        let first = start_held(&probe, &base, "/wait", "k1").await;
        // One attempt only: a 201 can only come from the server's waiting.
        let policy = RetryPolicy::default()
            .with_max_attempts(1)
            .with_prefer_wait(Duration::from_secs(5));
        let sent = tokio::spawn(client_post(policy, format!("{base}/wait"), "k1"));
        wait_until("the client's request to wait", || async { waiting(&app) == 1 }).await;
        probe.open(1);
        let (status, replayed, applied) = sent.await.expect("the client");
        assert_eq!(status, StatusCode::CREATED);
        assert!(replayed);
        assert_eq!(applied.as_deref(), Some("wait=5"));
        assert_eq!(first.await.expect("first").status, StatusCode::CREATED);
        assert_eq!(requests.load(Ordering::SeqCst), 2, "no retry was sent");
    }

    async fn a_client_that_prefers_to_wait_still_retries_a_409_from_a_handler_that_does_not(db) {
        let Served { probe, requests, app, base } = served(db, Options::default()).await;
        let first = start_held(&probe, &base, "/no-wait", "k1").await;
        let policy = RetryPolicy::default()
            .with_max_attempts(20)
            .with_backoff(Duration::from_millis(10), Duration::from_millis(200))
            .with_prefer_wait(Duration::from_secs(5));
        let sent = tokio::spawn(client_post(policy, format!("{base}/no-wait"), "k1"));
        // The first request, and the client's first attempt, answered 409 at once.
        wait_until("the client's first attempt", || async {
            requests.load(Ordering::SeqCst) >= 2
        })
        .await;
        assert_eq!(waiting(&app), 0, "the handler does not let duplicates wait");
        probe.open(1);
        let (status, replayed, applied) = sent.await.expect("the client");
        assert_eq!(status, StatusCode::CREATED);
        assert!(replayed, "the retry got the first outcome");
        assert_eq!(applied, None);
        assert_eq!(first.await.expect("first").status, StatusCode::CREATED);
        assert!(requests.load(Ordering::SeqCst) >= 3, "the client retried");
    }
}

/// Sends `POST url` with `key` through idem's client with `policy`: the status, whether it
/// was a replay, and its `Preference-Applied`.
async fn client_post(
    policy: RetryPolicy,
    url: String,
    key: &str,
) -> (StatusCode, bool, Option<String>) {
    let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
        .with(IdempotentRetry::new(policy))
        .build();
    let response = client
        .post(url)
        .header("authorization", "Bearer t1")
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(r#"{"n":1}"#)
        .send()
        .await
        .expect("an answer");
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    (
        response.status(),
        header("idempotent-replayed").as_deref() == Some("true"),
        header("preference-applied"),
    )
}
