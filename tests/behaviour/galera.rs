//! Two instances of the service on two nodes of a MariaDB Galera cluster, a duplicate at each.
//! Nothing of the claim is shared across nodes but the rows: at its own node each duplicate
//! claims its own copy of the key and runs. The first to commit wins; the cluster aborts the
//! other, whose rows it wrote too, and idem answers that one 409 with `Retry-After`: never a
//! 500, and its retry replays the winner's outcome.
//!
//! The tests need the cluster of `scripts/galera up DIR` (`$GALERA_CLUSTER_DIR`): they are
//! ignored in the suite, and scripts/test runs them once against a cluster of their own.

use std::sync::atomic::AtomicUsize;

use axum::http::StatusCode;
use idem_runtime::ProblemKind;
use idem_tests::{App, Calls, GaleraCluster, MySqlDb, Req, TestDb, until_called};

#[tokio::test]
#[ignore = "needs the Galera cluster of scripts/galera (GALERA_CLUSTER_DIR); scripts/test runs it"]
async fn cluster_a_duplicate_aborted_by_another_nodes_commit_mid_handler_is_409_and_replays_it() {
    // The aborted handler's next statement fails, and it answers 500 with the error.
    loser_at_one_node_winner_at_another("/test/slow-then-write", |calls| &calls.slow_then_write)
        .await;
}

#[tokio::test]
#[ignore = "needs the Galera cluster of scripts/galera (GALERA_CLUSTER_DIR); scripts/test runs it"]
async fn cluster_a_duplicate_aborted_by_another_nodes_commit_before_completion_is_409_and_replays_it()
 {
    // The aborted handler runs no statement after the abort: idem's completion finds it.
    loser_at_one_node_winner_at_another("/test/slow", |calls| &calls.slow).await;
}

/// Request `a` claims the key at n1 and waits in its handler; its duplicate `b` at n2, which
/// cannot see `a`'s uncommitted row, claims the key there, runs and commits. Once n1 has applied
/// `b`'s commit, `a`'s handler goes on.
async fn loser_at_one_node_winner_at_another(
    route: &'static str,
    runs: fn(&Calls) -> &AtomicUsize,
) {
    let cluster = GaleraCluster::from_env();
    let database = MySqlDb::create_on(&cluster.node_url("n1")).await;
    let name = database.name().to_owned();
    {
        let a = App::new(TestDb::MySql(Box::new(database))).await;
        // The tables and the migrations' records are at n2 before an instance starts there.
        cluster.caught_up("n2").await;
        let b = a.sibling_at(cluster.options("n2", &name)).await;
        let request = || Req::post(route).tenant("t1").key("k1").build();

        let first = tokio::spawn({
            let a = a.clone();
            async move { a.send(request()).await }
        });
        until_called(runs(&a.calls), 1).await;
        b.gate.add_permits(1);
        let second = b.send(request()).await;
        assert_eq!(second.status, StatusCode::CREATED, "{:?}", second.body);
        assert!(
            !second.replayed(),
            "the duplicate at n2 ran: it saw nothing of n1's claim"
        );

        // n1 applies b's commit, and aborts a's transaction, which wrote the same key.
        cluster.caught_up("n1").await;
        a.gate.add_permits(1);
        let first = first.await.expect("request task");
        assert_eq!(
            first.problem(StatusCode::CONFLICT),
            ProblemKind::InProgress.type_uri(),
            "{:?}",
            first.body
        );
        assert_eq!(first.header("retry-after"), Some("1"));
        if route == "/test/slow-then-write" {
            // Told by the handler's own statement, not by a refused COMMIT.
            let detail = first.json()["detail"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            assert!(
                detail.contains("the database rolled the transaction back"),
                "{detail}"
            );
        }

        let retry = a.send(request()).await;
        assert_eq!(retry.status, StatusCode::CREATED);
        assert!(retry.replayed(), "the retry at n1 replays n2's outcome");
        assert_eq!(retry.body, second.body);
        assert_eq!(a.keys_named("k1").await, 1);
        let effects = b.count("test_effects").await;
        cluster.caught_up("n1").await;
        assert_eq!(
            a.count("test_effects").await,
            effects,
            "n1 holds b's writes and nothing of a's"
        );
    }
    MySqlDb::drop_named_on(&cluster.node_url("n1"), &name).await;
}

/// External mode commits its claim before the handler runs: duplicates of a key started at
/// several nodes at once are decided by that commit, and only its winner runs the handler. A
/// start that loses at commit (another node's start of the key certified first) is a 409, like
/// one that finds the key held.
#[tokio::test]
#[ignore = "needs the Galera cluster of scripts/galera (GALERA_CLUSTER_DIR); scripts/test runs it"]
async fn cluster_external_starts_spread_over_three_nodes_run_each_key_once() {
    const KEYS: usize = 20;
    const DUPLICATES: usize = 6;
    let cluster = GaleraCluster::from_env();
    let database = MySqlDb::create_on(&cluster.node_url("n1")).await;
    let name = database.name().to_owned();
    {
        let first = App::new(TestDb::MySql(Box::new(database))).await;
        let mut apps = vec![first.clone()];
        for node in ["n2", "n3"] {
            cluster.caught_up(node).await;
            apps.push(first.sibling_at(cluster.options(node, &name)).await);
        }
        for app in &apps {
            // The handler's first call at each instance waits for its gate: open it.
            app.gate.add_permits(1);
        }
        let request = |k: usize| {
            Req::post("/test/external-slow")
                .tenant("t1")
                .key(&format!("x{k}"))
                .build()
        };
        let mut pending = Vec::new();
        for k in 0..KEYS {
            for d in 0..DUPLICATES {
                let app = apps[d % apps.len()].clone();
                pending.push(tokio::spawn(async move { (k, app.send(request(k)).await) }));
            }
        }
        for reply in pending {
            let (k, reply) = reply.await.expect("request task");
            assert!(
                matches!(reply.status, StatusCode::CREATED | StatusCode::CONFLICT),
                "x{k}: {} {:?}",
                reply.status,
                reply.body
            );
            if reply.status == StatusCode::CONFLICT {
                assert!(
                    reply.header("retry-after").is_some(),
                    "x{k}: {:?}",
                    reply.body
                );
            }
        }
        let runs: usize = apps
            .iter()
            .map(|app| app.calls.external.load(std::sync::atomic::Ordering::SeqCst))
            .sum();
        assert_eq!(
            runs, KEYS,
            "each key's handler ran once over the three nodes"
        );
        for node in ["n1", "n2", "n3"] {
            cluster.caught_up(node).await;
        }
        for k in 0..KEYS {
            for app in &apps {
                let retry = app.send(request(k)).await;
                assert_eq!(retry.status, StatusCode::CREATED, "x{k}: {:?}", retry.body);
                assert!(
                    retry.replayed(),
                    "x{k} replays once every node has its outcome"
                );
            }
        }
    }
    MySqlDb::drop_named_on(&cluster.node_url("n1"), &name).await;
}
