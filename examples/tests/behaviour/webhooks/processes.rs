//! The webhook receiver over real `payments` processes on one database, as behind a load
//! balancer: the same delivery sent to two processes at once credits once per `webhook-id`,
//! and while one process runs an id the other answers 409 with `Retry-After` (SQLite: it waits
//! for the file's write lock, and then one of the two applies the credit and the other replays
//! it); a delivery whose process was SIGKILLed in flight runs again when redelivered to a new
//! process and credits once (PostgreSQL, MySQL: its claim died with its transaction; SQLite:
//! the claim, waiting for the write lock, never reached the file, and the key's hold died with
//! the process); a tenant can neither authenticate as the webhook scope nor, with an
//! `Idempotency-Key` equal to a delivery's id, keep that delivery from crediting; and forged
//! deliveries sent beside genuine ones under the same ids are all refused, store nothing and
//! leave each genuine id to credit once.

use std::sync::Mutex;

use axum::http::HeaderValue;
use reqwest::{Client, Response, StatusCode};
use serde_json::{Value, json};
use tokio::task::JoinHandle;

use super::{
    Blocker, TOLERANCE_SECS, Webhook, balance, credit, is_problem, now, service, signature,
};
use crate::support::{Database, on_every_database, wait_until};
use idem_examples::{webhook_secret::DEFAULT_SECRET, webhooks::SCOPE};

on_every_database!(
    concurrent_redeliveries_over_two_processes_credit_each_id_once,
    an_id_held_in_one_process_is_409_in_the_other_and_on_sqlite_waits_then_replays,
    a_delivery_sigkilled_in_flight_runs_when_redelivered_to_a_new_process_and_credits_once,
    a_tenant_cannot_authenticate_as_the_webhook_scope_nor_take_a_deliverys_id,
    forged_deliveries_beside_genuine_ones_are_401_store_nothing_and_each_genuine_id_credits_once,
);

/// What the receiver answered one attempt, read whole.
#[derive(Debug, Clone)]
struct Answer {
    status: StatusCode,
    replayed: bool,
    retry_after: Option<String>,
    problem: bool,
    body: String,
}

impl Answer {
    async fn of(response: Response) -> Self {
        let status = response.status();
        let replayed = match response.headers().get("idempotent-replayed") {
            Some(value) => {
                assert_eq!(value, "true", "Idempotent-Replayed is only ever `true`");
                true
            }
            None => false,
        };
        let retry_after = response
            .headers()
            .get("retry-after")
            .map(|value| value.to_str().expect("Retry-After is text").to_owned());
        let problem = is_problem(&response);
        let body = response.text().await.expect("a body");
        Self {
            status,
            replayed,
            retry_after,
            problem,
            body,
        }
    }

    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {self:?}"))
    }

    /// An answer a sender retries: 409 while another delivery of the id runs, or 503 when the
    /// store did not answer in time; a problem with `Retry-After`, nothing applied.
    fn assert_retryable(&self, what: &str) {
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            assert!(self.problem, "{what}: a problem: {self:?}");
            assert!(
                self.retry_after.is_some(),
                "{what}: a 503 without Retry-After: {self:?}"
            );
        } else {
            self.assert_in_progress(what);
        }
    }

    /// A delivery refused while another of its id runs: 409, problem+json, `Retry-After` in
    /// whole seconds, at least 1.
    fn assert_in_progress(&self, what: &str) {
        assert_eq!(self.status, StatusCode::CONFLICT, "{what}: {self:?}");
        assert!(self.problem, "{what}: a problem: {self:?}");
        let secs: u64 = self
            .retry_after
            .as_deref()
            .unwrap_or_else(|| panic!("{what}: a 409 without Retry-After: {self:?}"))
            .parse()
            .unwrap_or_else(|e| panic!("{what}: Retry-After in seconds ({e}): {self:?}"));
        assert!(secs >= 1, "{what}: Retry-After {secs}");
    }

    /// The delivery's credit, applied by this attempt (not a replay).
    fn assert_applied(&self, amount: i64, what: &str) {
        assert_eq!(self.status, StatusCode::OK, "{what}: {self:?}");
        assert!(!self.replayed, "{what}: applied, not replayed: {self:?}");
        assert_eq!(self.json(), json!({"credited": amount}), "{what}");
    }

    /// The delivery's credit, replayed.
    fn assert_replayed(&self, amount: i64, what: &str) {
        assert_eq!(self.status, StatusCode::OK, "{what}: {self:?}");
        assert!(self.replayed, "{what}: replayed: {self:?}");
        assert_eq!(self.json(), json!({"credited": amount}), "{what}");
    }
}

/// `body` delivered as `id` to the service at `base`, signed now.
async fn deliver(client: &Client, base: &str, id: &str, body: &str) -> Answer {
    Answer::of(
        Webhook::signed(id, body.to_owned())
            .send(client, base)
            .await,
    )
    .await
}

/// `body` delivered as `id` to the process at `base`, sent again while it is answered with
/// what a sender retries after `Retry-After` (409: another delivery of the id runs; 503: the
/// store did not answer in time, as under a pooler with every connection busy), until it is
/// answered otherwise; every answer, in order.
async fn deliver_until_settled(client: &Client, base: &str, id: &str, body: &str) -> Vec<Answer> {
    let answers = Mutex::new(Vec::new());
    wait_until(
        &format!("delivery {id} to {base} to be answered other than 409 or 503"),
        || async {
            let answer = deliver(client, base, id, body).await;
            let done =
                ![StatusCode::CONFLICT, StatusCode::SERVICE_UNAVAILABLE].contains(&answer.status);
            answers.lock().unwrap().push(answer);
            done
        },
    )
    .await;
    answers.into_inner().unwrap()
}

/// A delivery sent in a task of its own; `Err` when the service died before it answered.
type InFlight = JoinHandle<reqwest::Result<Response>>;

fn spawn_delivery(client: &Client, base: &str, id: &str, body: &str) -> InFlight {
    let (client, base, id, body) = (
        client.clone(),
        base.to_owned(),
        id.to_owned(),
        body.to_owned(),
    );
    tokio::spawn(async move { Webhook::signed(&id, body).try_send(&client, &base).await })
}

/// The test's lock held ([`Blocker`]) and `body` delivered as `id` to the process at `base`,
/// returned once that delivery certainly holds its key there and waits on the lock.
///
/// On PostgreSQL and MySQL the delivery has claimed its key in its transaction and waits in
/// its `INSERT INTO balance_credits`, as the database shows. On SQLite its claim waits for the
/// file's write lock, which the test holds, so the claim is not yet in the file: the key is
/// held in that process only, as a twin sent with it shows (the twin is answered 409 from the
/// process's own registry, whichever of the two came first).
async fn hold_in_flight(
    database: &Database,
    client: &Client,
    base: &str,
    id: &str,
    body: &str,
) -> (Blocker, InFlight) {
    let blocker = Blocker::hold(database).await;
    match database {
        Database::Postgres { .. } | Database::MySql { .. } => {
            let held = spawn_delivery(client, base, id, body);
            wait_until("the delivery's credit to wait for the table lock", || {
                database.waits_for_a_lock_on("balance_credits")
            })
            .await;
            (blocker, held)
        }
        Database::Sqlite { .. } => (blocker, hold_twin(client, base, id, body).await),
    }
}

/// The answer of a delivery sent with [`spawn_delivery`], which must have been answered.
async fn answered(delivery: InFlight) -> Answer {
    Answer::of(delivery.await.unwrap().expect("the service answers")).await
}

const IDS: usize = 4;
/// Sends of each id, split across the two processes.
const SENDS: usize = 20;

/// The id, tenant and amount of the `i`th delivery of a test: a tenant each, so that each
/// balance counts one id's credits.
fn nth(i: usize) -> (String, String, i64) {
    let n = i64::try_from(i).expect("a small index");
    (format!("msg_{i}"), format!("t{i}"), 100 * (n + 1))
}

async fn concurrent_redeliveries_over_two_processes_credit_each_id_once(database: Database) {
    let client = Client::new();
    let (_a, a) = service(&client, &database).await;
    let (_b, b) = service(&client, &database).await;
    let bases = [a, b];

    // SENDS sends of each of IDS ids, all at once, alternating between the two processes; a
    // send answered 409 is sent again until it is answered otherwise, as a sender would.
    let mut sends = Vec::new();
    for round in 0..SENDS {
        for i in 0..IDS {
            let (id, tenant, amount) = nth(i);
            let (client, base) = (client.clone(), bases[(round + i) % 2].clone());
            sends.push((
                i,
                tokio::spawn(async move {
                    deliver_until_settled(&client, &base, &id, &credit(&tenant, amount)).await
                }),
            ));
        }
    }
    let mut applied = [0; IDS];
    let mut refused = 0;
    for (i, send) in sends {
        let (_, _, amount) = nth(i);
        let answers = send.await.unwrap();
        let (last, before) = answers.split_last().expect("one answer at least");
        for answer in before {
            answer.assert_retryable("a delivery while another of its id runs");
            refused += 1;
        }
        assert_eq!(last.status, StatusCode::OK, "{last:?}");
        assert_eq!(last.json(), json!({"credited": amount}), "{last:?}");
        if !last.replayed {
            applied[i] += 1;
        }
    }
    assert_eq!(
        applied, [1; IDS],
        "each id applied by one delivery and replayed to every other ({refused} answers were 409 or 503)"
    );
    for base in &bases {
        for i in 0..IDS {
            let (_, tenant, amount) = nth(i);
            assert_eq!(
                balance(&client, base, &tenant).await,
                (amount, 1),
                "{tenant}, credited once, as {base} sees it"
            );
        }
    }
    let ids = i64::try_from(IDS).unwrap();
    assert_eq!(database.count("balance_credits").await, ids);
    assert_eq!(database.count("idem_keys").await, ids);
}

async fn an_id_held_in_one_process_is_409_in_the_other_and_on_sqlite_waits_then_replays(
    database: Database,
) {
    let client = Client::new();
    let (_a, a) = service(&client, &database).await;
    let (_b, b) = service(&client, &database).await;
    let body = credit("t1", 700);
    let (blocker, held) = hold_in_flight(&database, &client, &a, "msg_1", &body).await;

    if let Database::Sqlite { .. } = database {
        // SQLite has one writer: A's claim, and B's, wait for the write lock, so B cannot see
        // the key taken and answer 409. B's delivery waits for its turn (held in B's own
        // registry, as its twin's 409 shows), then finds the id delivered and replays it, or
        // runs first and A's replays: one of the two applies the credit, never both, and
        // neither is a 409.
        let waiting = hold_twin(&client, &b, "msg_1", &body).await;
        assert!(
            !held.is_finished(),
            "A's delivery waits for the test's lock"
        );
        assert!(
            !waiting.is_finished(),
            "B's delivery waits for the write lock"
        );
        blocker.release().await;
        let answers = [answered(held).await, answered(waiting).await];
        for answer in &answers {
            assert_eq!(answer.status, StatusCode::OK, "{answer:?}");
            assert_eq!(answer.json(), json!({"credited": 700}), "{answer:?}");
        }
        assert_eq!(
            answers.iter().filter(|answer| !answer.replayed).count(),
            1,
            "one of A's and B's deliveries applied the credit, the other replayed it: {answers:?}"
        );
    } else {
        // A's transaction holds the claim: B is refused at once, every time, without waiting.
        for attempt in 1..=3 {
            deliver(&client, &b, "msg_1", &body)
                .await
                .assert_in_progress(&format!("B, attempt {attempt}, while A runs the id"));
        }
        assert!(
            !held.is_finished(),
            "A's delivery is still held by the test"
        );
        blocker.release().await;
        answered(held)
            .await
            .assert_applied(700, "A's delivery, let go");
        deliver(&client, &b, "msg_1", &body)
            .await
            .assert_replayed(700, "B's redelivery once A's is done");
    }
    assert_eq!(balance(&client, &a, "t1").await, (700, 1));
    assert_eq!(balance(&client, &b, "t1").await, (700, 1));
}

/// Two deliveries of `id` sent to `base` at once: one of them is answered 409 by the process's
/// own registry of held keys; the other, returned, holds the key in that process and waits.
async fn hold_twin(client: &Client, base: &str, id: &str, body: &str) -> InFlight {
    let twins = [
        spawn_delivery(client, base, id, body),
        spawn_delivery(client, base, id, body),
    ];
    wait_until("one of two twin deliveries to be answered", || {
        std::future::ready(twins.iter().any(JoinHandle::is_finished))
    })
    .await;
    let [one, other] = twins;
    let (refused, waiting) = if one.is_finished() {
        (one, other)
    } else {
        (other, one)
    };
    answered(refused)
        .await
        .assert_in_progress("the twin of a delivery waiting in the same process");
    waiting
}

async fn a_delivery_sigkilled_in_flight_runs_when_redelivered_to_a_new_process_and_credits_once(
    database: Database,
) {
    let client = Client::new();
    let (mut a, base_a) = service(&client, &database).await;
    let body = credit("t1", 800);
    let (blocker, held) = hold_in_flight(&database, &client, &base_a, "msg_1", &body).await;

    a.0.kill().expect("SIGKILL");
    a.0.wait().expect("reap");
    assert!(
        held.await.unwrap().is_err(),
        "the sender saw the connection die"
    );
    // The server rolls the dead process's transaction back, and its claim with it, once it
    // sees the connection gone (PostgreSQL and MySQL: when the statement waiting on the lock
    // ends); the lock is let go for that. On SQLite the claim never reached the file.
    blocker.release().await;

    let (_c, base_c) = service(&client, &database).await;
    let answers = deliver_until_settled(&client, &base_c, "msg_1", &body).await;
    let (last, before) = answers.split_last().expect("one answer at least");
    for answer in before {
        answer.assert_retryable("the redelivery while the dead process's transaction lasts");
    }
    last.assert_applied(800, "the redelivery to the new process");
    assert_eq!(balance(&client, &base_c, "t1").await, (800, 1));
    assert_eq!(database.count("balance_credits").await, 1);
    assert_eq!(database.key_status("msg_1").await, "completed");

    deliver(&client, &base_c, "msg_1", &body)
        .await
        .assert_replayed(800, "a redelivery after it");
    assert_eq!(balance(&client, &base_c, "t1").await, (800, 1));
}

/// `POST /v1/payments` by `authorization` under `key`.
async fn pay(client: &Client, base: &str, authorization: HeaderValue, key: &str) -> Response {
    client
        .post(format!("{base}/v1/payments"))
        .header("authorization", authorization)
        .header("Idempotency-Key", key)
        .json(&json!({"amount": 4200, "currency": "usd", "customer": "cus_1"}))
        .send()
        .await
        .expect("the service answers")
}

fn bearer(token: &str) -> HeaderValue {
    HeaderValue::from_bytes(format!("Bearer {token}").as_bytes()).expect("a header value")
}

async fn a_tenant_cannot_authenticate_as_the_webhook_scope_nor_take_a_deliverys_id(
    database: Database,
) {
    let client = Client::new();
    let (_service, base) = service(&client, &database).await;

    // The webhook scope as a bearer token (UTF-8 bytes on the wire): refused before anything.
    let refused = pay(&client, &base, bearer(SCOPE), "msg_1").await;
    assert_eq!(refused.status(), StatusCode::UNAUTHORIZED);
    assert!(is_problem(&refused));
    let refused = client
        .get(format!("{base}/v1/balance"))
        .header("authorization", bearer(SCOPE))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(database.count("idem_keys").await, 0, "nothing stored");

    // Tenants' payments under a delivery's id, before it (one tenant named as the scope but
    // for its `§`): each is a payment of its own, and the delivery still credits.
    for tenant in ["t1", SCOPE.trim_start_matches('§')] {
        let paid = pay(&client, &base, bearer(tenant), "msg_1").await;
        assert_eq!(paid.status(), StatusCode::CREATED, "{tenant}");
    }
    let body = credit("t1", 600);
    deliver(&client, &base, "msg_1", &body)
        .await
        .assert_applied(600, "the delivery after tenants used its id");
    deliver(&client, &base, "msg_1", &body)
        .await
        .assert_replayed(600, "its redelivery");

    // A delivery first, then a tenant's payment under its id: a payment of its own, not the
    // delivery's answer nor a 422; the delivery is still replayed.
    let body_2 = credit("t1", 50);
    deliver(&client, &base, "msg_2", &body_2)
        .await
        .assert_applied(50, "the second delivery");
    let paid = pay(&client, &base, bearer("t1"), "msg_2").await;
    assert_eq!(paid.status(), StatusCode::CREATED);
    assert!(paid.headers().get("idempotent-replayed").is_none());
    deliver(&client, &base, "msg_2", &body_2)
        .await
        .assert_replayed(50, "the second delivery's redelivery");

    assert_eq!(balance(&client, &base, "t1").await, (650, 2));
    assert_eq!(database.count("balance_credits").await, 2);
}

/// The ways a delivery is forged, with what it sends.
const FORGERIES: [&str; 5] = [
    "another secret",
    "a signature over another body",
    "a stale timestamp",
    "a timestamp ahead",
    "another body, signed with another secret",
];

/// A forged delivery of `id`, crediting `tenant` with `amount`, forged as `how` (one of
/// [`FORGERIES`]).
fn forged<'a>(id: &'a str, tenant: &str, amount: i64, how: &str) -> Webhook<'a> {
    let other_secret = "whsec_b3RoZXItc2VjcmV0";
    let body = credit(tenant, amount);
    let (timestamp, signature, body) = match how {
        "another secret" => (now(), signature(other_secret, id, now(), &body), body),
        "a signature over another body" => (
            now(),
            signature(DEFAULT_SECRET, id, now(), &credit(tenant, 1)),
            body,
        ),
        "a stale timestamp" => {
            let stale = now() - TOLERANCE_SECS - 60;
            (stale, signature(DEFAULT_SECRET, id, stale, &body), body)
        }
        "a timestamp ahead" => {
            let ahead = now() + TOLERANCE_SECS + 60;
            (ahead, signature(DEFAULT_SECRET, id, ahead, &body), body)
        }
        _ => {
            let more = credit(tenant, 1_000_000);
            (now(), signature(other_secret, id, now(), &more), more)
        }
    };
    Webhook {
        id: Some(id),
        timestamp: Some(timestamp),
        signature: Some(signature),
        body,
    }
}

/// A delivery of the `i`th id sent in a task of its own: forged as `forgery` (one of
/// [`FORGERIES`]), or genuine.
struct Sending {
    i: usize,
    forgery: Option<&'static str>,
    answer: JoinHandle<Answer>,
}

impl Sending {
    fn start(client: &Client, base: &str, i: usize, forgery: Option<&'static str>) -> Self {
        let (id, tenant, amount) = nth(i);
        let (client, base) = (client.clone(), base.to_owned());
        let answer = tokio::spawn(async move {
            let webhook = match forgery {
                Some(how) => forged(&id, &tenant, amount, how),
                None => Webhook::signed(&id, credit(&tenant, amount)),
            };
            Answer::of(webhook.send(&client, &base).await).await
        });
        Self { i, forgery, answer }
    }

    /// Asserts its answer: 401 problem+json when forged, the credit applied when genuine.
    async fn assert_answered(self) {
        let (id, _, amount) = nth(self.i);
        let answer = self.answer.await.unwrap();
        match self.forgery {
            Some(how) => {
                assert_eq!(
                    answer.status,
                    StatusCode::UNAUTHORIZED,
                    "{id}, forged with {how}: {answer:?}"
                );
                assert!(answer.problem, "{id}, forged with {how}: {answer:?}");
            }
            None => answer.assert_applied(amount, &format!("{id}, genuine")),
        }
    }
}

/// The way the `i`th id is forged in the `round`th wave: each wave another way.
fn forgery(i: usize, round: usize) -> Option<&'static str> {
    Some(FORGERIES[(i + round) % FORGERIES.len()])
}

const FORGED_IDS: usize = 10;

async fn forged_deliveries_beside_genuine_ones_are_401_store_nothing_and_each_genuine_id_credits_once(
    database: Database,
) {
    let client = Client::new();
    let (_service, base) = service(&client, &database).await;

    // First, a forged delivery of each id alone, all at once: each the first its id sees.
    let first: Vec<_> = (0..FORGED_IDS)
        .map(|i| Sending::start(&client, &base, i, forgery(i, 0)))
        .collect();
    for sending in first {
        sending.assert_answered().await;
    }
    assert_eq!(
        database.count("idem_keys").await,
        0,
        "the forged deliveries stored nothing"
    );

    // Then, all at once, a forged and a genuine delivery of each id, the forged one sent first
    // for even ids and second for odd ones.
    let mut wave = Vec::new();
    for i in 0..FORGED_IDS {
        let mut pair = [forgery(i, 1), None];
        if i % 2 == 1 {
            pair.reverse();
        }
        wave.extend(pair.map(|forgery| Sending::start(&client, &base, i, forgery)));
    }
    for sending in wave {
        sending.assert_answered().await;
    }

    for i in 0..FORGED_IDS {
        let (id, tenant, amount) = nth(i);
        assert_eq!(
            balance(&client, &base, &tenant).await,
            (amount, 1),
            "{id}: credited once, by its genuine delivery"
        );
        deliver(&client, &base, &id, &credit(&tenant, amount))
            .await
            .assert_replayed(amount, &format!("{id}, redelivered"));
    }
    let ids = i64::try_from(FORGED_IDS).unwrap();
    assert_eq!(
        database.count("idem_keys").await,
        ids,
        "only genuine ids stored"
    );
    assert_eq!(database.count("balance_credits").await, ids);
}
