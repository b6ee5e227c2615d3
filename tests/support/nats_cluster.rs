//! The three-node NATS cluster of `scripts/nats-cluster up DIR`, as the `cluster_` tests of the
//! library and of the example see it: its servers' pids, URLs and monitoring ports are files in
//! `DIR`, which `$NATS_CLUSTER_DIR` names. Those tests are ignored in the suite; scripts/test
//! runs them one at a time against such a cluster.

use std::time::Duration;

use tokio::time::Instant;

use crate::{DEADLINE, wait_until};

/// The cluster's servers.
pub const NATS_NODES: [&str; 3] = ["n1", "n2", "n3"];

/// How long a cluster test's NATS consumer leaves a message unsettled before it comes back.
pub const CLUSTER_ACK_WAIT: Duration = Duration::from_secs(2);

/// The cluster `$NATS_CLUSTER_DIR` names.
#[derive(Debug)]
pub struct NatsCluster {
    dir: std::path::PathBuf,
    /// The three client URLs, comma-separated.
    url: String,
}

impl NatsCluster {
    /// The cluster in `$NATS_CLUSTER_DIR`.
    ///
    /// # Panics
    ///
    /// When `$NATS_CLUSTER_DIR` is unset or names no directory of `scripts/nats-cluster up`.
    pub fn from_env() -> Self {
        let dir = std::env::var("NATS_CLUSTER_DIR").expect(
            "NATS_CLUSTER_DIR names the directory of `scripts/nats-cluster up DIR` (the cluster \
             tests run against it)",
        );
        let dir = std::path::PathBuf::from(dir);
        let env = std::fs::read_to_string(dir.join("env")).expect("the cluster's env file");
        let url = env
            .lines()
            .find_map(|line| line.strip_prefix("NATS_URL="))
            .expect("NATS_URL in the cluster's env file")
            .to_owned();
        Self { dir, url }
    }

    /// The three client URLs, comma-separated (as `$NATS_URL` takes them).
    pub fn url(&self) -> &str {
        &self.url
    }

    fn file(&self, node: &str, what: &str) -> String {
        std::fs::read_to_string(self.dir.join(format!("{node}.{what}")))
            .unwrap_or_else(|error| panic!("{node}.{what}: {error}"))
            .trim()
            .to_owned()
    }

    /// The client URL of `node`.
    pub fn node_url(&self, node: &str) -> String {
        self.file(node, "url")
    }

    fn pid(&self, node: &str) -> u32 {
        self.file(node, "pid").parse().expect("a pid")
    }

    /// Whether `node`'s process runs (a zombie, reaped by no one yet, has no command line).
    pub fn alive(&self, node: &str) -> bool {
        std::fs::read(format!("/proc/{}/cmdline", self.pid(node)))
            .is_ok_and(|cmdline| !cmdline.is_empty())
    }

    /// The server whose monitoring lists a client connection named `name`.
    pub async fn holder(&self, name: &str) -> Option<&'static str> {
        for node in NATS_NODES {
            if !self.alive(node) {
                continue;
            }
            let url = format!(
                "http://127.0.0.1:{}/connz?limit=1024",
                self.file(node, "monitor")
            );
            let Ok(reply) = reqwest::get(&url).await else {
                continue;
            };
            let Ok(connz) = reply.json::<serde_json::Value>().await else {
                continue;
            };
            let holds = connz["connections"]
                .as_array()
                .is_some_and(|all| all.iter().any(|c| c["name"] == name));
            if holds {
                return Some(node);
            }
        }
        None
    }

    /// The server holding the connection `name`, once one lists it (within [`DEADLINE`]).
    pub async fn holder_within(&self, name: &str) -> &'static str {
        let deadline = Instant::now() + DEADLINE;
        loop {
            if let Some(node) = self.holder(name).await {
                return node;
            }
            assert!(
                Instant::now() < deadline,
                "no server lists the connection `{name}` within {DEADLINE:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// SIGKILL to `node`, and waits until its process is gone.
    pub async fn kill(&self, node: &str) {
        let pid = self.pid(node);
        let status = std::process::Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -KILL {pid} ({node})");
        wait_until(&format!("{node} ({pid}) gone after SIGKILL"), || async {
            !self.alive(node)
        })
        .await;
    }

    /// Starts `node` again (scripts/nats-cluster restart), which waits until the cluster has
    /// a meta leader.
    pub async fn restart(&self, node: &str) {
        let status = tokio::process::Command::new(script())
            .arg("restart")
            .arg(&self.dir)
            .arg(node)
            .status()
            .await
            .expect("run scripts/nats-cluster restart");
        assert!(status.success(), "scripts/nats-cluster restart {node}");
    }

    /// A guard that starts `node` again when dropped, if it is not running then: take one
    /// before killing it.
    pub fn restart_on_drop(&self, node: &'static str) -> RestartOnDrop<'_> {
        RestartOnDrop {
            cluster: self,
            node,
        }
    }
}

/// scripts/nats-cluster.
fn script() -> &'static str {
    concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/nats-cluster")
}

/// Starts a killed server again when dropped, if the test did not: a test that fails after its
/// kill leaves the cluster whole for the next one.
#[derive(Debug)]
pub struct RestartOnDrop<'a> {
    cluster: &'a NatsCluster,
    node: &'static str,
}

impl Drop for RestartOnDrop<'_> {
    fn drop(&mut self) {
        if self.cluster.alive(self.node) {
            return;
        }
        let restarted = std::process::Command::new(script())
            .arg("restart")
            .arg(&self.cluster.dir)
            .arg(self.node)
            .status();
        if !restarted.as_ref().is_ok_and(|status| status.success()) {
            eprintln!("{} could not be started again: {restarted:?}", self.node);
        }
    }
}
