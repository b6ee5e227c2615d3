//! A Redis server of the test's own, on a loopback port, that the test can kill with SIGKILL
//! and start again on the same port: a broker restart that no other test sees. It keeps
//! nothing on disk, so a restart loses its streams, as a Redis without persistence does.

use std::process::{Child, Command, Stdio};

/// The server process and its port.
#[derive(Debug)]
pub struct RedisServer {
    port: u16,
    process: Option<Child>,
}

impl RedisServer {
    /// Starts `redis-server` on a free loopback port and waits until it answers.
    ///
    /// # Panics
    ///
    /// If `redis-server` is not installed (the restart tests need the binary, not only a
    /// server somewhere), or it does not answer within a minute.
    pub async fn start() -> Self {
        // Reserved, not learnt from a closed socket: the port must stay free between the
        // server's kill and its restart.
        let port = crate::reserve_port();
        let mut server = Self {
            port,
            process: None,
        };
        server.restart().await;
        server
    }

    /// `redis://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Kills the server with SIGKILL and waits for it to be gone.
    pub fn kill(&mut self) {
        if let Some(mut process) = self.process.take() {
            process.kill().expect("SIGKILL redis-server");
            process.wait().expect("reap redis-server");
        }
    }

    /// Starts the server again on the same port (after [`RedisServer::kill`]) and waits until
    /// it answers.
    pub async fn restart(&mut self) {
        self.kill();
        let process = Command::new("redis-server")
            .args(["--port", &self.port.to_string()])
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .spawn()
            .expect("start redis-server: the Redis restart tests need it installed (Debian: apt-get install redis-server)");
        self.process = Some(process);
        let client = redis::Client::open(self.url()).expect("a Redis URL");
        crate::wait_until(
            &format!("redis-server on port {} to answer", self.port),
            || async {
                let Ok(mut conn) = client.get_multiplexed_async_connection().await else {
                    return false;
                };
                let pong: Result<String, _> = redis::cmd("PING").query_async(&mut conn).await;
                pong.is_ok()
            },
        )
        .await;
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}
