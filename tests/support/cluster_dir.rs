//! The directory a cluster script (`scripts/nats-cluster`, `scripts/galera`) keeps its servers
//! in: a file per server and fact (`n1.pid`, `n1.url`, …), read by the cluster tests, which
//! kill a server and start it again through the script.

use std::path::{Path, PathBuf};

use crate::wait_until;

/// The servers of a cluster that `script up DIR` started, as the files in `DIR` describe them.
#[derive(Debug)]
pub struct ClusterDir {
    dir: PathBuf,
    /// The script that started them, which `restart` runs.
    script: &'static str,
}

impl ClusterDir {
    /// The cluster in the directory `$variable` names, started by `script` (a path from the
    /// repository's root, such as `scripts/galera`).
    ///
    /// # Panics
    ///
    /// When `$variable` is unset.
    pub fn from_env(variable: &str, script: &'static str) -> Self {
        let dir = std::env::var(variable).unwrap_or_else(|_| {
            panic!("{variable} names the directory of `{script} up DIR` (the cluster tests run against it)")
        });
        Self {
            dir: PathBuf::from(dir),
            script,
        }
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// The contents of `DIR/<node>.<what>`, trimmed.
    ///
    /// # Panics
    ///
    /// When the file cannot be read.
    pub fn file(&self, node: &str, what: &str) -> String {
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

    /// Starts `node` again (`script restart DIR node`), which waits until it has rejoined.
    pub async fn restart(&self, node: &str) {
        let status = tokio::process::Command::new(self.script_path())
            .arg("restart")
            .arg(&self.dir)
            .arg(node)
            .status()
            .await
            .unwrap_or_else(|e| panic!("run {} restart: {e}", self.script));
        assert!(status.success(), "{} restart {node}", self.script);
    }

    /// A guard that starts `node` again when dropped, if it is not running then: take one
    /// before killing it.
    pub fn restart_on_drop(&self, node: &'static str) -> RestartOnDrop<'_> {
        RestartOnDrop {
            cluster: self,
            node,
        }
    }

    fn script_path(&self) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join(self.script)
    }
}

/// Starts a killed server again when dropped, if the test did not: a test that fails after its
/// kill leaves the cluster whole for the next one.
#[derive(Debug)]
pub struct RestartOnDrop<'a> {
    cluster: &'a ClusterDir,
    node: &'static str,
}

impl Drop for RestartOnDrop<'_> {
    fn drop(&mut self) {
        if self.cluster.alive(self.node) {
            return;
        }
        let restarted = std::process::Command::new(self.cluster.script_path())
            .arg("restart")
            .arg(&self.cluster.dir)
            .arg(self.node)
            .status();
        if !restarted.as_ref().is_ok_and(|status| status.success()) {
            eprintln!("{} could not be started again: {restarted:?}", self.node);
        }
    }
}
