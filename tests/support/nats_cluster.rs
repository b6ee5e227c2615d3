//! The three-node NATS cluster of `scripts/nats-cluster up DIR`, as the `cluster_` tests of the
//! library and of the example see it: its servers' pids, URLs and monitoring ports are files in
//! `DIR`, which `$NATS_CLUSTER_DIR` names. Those tests are ignored in the suite; scripts/test
//! runs them one at a time against such a cluster.

use std::time::Duration;

use tokio::time::Instant;

use crate::{ClusterDir, DEADLINE};

/// The cluster's servers.
pub const NATS_NODES: [&str; 3] = ["n1", "n2", "n3"];

/// How long a cluster test's NATS consumer leaves a message unsettled before it comes back.
pub const CLUSTER_ACK_WAIT: Duration = Duration::from_secs(2);

/// The cluster `$NATS_CLUSTER_DIR` names; its servers' files through [`ClusterDir`].
#[derive(Debug)]
pub struct NatsCluster {
    servers: ClusterDir,
    /// The three client URLs, comma-separated.
    url: String,
}

impl std::ops::Deref for NatsCluster {
    type Target = ClusterDir;

    fn deref(&self) -> &ClusterDir {
        &self.servers
    }
}

impl NatsCluster {
    /// The cluster in `$NATS_CLUSTER_DIR`.
    ///
    /// # Panics
    ///
    /// When `$NATS_CLUSTER_DIR` is unset or names no directory of `scripts/nats-cluster up`.
    pub fn from_env() -> Self {
        let servers = ClusterDir::from_env("NATS_CLUSTER_DIR", "scripts/nats-cluster");
        let env =
            std::fs::read_to_string(servers.path().join("env")).expect("the cluster's env file");
        let url = env
            .lines()
            .find_map(|line| line.strip_prefix("NATS_URL="))
            .expect("NATS_URL in the cluster's env file")
            .to_owned();
        Self { servers, url }
    }

    /// The three client URLs, comma-separated (as `$NATS_URL` takes them).
    pub fn url(&self) -> &str {
        &self.url
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
}
