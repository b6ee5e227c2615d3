//! The relay and the consumers against a database that stops answering (a partition: packets
//! held, connections open, nothing refused), with `database_timeout` short: a relay's pass and a
//! consumer's message end in `Error::TimedOut` within the timeout instead of waiting as long as
//! the partition, and once the database answers again every event is published and applied
//! exactly once.
//!
//! PostgreSQL is put behind a [`PartitionProxy`] that freezes at a cue (a statement, a `COMMIT`)
//! and holds the bytes until the test heals it; the tests' own reads go to the database directly.
//! A spawned relay and consumer are checked the same way: they warn of the outage, retry, and
//! carry on after the heal. Each test runs on both brokers, as `<broker>::<name>`. Every test
//! has a deadline of [`TEST_DEADLINE`], and every frozen operation must end within
//! [`DATABASE_TIMEOUT`] and a generous [`MARGIN`].

use std::{
    collections::HashMap,
    future::Future,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use idem_events::{
    self as events, CancellationToken, ConsumeError, ConsumerOptions, Delivery, EventHandler,
    Message, Processed, Publisher, Relay, RelayError, RelayOptions, Subscriber, Subscription,
};
use idem_tests::{
    AnyDelivery, AnySubscription, Cue, EventBackend, PartitionProxy, TestBackend, TestBroker,
    wait_within,
};
use serde_json::json;
use sqlx::{
    PgPool, Postgres, Transaction,
    postgres::{PgConnectOptions, PgPoolOptions, PgSslMode},
};
use tokio::time::Instant;

/// The relay's and the consumers' database timeout here.
const DATABASE_TIMEOUT: Duration = Duration::from_secs(1);

/// How late past [`DATABASE_TIMEOUT`] a frozen operation may end on a loaded machine.
const MARGIN: Duration = Duration::from_secs(10);

/// How long a whole test may take: only a hang reaches it.
const TEST_DEADLINE: Duration = Duration::from_secs(45);

/// How long a test waits for a delivery, or for the relay to publish after the heal: far
/// longer than either takes, shorter than [`TEST_DEADLINE`] so that what never came is named.
const WAIT_DEADLINE: Duration = Duration::from_secs(20);

const CONSUMER: &str = "ledger";

const TOPIC: &str = "payment.succeeded";

/// The relay's query of a topic's waiting events (the batch), as the proxy sees it prepared.
const BATCH_QUERY: &str = "SELECT id, event_id, payload FROM idem_outbox";

/// The relay's statement that marks a batch published.
const MARK_PUBLISHED: &str = "UPDATE idem_outbox SET published_at";

/// What the spawned relay warns of when its database stops answering.
const RELAY_OUTAGE: &str = "the outbox relay cannot publish";

/// What the spawned consumer warns of when its database stops answering.
const CONSUMER_OUTAGE: &str = "the consumer cannot go on";

/// The events not published yet.
const UNPUBLISHED: &str = "SELECT COUNT(*) FROM idem_outbox WHERE published_at IS NULL";

/// Runs a test's body within [`TEST_DEADLINE`].
async fn within_test_deadline(body: impl Future<Output = ()>) {
    tokio::time::timeout(TEST_DEADLINE, body)
        .await
        .unwrap_or_else(|_| panic!("the test did not end within {TEST_DEADLINE:?}"));
}

/// `operation`'s outcome, which must come within the database timeout and the margin.
async fn bounded<T>(what: &str, operation: impl Future<Output = T>) -> T {
    tokio::time::timeout(DATABASE_TIMEOUT + MARGIN, operation)
        .await
        .unwrap_or_else(|_| {
            panic!(
                "{what} did not end within the database timeout ({DATABASE_TIMEOUT:?}) \
                 and {MARGIN:?}"
            )
        })
}

/// The tests' handler: records each message in `test_applied` (no unique constraint: a message
/// applied twice shows as two rows) and counts its calls.
#[derive(Default, Clone)]
struct Recorder {
    calls: Arc<AtomicUsize>,
}

impl EventHandler<Postgres> for Recorder {
    type Error = String;

    async fn handle(
        &self,
        message: &Message,
        tx: &mut Transaction<'static, Postgres>,
    ) -> Result<(), String> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        <Postgres as EventBackend>::apply(tx, message)
            .await
            .map_err(|error| error.to_string())
    }
}

/// The test's database, reached directly, with the event tables and `test_applied`.
async fn direct_pool(connect: &PgConnectOptions) -> PgPool {
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect_with(connect.clone())
        .await
        .expect("connect to the test database");
    <Postgres as EventBackend>::prepare_events(&pool).await;
    pool
}

/// A proxy in front of the test's database, and a pool whose connections go through it.
async fn partitioned_pool(connect: &PgConnectOptions) -> (PartitionProxy, PgPool) {
    let upstream = format!("{}:{}", connect.get_host(), connect.get_port());
    let proxy = PartitionProxy::postgres(upstream).await;
    let through_proxy = connect
        .clone()
        .host("127.0.0.1")
        .port(proxy.port())
        .ssl_mode(PgSslMode::Disable);
    let pool = PgPoolOptions::new()
        .max_connections(8)
        .connect_with(through_proxy)
        .await
        .expect("connect through the proxy");
    (proxy, pool)
}

/// The one integer `sql` selects, on the direct pool.
async fn count(pool: &PgPool, sql: &str) -> i64 {
    <Postgres as TestBackend>::count(pool, sql).await
}

/// How many times each message id was applied (rows of `test_applied`).
async fn applications(pool: &PgPool) -> HashMap<String, usize> {
    let mut applied = HashMap::new();
    for id in <Postgres as EventBackend>::applied(pool).await {
        *applied.entry(id).or_default() += 1;
    }
    applied
}

/// How many records of `id` the consumer has in `idem_consumed`.
async fn records(pool: &PgPool, id: &str) -> i64 {
    count(
        pool,
        &format!(
            "SELECT COUNT(*) FROM idem_consumed \
             WHERE consumer = '{CONSUMER}' AND message_id = '{id}'"
        ),
    )
    .await
}

/// The next delivery, or a failure that says what the test was waiting for.
async fn next(subscription: &mut AnySubscription, waiting_for: &str) -> AnyDelivery {
    tokio::time::timeout(WAIT_DEADLINE, subscription.next())
        .await
        .unwrap_or_else(|_| {
            panic!("no message within {WAIT_DEADLINE:?} while waiting for {waiting_for}")
        })
        .expect("the subscription broke")
}

/// Enqueues one event in a transaction of its own and commits; returns its id.
async fn enqueue_committed(pool: &PgPool, seq: usize) -> String {
    let mut tx = pool.begin().await.expect("begin");
    let id = events::enqueue(&mut tx, TOPIC, &json!({ "seq": seq }))
        .await
        .expect("enqueue");
    tx.commit().await.expect("commit");
    id.to_string()
}

/// Asserts that `error` is the database timeout.
fn assert_timed_out(error: &events::Error, what: &str) {
    assert!(
        matches!(error, events::Error::TimedOut { after } if *after == DATABASE_TIMEOUT),
        "{what}: expected the database timeout, got {error}"
    );
}

/// A relay whose database freezes at `cue`'s statement: its pass fails with `TimedOut` within
/// the timeout, the events still wait; after the heal the relay publishes every one, and the
/// consumer applies each exactly once, the copies published again (`copies` of each in all)
/// dropped as duplicates.
async fn a_relay_frozen_at(
    connect: PgConnectOptions,
    broker: TestBroker,
    statement: &str,
    confirmed_before_the_freeze: usize,
    copies: usize,
) {
    let direct = direct_pool(&connect).await;
    broker.declare(CONSUMER).await;
    let mut enqueued = Vec::new();
    for seq in 0..3 {
        enqueued.push(enqueue_committed(&direct, seq).await);
    }
    let (proxy, pool) = partitioned_pool(&connect).await;
    let confirmed = Arc::new(AtomicUsize::new(0));
    let mut relay = Relay::new(
        pool,
        broker.publisher(),
        RelayOptions::default()
            .with_database_timeout(DATABASE_TIMEOUT)
            .with_max_backoff(Duration::from_millis(200)),
    )
    .on_confirmed({
        let confirmed = Arc::clone(&confirmed);
        move |batch| {
            confirmed.fetch_add(batch.len(), Ordering::SeqCst);
        }
    });

    proxy.freeze_at(Cue::statement(statement));
    let failed = bounded("the frozen relay's pass", relay.pass()).await;
    match failed {
        Err(RelayError::Database(error)) => assert_timed_out(&error, "the frozen pass"),
        other => panic!("the frozen pass: expected the database timeout, got {other:?}"),
    }
    assert_eq!(proxy.cued(), 1, "the freeze began at {statement:?}");
    assert!(
        proxy.is_frozen(),
        "the pass ended while the database was away"
    );
    assert_eq!(
        confirmed.load(Ordering::SeqCst),
        confirmed_before_the_freeze,
        "events the broker confirmed before the freeze"
    );
    assert_eq!(
        count(&direct, UNPUBLISHED).await,
        3,
        "the events still wait in the outbox"
    );

    proxy.heal();
    // The topic may stay locked until the abandoned transaction's rollback lands: the relay
    // passes it over meanwhile, and publishes it on a later pass.
    let deadline = Instant::now() + WAIT_DEADLINE;
    while count(&direct, UNPUBLISHED).await > 0 {
        assert!(
            Instant::now() < deadline,
            "the relay did not publish every event within {WAIT_DEADLINE:?} of the heal"
        );
        if let Err(error) = bounded("a pass after the heal", relay.drain()).await {
            tracing::debug!(%error, "a pass after the heal failed");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        confirmed.load(Ordering::SeqCst),
        3 * copies,
        "events the broker confirmed in all"
    );

    let recorder = Recorder::default();
    let consumer = events::Consumer::new(
        direct.clone(),
        recorder.clone(),
        ConsumerOptions::new(CONSUMER),
    );
    let mut subscription = broker
        .subscriber(CONSUMER)
        .subscribe()
        .await
        .expect("subscribe");
    let mut outcomes: HashMap<String, Vec<Processed>> = HashMap::new();
    for n in 0..3 * copies {
        let delivery = next(
            &mut subscription,
            &format!("delivery {n} of {}", 3 * copies),
        )
        .await;
        let id = delivery.message().id().to_owned();
        let processed = consumer.process(delivery).await.expect("process");
        outcomes.entry(id).or_default().push(processed);
    }
    let mut once = vec![Processed::Applied];
    once.resize(copies, Processed::Duplicate);
    for id in &enqueued {
        assert_eq!(
            outcomes.get(id),
            Some(&once),
            "event {id}: applied once, its other copies dropped as duplicates"
        );
    }
    let applied = applications(&direct).await;
    assert_eq!(applied.len(), 3, "only the enqueued events: {applied:?}");
    for id in &enqueued {
        assert_eq!(applied.get(id), Some(&1), "event {id} applied once");
    }
    assert_eq!(
        recorder.calls.load(Ordering::SeqCst),
        3,
        "the handler ran once per event"
    );
}

async fn a_relay_frozen_at_its_batch_query_times_out_and_after_the_heal_publishes_every_event(
    connect: PgConnectOptions,
    broker: TestBroker,
) {
    within_test_deadline(a_relay_frozen_at(connect, broker, BATCH_QUERY, 0, 1)).await;
}

async fn a_relay_frozen_before_marking_a_published_batch_times_out_and_its_copies_apply_once(
    connect: PgConnectOptions,
    broker: TestBroker,
) {
    within_test_deadline(a_relay_frozen_at(connect, broker, MARK_PUBLISHED, 3, 2)).await;
}

/// How a consumer's database freezes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ConsumerFreeze {
    /// At the handler's statement, in the message's transaction: nothing commits.
    InTheHandler,
    /// With the `COMMIT` forwarded and its answer held: it commits, the consumer cannot know.
    AfterTheCommit,
}

/// A consumer whose database freezes as `freeze` says: the message is given back to the broker
/// within the timeout; after the heal its redelivery is applied (or, its `COMMIT` having
/// committed, recognised as a duplicate): one record and one row of the handler's.
async fn a_consumer_frozen(connect: PgConnectOptions, broker: TestBroker, freeze: ConsumerFreeze) {
    let direct = direct_pool(&connect).await;
    broker.declare(CONSUMER).await;
    let message = Message::new("evt-1", TOPIC, r#"{"amount":5}"#);
    broker
        .publisher()
        .publish(std::slice::from_ref(&message))
        .await
        .expect("publish");
    let (proxy, pool) = partitioned_pool(&connect).await;
    let recorder = Recorder::default();
    let consumer = events::Consumer::new(
        pool,
        recorder.clone(),
        ConsumerOptions::new(CONSUMER).with_database_timeout(DATABASE_TIMEOUT),
    );
    let mut subscription = broker
        .subscriber(CONSUMER)
        .subscribe()
        .await
        .expect("subscribe");
    let first = next(&mut subscription, "the first delivery").await;

    match freeze {
        ConsumerFreeze::InTheHandler => {
            proxy.freeze_at(Cue::statement("INSERT INTO test_applied"));
        }
        ConsumerFreeze::AfterTheCommit => proxy.freeze_after(Cue::commit()),
    }
    let failed = bounded("the frozen message's processing", consumer.process(first)).await;
    match failed {
        Err(ConsumeError::Database(error)) => assert_timed_out(&error, "the frozen message"),
        other => panic!("the frozen message: expected the database timeout, got {other:?}"),
    }
    assert_eq!(proxy.cued(), 1, "the freeze began at its cue ({freeze:?})");
    assert_eq!(recorder.calls.load(Ordering::SeqCst), 1, "the handler ran");
    // Given back: the broker delivers it again while the database is still away.
    let again = next(&mut subscription, "the message given back").await;
    assert_eq!(again.message().id(), "evt-1");
    assert!(proxy.is_frozen(), "given back while the database was away");
    let committed = freeze == ConsumerFreeze::AfterTheCommit;
    assert_eq!(
        records(&direct, "evt-1").await,
        i64::from(committed),
        "the message's record committed only with its COMMIT"
    );
    assert_eq!(
        applications(&direct)
            .await
            .get("evt-1")
            .copied()
            .unwrap_or(0),
        usize::from(committed),
        "the handler's row committed only with its COMMIT"
    );

    proxy.heal();
    let processed = bounded("the redelivery after the heal", consumer.process(again))
        .await
        .expect("the redelivery is settled after the heal");
    let expected = if committed {
        Processed::Duplicate
    } else {
        Processed::Applied
    };
    assert_eq!(processed, expected, "the redelivery after the heal");
    assert_eq!(records(&direct, "evt-1").await, 1, "one record");
    assert_eq!(
        applications(&direct).await,
        HashMap::from([("evt-1".to_owned(), 1)]),
        "applied once"
    );
    assert_eq!(
        count(&direct, "SELECT COUNT(*) FROM idem_consumer_failures").await,
        0,
        "the database's timeout is not counted against the message"
    );
    assert_eq!(
        recorder.calls.load(Ordering::SeqCst),
        if committed { 1 } else { 2 },
        "the handler ran again only when nothing had committed"
    );
}

async fn a_consumer_frozen_in_its_handler_gives_the_message_back_and_applies_it_once_after_the_heal(
    connect: PgConnectOptions,
    broker: TestBroker,
) {
    within_test_deadline(a_consumer_frozen(
        connect,
        broker,
        ConsumerFreeze::InTheHandler,
    ))
    .await;
}

async fn a_consumer_whose_commit_answer_is_held_gives_the_message_back_and_its_redelivery_is_a_duplicate(
    connect: PgConnectOptions,
    broker: TestBroker,
) {
    within_test_deadline(a_consumer_frozen(
        connect,
        broker,
        ConsumerFreeze::AfterTheCommit,
    ))
    .await;
}

/// A spawned relay and consumer, on one database that freezes with a `COMMIT` forwarded (the
/// relay's mark, or the consumer's message, whichever comes first): both notice the outage (one
/// warning each) and retry while it lasts; once healed, what was enqueued before and during the
/// freeze and after the heal is published and applied, each event exactly once.
async fn a_spawned_relay_and_consumer_carry_on_after_the_database_heals(
    connect: PgConnectOptions,
    broker: TestBroker,
) {
    let log = idem_tests::CapturedLog::default();
    let _guard = tracing::subscriber::set_default(log.subscriber());
    let direct = direct_pool(&connect).await;
    broker.declare(CONSUMER).await;
    let (proxy, pool) = partitioned_pool(&connect).await;
    let shutdown = CancellationToken::new();
    let relay = Relay::new(
        pool.clone(),
        broker.publisher(),
        RelayOptions::default()
            .with_poll(Duration::from_millis(10))
            .with_database_timeout(DATABASE_TIMEOUT)
            .with_max_backoff(Duration::from_millis(200)),
    )
    .spawn(shutdown.clone());
    let recorder = Recorder::default();
    let consumer = events::Consumer::new(
        pool,
        recorder.clone(),
        ConsumerOptions::new(CONSUMER)
            .with_database_timeout(DATABASE_TIMEOUT)
            .with_max_backoff(Duration::from_millis(200)),
    )
    .with_subscriber(broker.subscriber(CONSUMER))
    .spawn(shutdown.clone());
    let applied_all = async |ids: &[String]| {
        wait_within(
            WAIT_DEADLINE,
            &format!("{} events applied", ids.len()),
            || async {
                let applied = applications(&direct).await;
                ids.iter().all(|id| applied.contains_key(id))
            },
        )
        .await;
    };
    let mut enqueued = vec![enqueue_committed(&direct, 0).await];
    applied_all(&enqueued).await;
    // The relay marks an event published after the broker confirmed it, and the consumer may
    // apply it before that: the freeze must not be cued by the first event's mark, or the second
    // event would never reach the consumer while the database is away, and the consumer would
    // have nothing to warn about.
    wait_within(
        WAIT_DEADLINE,
        "the first event marked published",
        || async { count(&direct, UNPUBLISHED).await == 0 },
    )
    .await;

    proxy.freeze_after(Cue::commit());
    enqueued.push(enqueue_committed(&direct, 1).await);
    for outage in [RELAY_OUTAGE, CONSUMER_OUTAGE] {
        wait_within(
            WAIT_DEADLINE,
            &format!("the warning {outage:?}"),
            || async { log.text().contains(outage) },
        )
        .await;
    }
    assert_eq!(proxy.cued(), 1, "the freeze began at a COMMIT");
    assert!(proxy.is_frozen(), "both warned while the database was away");
    enqueued.push(enqueue_committed(&direct, 2).await);

    proxy.heal();
    applied_all(&enqueued).await;
    enqueued.push(enqueue_committed(&direct, 3).await);
    applied_all(&enqueued).await;
    wait_within(WAIT_DEADLINE, "every event marked published", || async {
        count(&direct, UNPUBLISHED).await == 0
    })
    .await;

    shutdown.cancel();
    bounded("the relay's stop", relay.into_future())
        .await
        .expect("the relay stops");
    bounded("the consumer's stop", consumer.into_future())
        .await
        .expect("the consumer stops");
    let applied = applications(&direct).await;
    let once: HashMap<String, usize> = enqueued.iter().map(|id| (id.clone(), 1)).collect();
    assert_eq!(applied, once, "each event applied once");
    for outage in [RELAY_OUTAGE, CONSUMER_OUTAGE] {
        assert_eq!(
            log.text().matches(outage).count(),
            1,
            "one warning for the outage: {outage:?}"
        );
    }
}

/// Each test on PostgreSQL behind the proxy and one broker, as `<broker>::<name>`.
macro_rules! on_both_brokers {
    ($($name:ident),* $(,)?) => {
        mod rabbitmq {
            on_both_brokers!(@tests RabbitMq; $($name),*);
        }
        mod redis {
            on_both_brokers!(@tests Redis; $($name),*);
        }
    };
    (@tests $broker:ident; $($name:ident),*) => {$(
        #[sqlx::test(migrations = false)]
        async fn $name(_: sqlx::postgres::PgPoolOptions, connect: sqlx::postgres::PgConnectOptions) {
            let broker = idem_tests::TestBroker::new(idem_tests::BrokerKind::$broker);
            crate::events_partitions::$name(connect, broker).await;
        }
    )*};
}

on_both_brokers!(
    a_relay_frozen_at_its_batch_query_times_out_and_after_the_heal_publishes_every_event,
    a_relay_frozen_before_marking_a_published_batch_times_out_and_its_copies_apply_once,
    a_consumer_frozen_in_its_handler_gives_the_message_back_and_applies_it_once_after_the_heal,
    a_consumer_whose_commit_answer_is_held_gives_the_message_back_and_its_redelivery_is_a_duplicate,
    a_spawned_relay_and_consumer_carry_on_after_the_database_heals,
);
