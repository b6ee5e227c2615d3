//! The outbox, the relay and the idempotent consumer, against the real brokers (RabbitMQ, Redis
//! Streams and NATS JetStream) on both databases: every test runs as
//! `<database>::<broker>::<name>`.

use std::{
    collections::{HashMap, HashSet},
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use idem_events::{
    self as events, BrokerError, CancellationToken, ConsumeError, ConsumerOptions, Delivery,
    EventHandler, Message, Pass, Processed, Publisher, Relay, RelayOptions, Subscriber,
    Subscription, Waiting,
};
use idem_tests::{
    AnySubscription, BrokerKind, CLUSTER_ACK_WAIT, DEADLINE, EventBackend, NATS_NODES, NatsCluster,
    RedisServer, TcpProxy, TestBroker, wait_until,
};
use serde_json::json;
use sqlx::{Pool, Postgres, Sqlite, Transaction};
use tokio::time::Instant;

const CONSUMER: &str = "ledger";

/// The tests' consumer: records each message in `test_applied`, and fails every message whose
/// topic is `poison`. Counts its calls per message id; one made with [`Applier::holding_until`]
/// waits, after its write, until its token is cancelled.
#[derive(Default, Clone)]
struct Applier {
    calls: Arc<Mutex<HashMap<String, usize>>>,
    hold_until: Option<CancellationToken>,
}

impl Applier {
    fn holding_until(token: CancellationToken) -> Self {
        Self {
            hold_until: Some(token),
            ..Self::default()
        }
    }

    fn calls(&self, id: &str) -> usize {
        self.calls.lock().unwrap().get(id).copied().unwrap_or(0)
    }
}

impl<DB: EventBackend> EventHandler<DB> for Applier {
    type Error = String;

    async fn handle(
        &self,
        message: &Message,
        tx: &mut Transaction<'static, DB>,
    ) -> Result<(), String> {
        *self
            .calls
            .lock()
            .unwrap()
            .entry(message.id().to_owned())
            .or_default() += 1;
        DB::apply(tx, message)
            .await
            .map_err(|error| error.to_string())?;
        if let Some(token) = &self.hold_until {
            token.cancelled().await;
        }
        if message.topic() == "poison" {
            return Err("poison cannot be applied".to_owned());
        }
        Ok(())
    }
}

/// A delivery whose acknowledgement is lost on the way: the broker is told nothing and
/// delivers the message again.
struct LoseAck<D>(D);

impl<D: Delivery> Delivery for LoseAck<D> {
    fn message(&self) -> &Message {
        self.0.message()
    }

    fn redelivered(&self) -> bool {
        self.0.redelivered()
    }

    async fn ack(self) -> Result<(), BrokerError> {
        self.0.retry().await
    }

    async fn retry(self) -> Result<(), BrokerError> {
        self.0.retry().await
    }

    async fn dead_letter(self, reason: &str) -> Result<(), BrokerError> {
        self.0.dead_letter(reason).await
    }
}

/// A delivery whose acknowledgement is sent and never answered, as the RabbitMQ client leaves
/// one whose connection broke on the way: the broker is told nothing.
struct UnansweredAck<D>(D);

impl<D: Delivery> Delivery for UnansweredAck<D> {
    fn message(&self) -> &Message {
        self.0.message()
    }

    fn redelivered(&self) -> bool {
        self.0.redelivered()
    }

    async fn ack(self) -> Result<(), BrokerError> {
        let _unsettled = self.0;
        std::future::pending().await
    }

    async fn retry(self) -> Result<(), BrokerError> {
        self.0.retry().await
    }

    async fn dead_letter(self, reason: &str) -> Result<(), BrokerError> {
        self.0.dead_letter(reason).await
    }
}

/// The next delivery, or a failure that says what the test was waiting for.
async fn next(subscription: &mut AnySubscription, waiting_for: &str) -> idem_tests::AnyDelivery {
    tokio::time::timeout(DEADLINE, subscription.next())
        .await
        .unwrap_or_else(|_| {
            panic!("no message within {DEADLINE:?} while waiting for {waiting_for}")
        })
        .expect("the subscription broke")
}

/// The event tables and `test_applied` on `pool`; the consumer's queue (or stream) on `broker`.
async fn set_up<DB: EventBackend>(pool: &Pool<DB>, broker: &TestBroker) {
    DB::prepare_events(pool).await;
    broker.declare(CONSUMER).await;
}

/// A subscription of the tests' consumer on `broker`.
async fn subscribe(broker: &TestBroker) -> AnySubscription {
    broker
        .subscriber(CONSUMER)
        .subscribe()
        .await
        .expect("subscribe")
}

/// The tests' consumer on `pool`, with `applier` and the default options.
fn consumer_with<DB: EventBackend>(
    pool: &Pool<DB>,
    applier: Applier,
) -> events::Consumer<DB, Applier> {
    events::Consumer::new(pool.clone(), applier, ConsumerOptions::new(CONSUMER))
}

/// Publishes one empty `payment.succeeded` message, `id`.
async fn publish(publisher: &impl Publisher, id: &str) {
    publisher
        .publish(&[Message::new(id, "payment.succeeded", "{}")])
        .await
        .expect("publish");
}

/// How many events of the outbox are not published yet.
async fn unpublished<DB: EventBackend>(pool: &Pool<DB>) -> i64 {
    let sql = "SELECT COUNT(*) FROM idem_outbox WHERE published_at IS NULL";
    DB::count(pool, sql).await
}

/// Enqueues one event in a transaction of its own and commits; returns its id.
async fn enqueue_committed<DB: EventBackend>(pool: &Pool<DB>, topic: &str, seq: usize) -> String {
    let mut tx = pool.begin().await.expect("begin");
    let id = events::enqueue(&mut tx, topic, &json!({ "seq": seq }))
        .await
        .expect("enqueue");
    tx.commit().await.expect("commit");
    id.to_string()
}

/// Reads messages until every id in `expected` arrived; returns the ids in arrival order per
/// topic, duplicates included.
async fn receive_all(
    subscription: &mut AnySubscription,
    expected: &HashSet<String>,
) -> HashMap<String, Vec<String>> {
    let mut by_topic: HashMap<String, Vec<String>> = HashMap::new();
    let mut seen = HashSet::new();
    while !expected.is_subset(&seen) {
        let delivery = next(
            subscription,
            &format!("{} more events", expected.difference(&seen).count()),
        )
        .await;
        let message = delivery.message().clone();
        delivery.ack().await.expect("ack");
        seen.insert(message.id().to_owned());
        by_topic
            .entry(message.topic().to_owned())
            .or_default()
            .push(message.id().to_owned());
    }
    by_topic
}

/// Asserts that each topic's events arrived, first occurrences taken, in the order they were
/// enqueued, and that nothing else arrived.
fn assert_in_order(
    arrived: &HashMap<String, Vec<String>>,
    enqueued: &HashMap<String, Vec<String>>,
) {
    for (topic, sent) in enqueued {
        let mut firsts = Vec::new();
        for id in arrived.get(topic).map(Vec::as_slice).unwrap_or_default() {
            if !firsts.contains(id) {
                firsts.push(id.clone());
            }
        }
        assert_eq!(&firsts, sent, "topic {topic}: events lost or out of order");
    }
    for topic in arrived.keys() {
        assert!(
            enqueued.contains_key(topic),
            "events of an unknown topic {topic} arrived"
        );
    }
}

async fn a_rolled_back_transaction_enqueues_nothing<DB: EventBackend>(
    pool: Pool<DB>,
    broker: TestBroker,
) {
    set_up(&pool, &broker).await;

    let mut tx = pool.begin().await.expect("begin");
    events::enqueue(&mut tx, "payment.succeeded", &json!({ "n": 1 }))
        .await
        .expect("enqueue");
    tx.rollback().await.expect("rollback");
    let committed = enqueue_committed(&pool, "payment.succeeded", 2).await;

    assert_eq!(
        DB::count(&pool, "SELECT COUNT(*) FROM idem_outbox").await,
        1
    );
    let mut relay = Relay::new(pool.clone(), broker.publisher(), RelayOptions::default());
    assert_eq!(
        relay.drain().await.expect("relay"),
        1,
        "only the committed event is published"
    );
    let mut subscription = subscribe(&broker).await;
    let delivery = next(&mut subscription, "the committed event").await;
    assert_eq!(delivery.message().id(), committed);
    assert_eq!(
        delivery.message().json::<serde_json::Value>().unwrap(),
        json!({ "seq": 2 })
    );
    delivery.ack().await.expect("ack");
    assert_eq!(unpublished(&pool).await, 0, "the event is marked published");
}

async fn a_redelivered_message_is_applied_once<DB: EventBackend>(
    pool: Pool<DB>,
    broker: TestBroker,
) {
    set_up(&pool, &broker).await;
    let message = Message::new("evt-1", "payment.succeeded", r#"{"amount":5}"#);
    // Published twice, as a relay that stopped before marking it would.
    let publisher = broker.publisher();
    publisher
        .publish(std::slice::from_ref(&message))
        .await
        .expect("publish");
    publisher
        .publish(std::slice::from_ref(&message))
        .await
        .expect("publish again");

    let applier = Applier::default();
    let consumer = consumer_with(&pool, applier.clone());
    let mut subscription = subscribe(&broker).await;
    // The first delivery is applied, but its acknowledgement is lost: the broker delivers it
    // once more, besides the second copy (which JetStream drops: the same `Nats-Msg-Id`
    // within its duplicate window).
    let first = next(&mut subscription, "the first delivery").await;
    assert_eq!(
        consumer.process(LoseAck(first)).await.expect("process"),
        Processed::Applied
    );
    let copies: &[&str] = if broker.drops_republished_copies() {
        &["the redelivery after the lost ack"]
    } else {
        &["the redelivery after the lost ack", "the second copy"]
    };
    for &copy in copies {
        let delivery = next(&mut subscription, copy).await;
        assert_eq!(delivery.message().id(), "evt-1");
        assert_eq!(
            consumer.process(delivery).await.expect("process"),
            Processed::Duplicate
        );
    }
    assert_eq!(
        DB::applied(&pool).await,
        vec!["evt-1".to_owned()],
        "applied once"
    );
    assert_eq!(applier.calls("evt-1"), 1, "the handler ran once");
}

async fn a_poison_message_is_dead_lettered_after_five_attempts_and_the_rest_flow<
    DB: EventBackend,
>(
    pool: Pool<DB>,
    broker: TestBroker,
) {
    set_up(&pool, &broker).await;
    broker
        .publisher()
        .publish(&[
            Message::new("bad", "poison", "{}"),
            Message::new("good-1", "payment.succeeded", "{}"),
            Message::new("good-2", "payment.succeeded", "{}"),
        ])
        .await
        .expect("publish");

    let applier = Applier::default();
    let shutdown = CancellationToken::new();
    let running = consumer_with(&pool, applier.clone())
        .with_subscriber(broker.subscriber(CONSUMER))
        .spawn(shutdown.clone());
    wait_until(
        "both good messages applied and the poison one dead-lettered",
        || async {
            let applied = DB::applied(&pool).await;
            applied.contains(&"good-1".to_owned())
                && applied.contains(&"good-2".to_owned())
                && broker.dead_letters(CONSUMER).await == ["bad"]
        },
    )
    .await;
    shutdown.cancel();
    running.await.expect("the consumer stops");

    assert_eq!(applier.calls("bad"), 5, "five attempts");
    assert_eq!(
        DB::count(
            &pool,
            "SELECT CAST(attempts AS BIGINT) FROM idem_consumer_failures WHERE message_id = 'bad'"
        )
        .await,
        5
    );
    assert!(
        !DB::applied(&pool).await.contains(&"bad".to_owned()),
        "the failed attempts rolled back"
    );
}

async fn the_relay_keeps_each_topic_in_order_when_connections_drop_and_the_broker_is_away<
    DB: EventBackend,
>(
    pool: Pool<DB>,
    broker: TestBroker,
) {
    set_up(&pool, &broker).await;
    let proxy = TcpProxy::start(broker.address()).await;
    let mut relay = Relay::new(
        pool.clone(),
        broker.through(&proxy).publisher(),
        RelayOptions::default().with_batch(4),
    );
    let mut enqueued: HashMap<String, Vec<String>> = HashMap::new();
    let enqueue = async |topic: &str, seq: usize, enqueued: &mut HashMap<String, Vec<String>>| {
        let id = enqueue_committed(&pool, topic, seq).await;
        enqueued.entry(topic.to_owned()).or_default().push(id);
    };
    for seq in 0..12 {
        for topic in ["a", "b", "c"] {
            enqueue(topic, seq, &mut enqueued).await;
        }
    }

    // Connections cut between batches: the next pass finds its connection dead.
    for _ in 0..4 {
        let _ = relay.pass().await;
        proxy.cut_all();
    }
    // The broker away: nothing is published, events keep arriving in the outbox.
    proxy.refuse(true);
    for seq in 12..18 {
        enqueue("a", seq, &mut enqueued).await;
    }
    assert!(
        matches!(relay.pass().await, Err(events::RelayError::Broker(_))),
        "the relay cannot publish while the broker is away"
    );
    proxy.refuse(false);
    // Connections cut in the middle of a batch, after a number of bytes.
    for bytes in [400, 700, 1000, 1500, 2500] {
        proxy.cut_after(bytes);
        proxy.cut_all();
        for _ in 0..3 {
            let _ = relay.pass().await;
        }
    }
    proxy.cut_after(0);
    let deadline = Instant::now() + DEADLINE;
    while let Err(error) = relay.drain().await {
        assert!(
            Instant::now() < deadline,
            "the relay did not recover: {error}"
        );
    }
    assert!(
        proxy.cuts() >= 5,
        "the proxy cut {} connections",
        proxy.cuts()
    );
    assert_eq!(unpublished(&pool).await, 0);

    let expected = enqueued.values().flatten().cloned().collect();
    let mut subscription = subscribe(&broker).await;
    let arrived = receive_all(&mut subscription, &expected).await;
    assert_in_order(&arrived, &enqueued);
}

async fn relays_side_by_side_share_the_topics_and_keep_each_in_order<DB: EventBackend>(
    pool: Pool<DB>,
    broker: TestBroker,
) {
    set_up(&pool, &broker).await;
    let shutdown = CancellationToken::new();
    let options = RelayOptions::default()
        .with_batch(3)
        .with_poll(Duration::from_millis(5));
    let relays: Vec<_> = (0..3)
        .map(|_| {
            Relay::new(pool.clone(), broker.publisher(), options.clone()).spawn(shutdown.clone())
        })
        .collect();
    // One producer per topic, each committing its events one after the other, all at once.
    let producers: Vec<_> = ["a", "b", "c", "d"]
        .into_iter()
        .map(|topic| {
            let pool = pool.clone();
            tokio::spawn(async move {
                let mut ids = Vec::new();
                for seq in 0..25 {
                    ids.push(enqueue_committed(&pool, topic, seq).await);
                }
                (topic.to_owned(), ids)
            })
        })
        .collect();
    let mut enqueued = HashMap::new();
    for producer in producers {
        let (topic, ids) = producer.await.expect("the producer");
        enqueued.insert(topic, ids);
    }
    let expected = enqueued.values().flatten().cloned().collect();
    let mut subscription = subscribe(&broker).await;
    let arrived = receive_all(&mut subscription, &expected).await;
    shutdown.cancel();
    for relay in relays {
        relay.await.expect("the relay stops");
    }
    assert_in_order(&arrived, &enqueued);
}

async fn a_relay_passes_over_a_topic_that_another_relay_holds<DB: EventBackend>(
    pool: Pool<DB>,
    broker: TestBroker,
) {
    set_up(&pool, &broker).await;
    enqueue_committed(&pool, "a", 0).await;
    enqueue_committed(&pool, "b", 0).await;
    // A relay whose broker never confirms holds its topic for as long as it waits.
    let stalled = Stalled::default();
    let reached = Arc::clone(&stalled.reached);
    let mut holding = Relay::new(
        pool.clone(),
        stalled,
        RelayOptions::default().with_publish_timeout(Duration::from_secs(3600)),
    );
    let held = tokio::spawn(async move { holding.pass().await });
    wait_until("the stalled relay holds a topic", || {
        let reached = Arc::clone(&reached);
        async move { reached.load(Ordering::SeqCst) > 0 }
    })
    .await;
    let mut relay = Relay::new(pool.clone(), broker.publisher(), RelayOptions::default());
    assert_eq!(
        relay.pass().await.expect("relay"),
        Pass::Published {
            topic: "b".to_owned(),
            count: 1
        },
        "the other relay holds topic a (the first in order), so this one publishes b"
    );
    assert_eq!(
        relay.pass().await.expect("relay"),
        Pass::Idle,
        "topic a is held: skipped"
    );
    held.abort();
    let _ = held.await;
}

/// A publisher that never answers, and counts the batches it was given.
#[derive(Default, Clone)]
struct Stalled {
    reached: Arc<AtomicUsize>,
}

impl Publisher for Stalled {
    async fn publish(&self, _: &[Message]) -> Result<(), BrokerError> {
        self.reached.fetch_add(1, Ordering::SeqCst);
        std::future::pending().await
    }
}

async fn a_shutdown_lets_the_message_in_flight_finish_and_settle<DB: EventBackend>(
    pool: Pool<DB>,
    broker: TestBroker,
) {
    set_up(&pool, &broker).await;
    let shutdown = CancellationToken::new();
    // The handler goes on only once the shutdown has come: the consumer must let it finish.
    let applier = Applier::holding_until(shutdown.clone());
    let running = consumer_with(&pool, applier.clone())
        .with_subscriber(broker.subscriber(CONSUMER))
        .spawn(shutdown.clone());
    publish(&broker.publisher(), "in-flight").await;
    wait_until("the handler to start on the message", || async {
        applier.calls("in-flight") == 1
    })
    .await;
    shutdown.cancel();
    running.await.expect("the consumer stops");
    assert_eq!(DB::applied(&pool).await, vec!["in-flight".to_owned()]);
    assert_eq!(
        broker.waiting(CONSUMER).await,
        0,
        "the message was acknowledged before the consumer stopped"
    );
}

async fn a_consumer_receives_again_after_its_connection_drops<DB: EventBackend>(
    pool: Pool<DB>,
    broker: TestBroker,
) {
    set_up(&pool, &broker).await;
    let proxy = TcpProxy::start(broker.address()).await;
    let shutdown = CancellationToken::new();
    let running = consumer_with(&pool, Applier::default())
        .with_subscriber(broker.through(&proxy).subscriber(CONSUMER))
        .spawn(shutdown.clone());
    let publisher = broker.publisher();
    publish(&publisher, "before").await;
    wait_until("the first message applied", || async {
        DB::applied(&pool).await.contains(&"before".to_owned())
    })
    .await;
    proxy.cut_all();
    publish(&publisher, "after").await;
    wait_until("the message sent after the cut applied", || async {
        DB::applied(&pool).await.contains(&"after".to_owned())
    })
    .await;
    shutdown.cancel();
    running.await.expect("the consumer stops");
    let mut applied = DB::applied(&pool).await;
    applied.sort();
    assert_eq!(applied, ["after", "before"], "each message once");
    assert!(proxy.cuts() >= 1);
}

async fn an_acknowledgement_never_answered_ends_as_a_broker_error_after_the_settle_timeout<
    DB: EventBackend,
>(
    pool: Pool<DB>,
    broker: TestBroker,
) {
    set_up(&pool, &broker).await;
    publish(&broker.publisher(), "unanswered").await;
    let consumer = events::Consumer::new(
        pool.clone(),
        Applier::default(),
        ConsumerOptions::new(CONSUMER).with_settle_timeout(Duration::from_millis(200)),
    );
    let mut subscription = subscribe(&broker).await;
    let delivery = next(&mut subscription, "the message").await;
    // Without the settle timeout `process` waits for good, and with it the spawned consumer,
    // which then receives nothing more on any connection.
    let processed = tokio::time::timeout(DEADLINE, consumer.process(UnansweredAck(delivery)))
        .await
        .expect("process returns although the acknowledgement is never answered");
    assert!(
        matches!(processed, Err(ConsumeError::Broker(_))),
        "{processed:?}"
    );
    assert_eq!(DB::applied(&pool).await, vec!["unanswered".to_owned()]);
}

async fn a_message_that_stops_its_consumer_every_time_ends_in_the_dead_letter_place<
    DB: EventBackend,
>(
    pool: Pool<DB>,
    broker: TestBroker,
) {
    set_up(&pool, &broker).await;
    publish(&broker.publisher(), "killer").await;
    // The handler never returns: each attempt ends with its consumer stopped mid-message, as
    // a process that an abort or the OOM killer stops.
    let never = CancellationToken::new();
    let applier = Applier::holding_until(never.clone());
    let consumer = consumer_with(&pool, applier.clone());
    let mut outcome = None;
    for delivery in 1..=10 {
        let mut subscription = subscribe(&broker).await;
        let received = next(&mut subscription, "the killer message again").await;
        let consumer = consumer.clone();
        let processing = tokio::spawn(async move { consumer.process(received).await });
        wait_until(
            "the handler to run, or the message to be settled",
            || async { applier.calls("killer") == delivery || processing.is_finished() },
        )
        .await;
        if processing.is_finished() {
            outcome = Some(processing.await.expect("process").expect("settled"));
            break;
        }
        processing.abort();
        let _ = processing.await;
        drop(subscription);
    }
    assert_eq!(outcome, Some(Processed::DeadLettered { attempts: 5 }));
    assert_eq!(
        applier.calls("killer"),
        6,
        "the first delivery and five counted ones"
    );
    wait_until("the message in the dead-letter place", || async {
        broker.dead_letters(CONSUMER).await == ["killer"]
    })
    .await;
    assert!(
        DB::applied(&pool).await.is_empty(),
        "every attempt rolled back"
    );
}

async fn the_relay_reports_its_backlog<DB: EventBackend>(pool: Pool<DB>, broker: TestBroker) {
    set_up(&pool, &broker).await;
    let mut relay = Relay::new(pool.clone(), broker.publisher(), RelayOptions::default());
    let empty = Waiting {
        events: 0,
        oldest: None,
    };
    assert_eq!(relay.waiting().await.expect("waiting"), empty);
    enqueue_committed(&pool, "a", 0).await;
    enqueue_committed(&pool, "b", 0).await;
    let waiting = relay.waiting().await.expect("waiting");
    assert_eq!(waiting.events, 2);
    assert!(
        waiting.oldest.is_some(),
        "the oldest event's age: {waiting:?}"
    );
    assert_eq!(relay.drain().await.expect("relay"), 2);
    assert_eq!(
        relay.waiting().await.expect("waiting"),
        empty,
        "published events do not wait"
    );
}

/// Each test on one database and one broker, as `<database>::<broker>::<name>`.
macro_rules! on_both_databases_and_brokers {
    ($($name:ident),* $(,)?) => {
        mod postgres {
            on_both_databases_and_brokers!(@brokers postgres; $($name),*);
        }
        mod sqlite {
            on_both_databases_and_brokers!(@brokers sqlite; $($name),*);
        }
        mod mysql {
            on_both_databases_and_brokers!(@brokers mysql; $($name),*);
        }
    };
    (@brokers $db:ident; $($name:ident),*) => {
        mod rabbitmq {
            on_both_databases_and_brokers!(@tests $db, RabbitMq; $($name),*);
        }
        mod redis {
            on_both_databases_and_brokers!(@tests $db, Redis; $($name),*);
        }
        mod nats {
            on_both_databases_and_brokers!(@tests $db, Nats; $($name),*);
        }
    };
    (@tests postgres, $broker:ident; $($name:ident),*) => {$(
        #[sqlx::test(migrations = false)]
        async fn $name(
            _: sqlx::postgres::PgPoolOptions,
            connect: sqlx::postgres::PgConnectOptions,
        ) {
            let pool = crate::events::postgres_pool(connect).await;
            crate::events::$name(pool, idem_tests::TestBroker::new(idem_tests::BrokerKind::$broker)).await;
        }
    )*};
    (@tests mysql, $broker:ident; $($name:ident),*) => {$(
        #[tokio::test]
        async fn $name() {
            crate::events::on_mysql(|pool| {
                crate::events::$name(pool, idem_tests::TestBroker::new(idem_tests::BrokerKind::$broker))
            })
            .await;
        }
    )*};
    (@tests sqlite, $broker:ident; $($name:ident),*) => {$(
        #[tokio::test]
        async fn $name() {
            let dir = tempfile::tempdir().expect("a temporary directory");
            let pool = crate::events::sqlite_pool(&dir).await;
            crate::events::$name(pool, idem_tests::TestBroker::new(idem_tests::BrokerKind::$broker)).await;
        }
    )*};
}

async fn postgres_pool(connect: sqlx::postgres::PgConnectOptions) -> Pool<Postgres> {
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(8)
        .connect_with(connect)
        .await
        .expect("connect to the test database")
}

/// Runs `test` on a pool of a fresh database on the MySQL server, dropped after it.
async fn on_mysql<F, Fut>(test: F)
where
    F: FnOnce(Pool<sqlx::MySql>) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let database = idem_tests::MySqlDb::create().await;
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(8)
        .connect_with(database.options().clone())
        .await
        .expect("connect to the test database");
    test(pool.clone()).await;
    // Closing waits for every connection to come back: bounded, since what the test checked is
    // done, and a database left behind is dropped by the next run.
    if tokio::time::timeout(DEADLINE, pool.close()).await.is_err() {
        eprintln!(
            "the test's pool did not close within {DEADLINE:?}; dropping its database anyway"
        );
    }
    idem_tests::MySqlDb::drop_named(database.name()).await;
}

async fn sqlite_pool(dir: &tempfile::TempDir) -> Pool<Sqlite> {
    let options = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(dir.path().join("events.db"))
        .create_if_missing(true)
        .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_secs(30));
    sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(8)
        .connect_with(options)
        .await
        .expect("open the SQLite file")
}

on_both_databases_and_brokers!(
    a_rolled_back_transaction_enqueues_nothing,
    a_redelivered_message_is_applied_once,
    a_poison_message_is_dead_lettered_after_five_attempts_and_the_rest_flow,
    the_relay_keeps_each_topic_in_order_when_connections_drop_and_the_broker_is_away,
    relays_side_by_side_share_the_topics_and_keep_each_in_order,
    a_relay_passes_over_a_topic_that_another_relay_holds,
    a_shutdown_lets_the_message_in_flight_finish_and_settle,
    a_consumer_receives_again_after_its_connection_drops,
    an_acknowledgement_never_answered_ends_as_a_broker_error_after_the_settle_timeout,
    a_message_that_stops_its_consumer_every_time_ends_in_the_dead_letter_place,
    the_relay_reports_its_backlog,
);

/// A Redis of the test's own, killed with SIGKILL and started again on the same port while a
/// relay and a consumer run: both carry on, and what was enqueued meanwhile arrives. (This Redis
/// keeps nothing on disk: what the stream held before is gone, as the events that were already
/// applied.)
async fn the_relay_and_the_consumer_carry_on_after_a_redis_restart<DB: EventBackend>(
    pool: Pool<DB>,
) {
    DB::prepare_events(&pool).await;
    let mut server = RedisServer::start().await;
    let broker = TestBroker::at(BrokerKind::Redis, &server.url());
    broker.declare(CONSUMER).await;
    let shutdown = CancellationToken::new();
    let options = RelayOptions::default()
        .with_poll(Duration::from_millis(10))
        .with_max_backoff(Duration::from_millis(500));
    let relay = Relay::new(pool.clone(), broker.publisher(), options).spawn(shutdown.clone());
    let consumer = events::Consumer::new(
        pool.clone(),
        Applier::default(),
        ConsumerOptions::new(CONSUMER).with_max_backoff(Duration::from_millis(500)),
    )
    .with_subscriber(broker.subscriber(CONSUMER))
    .spawn(shutdown.clone());
    let before = enqueue_committed(&pool, "payment.succeeded", 0).await;
    // Applied, and marked published: the consumer can apply an event before the relay has
    // heard the broker take it.
    wait_until("the first event applied and marked published", || async {
        DB::applied(&pool).await.contains(&before) && unpublished(&pool).await == 0
    })
    .await;

    server.kill();
    let during = [
        enqueue_committed(&pool, "payment.succeeded", 1).await,
        enqueue_committed(&pool, "payment.succeeded", 2).await,
    ];
    assert_eq!(
        unpublished(&pool).await,
        2,
        "with the broker down, the events wait in the outbox"
    );
    server.restart().await;
    wait_until(
        "the events enqueued while Redis was down applied",
        || async {
            let applied = DB::applied(&pool).await;
            during.iter().all(|id| applied.contains(id))
        },
    )
    .await;
    shutdown.cancel();
    relay.await.expect("the relay stops");
    consumer.await.expect("the consumer stops");
    let mut applied = DB::applied(&pool).await;
    applied.sort();
    let mut expected = vec![before, during[0].clone(), during[1].clone()];
    expected.sort();
    assert_eq!(applied, expected, "each event applied once");
}

#[sqlx::test(migrations = false)]
async fn postgres_the_relay_and_the_consumer_carry_on_after_a_redis_restart(
    _: sqlx::postgres::PgPoolOptions,
    connect: sqlx::postgres::PgConnectOptions,
) {
    the_relay_and_the_consumer_carry_on_after_a_redis_restart(postgres_pool(connect).await).await;
}

#[tokio::test]
async fn mysql_the_relay_and_the_consumer_carry_on_after_a_redis_restart() {
    on_mysql(the_relay_and_the_consumer_carry_on_after_a_redis_restart).await;
}

#[tokio::test]
async fn sqlite_the_relay_and_the_consumer_carry_on_after_a_redis_restart() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    the_relay_and_the_consumer_carry_on_after_a_redis_restart(sqlite_pool(&dir).await).await;
}

/// RabbitMQ only: Redis takes every entry, so it never refuses a topic.
async fn a_topic_no_queue_receives_waits_while_the_others_flow<DB: EventBackend>(pool: Pool<DB>) {
    DB::prepare_events(&pool).await;
    let broker = TestBroker::new(BrokerKind::RabbitMq);
    broker
        .rabbitmq_subscriber(CONSUMER, "b")
        .declare()
        .await
        .expect("declare");
    let a = enqueue_committed(&pool, "a", 0).await;
    let b = [
        enqueue_committed(&pool, "b", 0).await,
        enqueue_committed(&pool, "b", 1).await,
    ];
    let mut relay = Relay::new(pool.clone(), broker.publisher(), RelayOptions::default());
    assert!(matches!(relay.pass().await, Ok(Pass::Refused { topic, .. }) if topic == "a"));
    assert_eq!(
        relay.drain().await.expect("relay"),
        2,
        "topic b is published meanwhile"
    );
    let mut subscription = broker
        .rabbitmq_subscriber(CONSUMER, "b")
        .subscribe()
        .await
        .expect("subscribe");
    for id in &b {
        let delivery = subscription.next().await.expect("a message");
        assert_eq!(delivery.message().id(), id);
        delivery.ack().await.expect("ack");
    }
    drop(subscription);
    assert_eq!(unpublished(&pool).await, 1, "topic a's event waits");

    // A queue for topic a appears: once its backoff is over, the relay publishes it.
    broker
        .rabbitmq_subscriber(CONSUMER, "a")
        .declare()
        .await
        .expect("bind topic a");
    let deadline = Instant::now() + DEADLINE;
    while unpublished(&pool).await > 0 {
        assert!(
            Instant::now() < deadline,
            "topic a not published within {DEADLINE:?}"
        );
        relay.drain().await.expect("relay");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut subscription = broker
        .rabbitmq_subscriber(CONSUMER, "a")
        .subscribe()
        .await
        .expect("subscribe");
    let delivery = subscription.next().await.expect("a message");
    assert_eq!(delivery.message().id(), a);
    delivery.ack().await.expect("ack");
}

#[sqlx::test(migrations = false)]
async fn postgres_a_topic_no_queue_receives_waits_while_the_others_flow(
    _: sqlx::postgres::PgPoolOptions,
    connect: sqlx::postgres::PgConnectOptions,
) {
    a_topic_no_queue_receives_waits_while_the_others_flow(postgres_pool(connect).await).await;
}

#[tokio::test]
async fn mysql_a_topic_no_queue_receives_waits_while_the_others_flow() {
    on_mysql(a_topic_no_queue_receives_waits_while_the_others_flow).await;
}

#[tokio::test]
async fn sqlite_a_topic_no_queue_receives_waits_while_the_others_flow() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    a_topic_no_queue_receives_waits_while_the_others_flow(sqlite_pool(&dir).await).await;
}

/// The tables the database holds, by name, but sqlx's and SQLite's own.
async fn tables<DB: EventBackend>(pool: &Pool<DB>, sql: &str) -> Vec<String> {
    let mut names = DB::strings(pool, sql).await;
    names.retain(|name| !name.starts_with("sqlite_"));
    names.sort();
    names
}

/// The key table's migrations create only the key table: the event tables come with
/// `idem_events::migrate`, which adds them beside it.
async fn each_crate_migrates_only_its_own_tables<DB: EventBackend>(pool: Pool<DB>, list: &str) {
    idem_runtime::migrate(&pool)
        .await
        .expect("migrate the key table");
    assert_eq!(
        tables(&pool, list).await,
        ["_idem_migrations", "idem_keys"],
        "idem_runtime::migrate created more than the key table"
    );
    events::migrate(&pool)
        .await
        .expect("migrate the event tables");
    assert_eq!(
        tables(&pool, list).await,
        [
            "_idem_events_migrations",
            "_idem_migrations",
            "idem_consumed",
            "idem_consumer_failures",
            "idem_keys",
            "idem_outbox",
            "idem_outbox_topics",
        ],
    );
}

/// A database whose event tables an earlier release created together with the key table (its
/// migration recorded in `_idem_migrations`, which no longer lists it) keeps working: both
/// migrations run again, and the waiting event is still there.
async fn event_tables_an_earlier_release_created_are_adopted<DB: EventBackend>(
    pool: Pool<DB>,
    event_sql: &str,
    checksum: &str,
) {
    idem_runtime::migrate(&pool)
        .await
        .expect("migrate the key table");
    // As the earlier release left it: the tables, and their migration recorded with the key
    // table's.
    DB::run_sql(&pool, event_sql).await;
    DB::run_sql(
        &pool,
        &format!(
            "INSERT INTO _idem_migrations \
             (version, description, success, checksum, execution_time) \
             VALUES (20261201000001, 'events', TRUE, {checksum}, 0)"
        ),
    )
    .await;
    let waiting = enqueue_committed(&pool, "payment.succeeded", 1).await;

    idem_runtime::migrate(&pool)
        .await
        .expect("the key table's migrations run again");
    events::migrate(&pool)
        .await
        .expect("the event tables are adopted");
    events::migrate(&pool)
        .await
        .expect("and migrating again changes nothing");
    let ids = DB::strings(&pool, "SELECT event_id FROM idem_outbox").await;
    assert_eq!(ids, [waiting], "the waiting event was lost");
}

const POSTGRES_TABLES: &str =
    "SELECT tablename::text FROM pg_tables WHERE schemaname = current_schema()";
const SQLITE_TABLES: &str = "SELECT name FROM sqlite_master WHERE type = 'table'";
const MYSQL_TABLES: &str = "SELECT CONVERT(table_name USING utf8mb4) FROM information_schema.tables \
     WHERE table_schema = DATABASE()";
/// The event tables' SQL as the earlier release ran it, without `IF NOT EXISTS`.
fn earlier_event_sql(sql: &str) -> String {
    sql.replace("IF NOT EXISTS ", "")
}

#[sqlx::test(migrations = false)]
async fn postgres_each_crate_migrates_only_its_own_tables(
    _: sqlx::postgres::PgPoolOptions,
    connect: sqlx::postgres::PgConnectOptions,
) {
    each_crate_migrates_only_its_own_tables(postgres_pool(connect).await, POSTGRES_TABLES).await;
}

#[tokio::test]
async fn mysql_each_crate_migrates_only_its_own_tables() {
    on_mysql(|pool| each_crate_migrates_only_its_own_tables(pool, MYSQL_TABLES)).await;
}

#[tokio::test]
async fn sqlite_each_crate_migrates_only_its_own_tables() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    each_crate_migrates_only_its_own_tables(sqlite_pool(&dir).await, SQLITE_TABLES).await;
}

#[sqlx::test(migrations = false)]
async fn postgres_event_tables_an_earlier_release_created_are_adopted(
    _: sqlx::postgres::PgPoolOptions,
    connect: sqlx::postgres::PgConnectOptions,
) {
    let sql = earlier_event_sql(include_str!(
        "../../idem-events/migrations/postgres/20261201000001_events.sql"
    ));
    let pool = postgres_pool(connect).await;
    event_tables_an_earlier_release_created_are_adopted(pool, &sql, "'\\x00'::bytea").await;
}

#[tokio::test]
async fn sqlite_event_tables_an_earlier_release_created_are_adopted() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let sql = earlier_event_sql(include_str!(
        "../../idem-events/migrations/sqlite/20261201000001_events.sql"
    ));
    let pool = sqlite_pool(&dir).await;
    event_tables_an_earlier_release_created_are_adopted(pool, &sql, "X'00'").await;
}

/// NATS only: a relay that publishes an event again (it stopped between JetStream's ack and
/// marking the event published) sends the same `Nats-Msg-Id`, and JetStream drops the copy:
/// the stream holds it once, the consumer receives it once (the event enqueued after it comes
/// next), and it is applied once.
async fn nats_an_event_the_relay_publishes_again_is_stored_delivered_and_applied_once<
    DB: EventBackend,
>(
    pool: Pool<DB>,
) {
    let broker = TestBroker::new(BrokerKind::Nats);
    set_up(&pool, &broker).await;
    let event = enqueue_committed(&pool, "payment.succeeded", 0).await;
    let mut relay = Relay::new(pool.clone(), broker.publisher(), RelayOptions::default());
    assert_eq!(relay.drain().await.expect("relay"), 1);
    // As a relay that stopped before its mark: the event waits again, and a new relay (a new
    // connection) publishes it again.
    DB::run_sql(&pool, "UPDATE idem_outbox SET published_at = NULL").await;
    let mut restarted = Relay::new(pool.clone(), broker.publisher(), RelayOptions::default());
    assert_eq!(
        restarted.drain().await.expect("relay"),
        1,
        "published again"
    );
    let later = enqueue_committed(&pool, "payment.succeeded", 1).await;
    assert_eq!(restarted.drain().await.expect("relay"), 1);
    assert_eq!(broker.nats_stored().await, 2, "JetStream kept one copy");

    let applier = Applier::default();
    let consumer = consumer_with(&pool, applier.clone());
    let mut subscription = subscribe(&broker).await;
    for expected in [&event, &later] {
        let delivery = next(&mut subscription, "the next event").await;
        assert_eq!(delivery.message().id(), expected, "no copy in between");
        assert_eq!(
            consumer.process(delivery).await.expect("process"),
            Processed::Applied
        );
    }
    let mut applied = DB::applied(&pool).await;
    applied.sort();
    let mut expected = vec![event.clone(), later];
    expected.sort();
    assert_eq!(applied, expected);
    assert_eq!(applier.calls(&event), 1, "the handler ran once");
}

/// NATS only: a message whose consumer took it and then never settled it, nor closed its
/// connection (a process that hangs, or was killed before it could say anything), is delivered
/// again, to the next subscription, once the consumer's ack wait is over, and says it is
/// delivered again.
async fn nats_a_message_left_unsettled_is_delivered_again_after_the_ack_wait<DB: EventBackend>(
    pool: Pool<DB>,
) {
    let broker = TestBroker::new(BrokerKind::Nats);
    set_up(&pool, &broker).await;
    publish(&broker.publisher(), "stuck").await;
    let mut first = subscribe(&broker).await;
    let taken = next(&mut first, "the message").await;
    assert!(!taken.redelivered());
    // Never settled, never given back: its connection stays open too.
    std::mem::forget(taken);
    drop(first);

    let consumer = consumer_with(&pool, Applier::default());
    let mut second = subscribe(&broker).await;
    let again = next(&mut second, "the unsettled message again").await;
    assert_eq!(again.message().id(), "stuck");
    assert!(again.redelivered(), "JetStream counts the deliveries");
    assert_eq!(
        consumer.process(again).await.expect("process"),
        Processed::Applied
    );
    assert_eq!(DB::applied(&pool).await, ["stuck"]);
    assert_eq!(broker.waiting(CONSUMER).await, 0, "acknowledged");
}

/// NATS only: the stream is created with the replicas a single server can hold (one), and a
/// topic named like the dead letters is refused.
async fn nats_the_stream_is_created_with_one_replica_per_server_and_dead_topics_are_refused<
    DB: EventBackend,
>(
    pool: Pool<DB>,
) {
    DB::prepare_events(&pool).await;
    let broker = TestBroker::new(BrokerKind::Nats);
    let nats = broker.nats();
    assert!(
        matches!(
            broker
                .publisher()
                .publish(&[Message::new("x", "dead.payment", "{}")])
                .await,
            Err(BrokerError::Invalid(_))
        ),
        "a topic in the dead letters' subjects is refused"
    );
    broker.declare(CONSUMER).await;
    let (_client, jetstream) = nats.connect().await.expect("connect");
    let info = jetstream
        .get_stream(nats.stream())
        .await
        .expect("the stream")
        .get_info()
        .await
        .expect("stream info");
    assert_eq!(info.config.num_replicas, 1);
    assert_eq!(info.config.subjects, [format!("{}.>", broker.name())]);
}

/// Each NATS-only test on both databases, as `<database>_<name>`.
macro_rules! nats_on_both_databases {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            #[sqlx::test(migrations = false)]
            async fn postgres(
                _: sqlx::postgres::PgPoolOptions,
                connect: sqlx::postgres::PgConnectOptions,
            ) {
                super::$name(super::postgres_pool(connect).await).await;
            }

            #[tokio::test]
            async fn sqlite() {
                let dir = tempfile::tempdir().expect("a temporary directory");
                super::$name(super::sqlite_pool(&dir).await).await;
            }

            #[tokio::test]
            async fn mysql() {
                super::on_mysql(super::$name).await;
            }
        }
    )*};
}

nats_on_both_databases!(
    nats_an_event_the_relay_publishes_again_is_stored_delivered_and_applied_once,
    nats_a_message_left_unsettled_is_delivered_again_after_the_ack_wait,
    nats_the_stream_is_created_with_one_replica_per_server_and_dead_topics_are_refused,
);

/// The cluster: the stream a relay or a consumer creates has one replica per server (three),
/// unless the replicas are set.
#[tokio::test]
#[ignore = "needs the NATS cluster of scripts/nats-cluster (NATS_CLUSTER_DIR); scripts/test runs it"]
async fn cluster_the_stream_is_created_with_three_replicas_on_three_servers() {
    let cluster = NatsCluster::from_env();
    for (replicas, expected) in [(None, 3), (Some(1), 1)] {
        let broker = TestBroker::at(BrokerKind::Nats, &cluster.node_url("n1"));
        let mut nats = events::nats::Nats::new(cluster.url(), broker.name()).expect("the URLs");
        if let Some(replicas) = replicas {
            nats = nats.with_replicas(replicas);
        }
        nats.subscriber(CONSUMER)
            .declare()
            .await
            .expect("declare the stream and the consumer");
        let (_client, jetstream) = nats.connect().await.expect("connect");
        let info = jetstream
            .get_stream(nats.stream())
            .await
            .expect("the stream")
            .get_info()
            .await
            .expect("stream info");
        assert_eq!(info.config.num_replicas, expected, "{replicas:?}");
        let placed = info.cluster.expect("the stream's cluster info");
        assert!(placed.leader.is_some(), "the stream has a leader");
        assert_eq!(placed.replicas.len(), expected - 1, "the other replicas");
    }
}

/// The cluster: while a relay publishes and a consumer applies, the server holding the
/// consumer's connection is killed with SIGKILL, then (after starting it again) the one holding
/// the relay's: both reconnect to the others, and every event is applied exactly once.
async fn cluster_a_node_killed_while_events_flow_loses_and_repeats_nothing<DB: EventBackend>(
    pool: Pool<DB>,
) {
    DB::prepare_events(&pool).await;
    let cluster = NatsCluster::from_env();
    for node in NATS_NODES {
        assert!(cluster.alive(node), "{node} is not running");
    }
    let broker = TestBroker::at(BrokerKind::Nats, &cluster.node_url("n1")).used_by(CONSUMER);
    let nats = events::nats::Nats::new(cluster.url(), broker.name()).expect("the URLs");
    let subscriber = nats.subscriber(CONSUMER).with_ack_wait(CLUSTER_ACK_WAIT);
    subscriber.declare().await.expect("declare");
    let shutdown = CancellationToken::new();
    let relay = Relay::new(
        pool.clone(),
        nats.publisher(),
        RelayOptions::default()
            .with_poll(Duration::from_millis(10))
            .with_max_backoff(Duration::from_millis(500)),
    )
    .spawn(shutdown.clone());
    let consumer = events::Consumer::new(
        pool.clone(),
        Applier::default(),
        ConsumerOptions::new(CONSUMER).with_max_backoff(Duration::from_millis(500)),
    )
    .with_subscriber(subscriber)
    .spawn(shutdown.clone());

    let mut expected = Vec::new();
    let mut seq = 0;
    for role in [
        format!("idem-events consumer {CONSUMER} {}", nats.stream()),
        format!("idem-events relay {}", nats.stream()),
    ] {
        // Events flow: some are applied, some wait in the outbox or the stream.
        let before = expected.len();
        for _ in 0..30 {
            expected.push(enqueue_committed(&pool, "payment.succeeded", seq).await);
            seq += 1;
        }
        wait_until("a third of the batch applied", || async {
            DB::applied(&pool).await.len() >= before + 10
        })
        .await;
        let victim = cluster.holder_within(&role).await;
        let guard = cluster.restart_on_drop(victim);
        cluster.kill(victim).await;
        for _ in 0..30 {
            expected.push(enqueue_committed(&pool, "payment.succeeded", seq).await);
            seq += 1;
        }
        wait_until(
            &format!("every event applied after {victim} was killed"),
            || async { DB::applied(&pool).await.len() >= expected.len() },
        )
        .await;
        let now = cluster.holder(&role).await;
        assert!(
            now.is_some_and(|node| node != victim),
            "`{role}` reconnected to another server: {now:?}"
        );
        cluster.restart(victim).await;
        drop(guard);
    }
    shutdown.cancel();
    relay.await.expect("the relay stops");
    consumer.await.expect("the consumer stops");
    let mut applied = DB::applied(&pool).await;
    applied.sort();
    expected.sort();
    assert_eq!(applied, expected, "every event applied exactly once");
}

#[sqlx::test(migrations = false)]
#[ignore = "needs the NATS cluster of scripts/nats-cluster (NATS_CLUSTER_DIR); scripts/test runs it"]
async fn cluster_postgres_a_node_killed_while_events_flow_loses_and_repeats_nothing(
    _: sqlx::postgres::PgPoolOptions,
    connect: sqlx::postgres::PgConnectOptions,
) {
    cluster_a_node_killed_while_events_flow_loses_and_repeats_nothing(postgres_pool(connect).await)
        .await;
}

#[tokio::test]
#[ignore = "needs the NATS cluster of scripts/nats-cluster (NATS_CLUSTER_DIR); scripts/test runs it"]
async fn cluster_sqlite_a_node_killed_while_events_flow_loses_and_repeats_nothing() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    cluster_a_node_killed_while_events_flow_loses_and_repeats_nothing(sqlite_pool(&dir).await)
        .await;
}
