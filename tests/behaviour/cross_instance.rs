//! Several instances of the service over one database, as behind a load balancer: each has its
//! own pool, store and held keys, so only the database can tell one instance that another runs
//! the key. On PostgreSQL that is the claim's advisory lock (a duplicate is refused at once);
//! on SQLite it is the single write lock (a duplicate waits for it, then replays).

use std::sync::atomic::Ordering;

use axum::http::StatusCode;
use idem_runtime::ProblemKind;
use idem_tests::{App, Reply, Req, backend_tests, entry, until_called, until_in_flight};

fn slow(key: &str) -> Req {
    Req::post("/test/slow").tenant("t1").key(key)
}

fn send(app: &App, request: Req) -> tokio::task::JoinHandle<Reply> {
    let app = app.clone();
    tokio::spawn(async move { app.send(request.build()).await })
}

/// Handler runs of `/test/slow` over every instance.
fn slow_runs(apps: &[App]) -> usize {
    apps.iter()
        .map(|app| app.calls.slow.load(Ordering::SeqCst))
        .sum()
}

/// Waits for every reply, failing as soon as a second handler run shows up instead.
async fn replies_while_one_runs(
    apps: &[App],
    pending: Vec<tokio::task::JoinHandle<Reply>>,
) -> Vec<Reply> {
    let replies = async {
        let mut replies = Vec::new();
        for reply in pending {
            replies.push(reply.await.expect("request task"));
        }
        replies
    };
    let second_run = idem_tests::wait_until("a second run of the handler", || async {
        slow_runs(apps) > 1
    });
    tokio::select! {
        replies = replies => replies,
        () = second_run => panic!("a duplicate ran the handler while the first still held the key"),
    }
}

/// How many replies carry an execution (a 201 that is not a replay); every other reply must be
/// a 409 or a replay.
async fn executions(pending: Vec<tokio::task::JoinHandle<Reply>>) -> usize {
    let mut executed = 0;
    for reply in pending {
        let reply = reply.await.expect("request task");
        match reply.status {
            StatusCode::CREATED if !reply.replayed() => executed += 1,
            StatusCode::CREATED | StatusCode::CONFLICT => {}
            other => panic!("unexpected {other}: {:?}", reply.body),
        }
    }
    executed
}

backend_tests! {
    async fn a_duplicate_at_another_instance_does_not_run_the_handler(db) {
        let a = App::new(db).await;
        let b = a.sibling().await;
        let first = send(&a, slow("k1"));
        until_called(&a.calls.slow, 1).await;
        assert_eq!(b.keys_in_flight(), 0, "the second instance knows nothing of the key");

        let duplicate = send(&b, slow("k1"));
        if !a.is_single_writer() {
            // Refused by the database at once, while the first request still runs.
            let replies = replies_while_one_runs(&[a.clone(), b.clone()], vec![duplicate]).await;
            assert_eq!(
                replies[0].problem(StatusCode::CONFLICT),
                ProblemKind::InProgress.type_uri()
            );
            assert_eq!(replies[0].header("retry-after"), Some("1"));
            assert!(!first.is_finished(), "the 409 came while the first request ran");
            a.gate.add_permits(1);
            assert_eq!(first.await.unwrap().status, StatusCode::CREATED);
        } else {
            // SQLite: the duplicate waits for the single write lock the first holds, then
            // finds the stored outcome. (The test cannot see it wait inside SQLite; it sees it
            // hold the key in its own process.)
            until_in_flight(&b, 1).await;
            a.gate.add_permits(1);
            let first = first.await.unwrap();
            assert_eq!(first.status, StatusCode::CREATED);
            let both = [a.clone(), b.clone()];
            let duplicate = replies_while_one_runs(&both, vec![duplicate]).await.remove(0);
            assert!(duplicate.replayed(), "{}: {:?}", duplicate.status, duplicate.body);
            assert_eq!(duplicate.body, first.body);
        }
        assert_eq!(slow_runs(&[a.clone(), b.clone()]), 1);
        for app in [&a, &b] {
            let replay = app.send(slow("k1").build()).await;
            assert!(replay.replayed(), "every instance replays the outcome");
        }
        assert_eq!(a.count("test_effects").await, 1);
    }

    async fn duplicates_racing_over_four_instances_run_the_handler_once(db) {
        let first = App::new(db).await;
        let mut apps = vec![first.clone()];
        for _ in 0..3 {
            apps.push(first.sibling().await);
        }
        // Ten requests with one key at each instance, all at once.
        let pending: Vec<_> = (0..40).map(|i| send(&apps[i % 4], slow("race"))).collect();
        idem_tests::wait_until("one instance running the handler", || async {
            slow_runs(&apps) >= 1
        })
        .await;
        let winner = apps
            .iter()
            .position(|app| app.calls.slow.load(Ordering::SeqCst) == 1)
            .expect("one instance runs the handler");
        if !first.is_single_writer() {
            // Every duplicate, at every instance, is refused while the winner runs; the
            // winner's own reply waits for the gate.
            let (winners, duplicates): (Vec<_>, Vec<_>) = pending
                .into_iter()
                .enumerate()
                .partition(|(i, _)| i % 4 == winner);
            let duplicates = duplicates.into_iter().map(|(_, reply)| reply).collect();
            for reply in replies_while_one_runs(&apps, duplicates).await {
                assert_eq!(reply.status, StatusCode::CONFLICT, "{:?}", reply.body);
            }
            apps[winner].gate.add_permits(1);
            // At the winner's instance, a request that was still on its way when the handler
            // finished gets the replay: one reply executed, the others 409 or the replay.
            let winners = winners.into_iter().map(|(_, reply)| reply).collect();
            assert_eq!(executions(winners).await, 1, "one reply carries the execution");
        } else {
            apps[winner].gate.add_permits(1);
            assert_eq!(executions(pending).await, 1, "one reply carries the execution");
        }
        assert_eq!(slow_runs(&apps), 1, "the handler ran once over all instances");
        assert_eq!(first.count("test_effects").await, 1);
        let settled = apps[winner].send(slow("race").build()).await;
        for app in &apps {
            let replay = app.send(slow("race").build()).await;
            assert!(replay.replayed(), "{}: {:?}", replay.status, replay.body);
            assert_eq!(replay.body, settled.body);
        }
    }

    async fn entries_racing_over_three_instances_make_one_entry(db) {
        let first = App::new(db).await;
        let mut apps = vec![first.clone()];
        for _ in 0..2 {
            apps.push(first.sibling().await);
        }
        let body = entry(100, "n1");
        let pending: Vec<_> = (0..30)
            .map(|i| send(&apps[i % 3], Req::post("/test/entries").tenant("t1").key("race").json(&body)))
            .collect();
        let mut executions = Vec::new();
        for reply in pending {
            let reply = reply.await.unwrap();
            match reply.status {
                StatusCode::CREATED if !reply.replayed() => executions.push(reply),
                StatusCode::CREATED | StatusCode::CONFLICT => {}
                other => panic!("unexpected {other}: {}", String::from_utf8_lossy(&reply.body)),
            }
        }
        assert_eq!(executions.len(), 1, "one request wrote the entry");
        assert_eq!(first.count("test_entries").await, 1);
        for app in &apps {
            let replay = app
                .send(Req::post("/test/entries").tenant("t1").key("race").json(&body).build())
                .await;
            assert!(replay.replayed());
            assert_eq!(replay.body, executions[0].body);
        }
    }

    async fn an_external_claim_at_another_instance_is_409_with_the_lease_left(db) {
        let a = App::new(db).await;
        let b = a.sibling().await;
        let request = || Req::post("/test/external-slow").tenant("t1").key("x1");
        let first = send(&a, request());
        until_called(&a.calls.external, 1).await;
        // A minute of lease, so that a slow machine cannot let the 5 s one run out first.
        a.renew_lease("x1").await;
        let duplicate = b.send(request().build()).await;
        assert_eq!(
            duplicate.problem(StatusCode::CONFLICT),
            ProblemKind::InProgress.type_uri()
        );
        let retry_after: u64 = duplicate.header("retry-after").unwrap().parse().unwrap();
        assert!((50..=60).contains(&retry_after), "the lease's remainder: {retry_after}");
        assert_eq!(b.calls.external.load(Ordering::SeqCst), 0);
        a.gate.add_permits(1);
        let first = first.await.unwrap();
        assert_eq!(first.status, StatusCode::CREATED);
        let replay = b.send(request().build()).await;
        assert!(replay.replayed());
        assert_eq!(replay.body, first.body);
    }
}
