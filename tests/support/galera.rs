//! The three-node MariaDB Galera cluster of `scripts/galera up DIR`, as the `cluster_galera_`
//! tests of the library and of the example see it: its nodes' pids and client URLs are files in
//! `DIR`, which `$GALERA_CLUSTER_DIR` names. Those tests are ignored in the suite; scripts/test
//! runs them one at a time against such a cluster.

use sqlx::{Connection, MySqlConnection, mysql::MySqlConnectOptions};

use crate::{ClusterDir, wait_until};

/// The cluster's nodes.
pub const GALERA_NODES: [&str; 3] = ["n1", "n2", "n3"];

/// The cluster `$GALERA_CLUSTER_DIR` names; its nodes' files through [`ClusterDir`].
#[derive(Debug)]
pub struct GaleraCluster {
    nodes: ClusterDir,
}

impl std::ops::Deref for GaleraCluster {
    type Target = ClusterDir;

    fn deref(&self) -> &ClusterDir {
        &self.nodes
    }
}

impl GaleraCluster {
    /// The cluster in `$GALERA_CLUSTER_DIR`.
    ///
    /// # Panics
    ///
    /// When `$GALERA_CLUSTER_DIR` is unset.
    pub fn from_env() -> Self {
        Self {
            nodes: ClusterDir::from_env("GALERA_CLUSTER_DIR", "scripts/galera"),
        }
    }

    /// How to connect to `database` at `node`.
    pub fn options(&self, node: &str, database: &str) -> MySqlConnectOptions {
        let url = self.node_url(node);
        url.parse::<MySqlConnectOptions>()
            .unwrap_or_else(|e| panic!("{node}'s URL {url}: {e}"))
            .database(database)
    }

    /// `mysql://…/<database>` at `node`, as a service's `DATABASE_URL`.
    pub fn database_url(&self, node: &str, database: &str) -> String {
        format!("{}/{database}", self.node_url(node))
    }

    /// Waits until `node` has applied every transaction the cluster had committed when the call
    /// began: its `wsrep_last_committed` reaches the highest of the running nodes' (a node's
    /// own commits count there at once, another node's once applied), within [`DEADLINE`](crate::DEADLINE).
    ///
    /// # Panics
    ///
    /// When `node` does not answer, or does not catch up within [`DEADLINE`](crate::DEADLINE).
    pub async fn caught_up(&self, node: &str) {
        let mut target = 0;
        for other in GALERA_NODES {
            if self.alive(other) {
                target = target.max(self.last_committed(other).await);
            }
        }
        wait_until(
            &format!("{node} to apply the cluster's commits up to {target}"),
            || async { self.last_committed(node).await >= target },
        )
        .await;
    }

    /// `node`'s `wsrep_last_committed`: the seqno of the last write set it committed.
    async fn last_committed(&self, node: &str) -> u64 {
        let url = self.node_url(node);
        let mut conn = MySqlConnection::connect(&url)
            .await
            .unwrap_or_else(|e| panic!("connect to {node} at {url}: {e}"));
        let seqno: String = sqlx::query_scalar(
            "SELECT VARIABLE_VALUE FROM information_schema.GLOBAL_STATUS \
             WHERE VARIABLE_NAME = 'WSREP_LAST_COMMITTED'",
        )
        .fetch_one(&mut conn)
        .await
        .unwrap_or_else(|e| panic!("wsrep_last_committed at {node}: {e}"));
        let _ = conn.close().await;
        seqno
            .parse()
            .unwrap_or_else(|e| panic!("wsrep_last_committed at {node} is {seqno:?}: {e}"))
    }
}
