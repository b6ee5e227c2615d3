//! A TCP proxy that models a network partition: on cue it stops forwarding, in both directions
//! and on every connection, and nothing is refused or closed; the bytes wait in the proxy until
//! the test heals it, and then go on in order. A client behind it sees a database (or broker)
//! that stops answering, as packets dropped on a link would make it.
//!
//! [`PartitionProxy::postgres`] reads what clients send as PostgreSQL messages (the startup
//! message without a type byte, then a type byte and a length that counts itself), so that a
//! freeze can begin at a point of a request: at the next message a [`Cue`] matches (a claim, a
//! statement, a `COMMIT`), either holding that message ([`PartitionProxy::freeze_at`]) or letting
//! it reach the server and holding everything after it, its answer included
//! ([`PartitionProxy::freeze_after`]). [`PartitionProxy::tcp`] forwards bytes as they come and
//! only freezes and heals as told, for any protocol.
//!
//! One thing does cross a freeze: a client that closes its connection while the proxy is frozen
//! abandons it. The bytes of that connection the proxy holds, both ways, are dropped (never
//! delivered) and its upstream connection is closed at once, so that the server sees its client
//! go and rolls back what it left open. This models a client whose abandoned bytes never arrive:
//! a service that gave up on a request and closed its connection cannot have that request's
//! held statement or `COMMIT` land later, when the link comes back. A connection opened while
//! frozen is accepted, and reaches upstream only once the proxy heals (or never, if abandoned
//! first). With [`PartitionProxy::lose_closes`], the close is lost in the partition too: the
//! upstream connection stays open, the server hearing nothing, until the proxy heals.
//!
//! Counters ([`PartitionProxy::held_messages`], [`PartitionProxy::held_answers`],
//! [`PartitionProxy::abandoned`], …) let a test wait for "the request is now frozen at X"
//! instead of sleeping.

use std::{
    collections::{HashMap, VecDeque},
    fmt,
    sync::{Arc, Mutex, MutexGuard},
};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{
        TcpListener, TcpStream,
        tcp::{OwnedReadHalf, OwnedWriteHalf},
    },
    sync::{Notify, watch},
};

/// The protocol codes of the untyped requests a PostgreSQL client may send before its startup
/// message proper (`SSLRequest`, `GSSENCRequest`): the message after each is untyped too.
const NEGOTIATIONS: [u32; 2] = [80_877_103, 80_877_104];

/// One message a client sent to PostgreSQL, as the proxy read it.
#[derive(Debug, Clone, Copy)]
pub struct PgMessage<'a> {
    kind: Option<u8>,
    body: &'a [u8],
    /// For a `Bind`, the SQL of the statement it binds, as that connection prepared it.
    bound: Option<&'a str>,
}

impl<'a> PgMessage<'a> {
    /// Its type byte (`b'Q'` a simple query, `b'P'` a statement prepared, `b'X'` the end…);
    /// `None` for the startup message and the other untyped requests before it.
    pub fn kind(&self) -> Option<u8> {
        self.kind
    }

    /// What follows the length.
    pub fn body(&self) -> &'a [u8] {
        self.body
    }

    /// The SQL text of a simple query (`Q`), of a statement being prepared (`P`: a name, then
    /// the text), or of the prepared statement a `Bind` (`B`) runs: a statement is prepared once
    /// per connection and run by binds from then on. `None` for any other message.
    pub fn sql(&self) -> Option<&'a str> {
        let text = match self.kind? {
            b'Q' => self.body.split(|b| *b == 0).next()?,
            b'P' => self.body.split(|b| *b == 0).nth(1)?,
            b'B' => return self.bound,
            _ => return None,
        };
        std::str::from_utf8(text).ok()
    }

    /// The name of the statement a `Parse` prepares or a `Bind` runs.
    fn statement_name(&self) -> Option<&'a [u8]> {
        match self.kind? {
            b'P' => self.body.split(|b| *b == 0).next(),
            b'B' => self.body.split(|b| *b == 0).nth(1),
            _ => None,
        }
    }

    /// Whether it is a simple query of `COMMIT` alone (as sqlx commits a transaction).
    pub fn is_commit(&self) -> bool {
        self.kind == Some(b'Q')
            && self
                .sql()
                .is_some_and(|sql| sql.trim().eq_ignore_ascii_case("COMMIT"))
    }
}

type Matcher = Box<dyn Fn(&PgMessage<'_>) -> bool + Send + Sync>;

/// Where a freeze begins: the next client message (on any connection) that matches.
pub struct Cue {
    what: String,
    matches: Matcher,
}

impl fmt::Debug for Cue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Cue").field("what", &self.what).finish()
    }
}

impl Cue {
    /// A transactional claim: the simple query that begins the transaction and tries the key's
    /// lock (it calls `pg_try_advisory_xact_lock`).
    pub fn claim() -> Self {
        Self::statement("pg_try_advisory_xact_lock")
    }

    /// A statement whose SQL contains `fragment`, sent as a simple query or prepared.
    pub fn statement(fragment: &str) -> Self {
        let fragment = fragment.to_owned();
        Self::matching(&format!("a statement containing {fragment:?}"), move |m| {
            m.sql().is_some_and(|sql| sql.contains(&fragment))
        })
    }

    /// A `COMMIT`.
    pub fn commit() -> Self {
        Self::matching("a COMMIT", |m| m.is_commit())
    }

    /// Any message `matches` accepts; `what` names it in failures.
    pub fn matching(
        what: &str,
        matches: impl Fn(&PgMessage<'_>) -> bool + Send + Sync + 'static,
    ) -> Self {
        Self {
            what: what.to_owned(),
            matches: Box::new(matches),
        }
    }
}

/// What happens to the message a cue matched.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AtCue {
    /// It is held with everything after it.
    Hold,
    /// It reaches the server (after whatever the same client sent before it); everything after
    /// it, its answer included, is held.
    Forward,
}

/// Bytes read from one side, waiting to be written to the other.
#[derive(Debug)]
struct Unit {
    bytes: Vec<u8>,
    /// Goes through although the proxy is frozen: the cued message of
    /// [`PartitionProxy::freeze_after`] and what its client sent before it.
    forced: bool,
}

/// One direction of one connection.
#[derive(Debug, Default)]
struct Pipe {
    units: VecDeque<Unit>,
    /// The side it reads from has closed: once `units` are written, so is the other side.
    ended: bool,
    wake: Arc<Notify>,
}

impl Pipe {
    fn held(&self, frozen: bool) -> usize {
        if frozen {
            self.units.iter().filter(|unit| !unit.forced).count()
        } else {
            0
        }
    }
}

/// One client's connection and the upstream connection made for it.
#[derive(Debug)]
struct Link {
    /// Client to server.
    up: Pipe,
    /// Server to client.
    down: Pipe,
    /// Set to end every task of the link at once (both sockets closed).
    kill: watch::Sender<bool>,
    /// Abandoned with its close lost: ended when the proxy heals.
    doomed: bool,
}

impl Link {
    fn end(&mut self) {
        self.kill.send_replace(true);
        self.up.wake.notify_one();
        self.down.wake.notify_one();
    }
}

#[derive(Debug)]
struct State {
    frozen: bool,
    cue: Option<(Cue, AtCue)>,
    links: HashMap<u64, Link>,
    next_id: u64,
    accepted: usize,
    abandoned: usize,
    cued: usize,
    lose_closes: bool,
}

#[derive(Debug)]
struct Shared {
    upstream: String,
    /// Reads client bytes as PostgreSQL messages (else as they come).
    postgres: bool,
    state: Mutex<State>,
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The proxy: connections to [`PartitionProxy::port`] reach the upstream server while it is not
/// frozen.
#[derive(Debug, Clone)]
pub struct PartitionProxy {
    port: u16,
    shared: Arc<Shared>,
}

impl PartitionProxy {
    /// A proxy in front of the PostgreSQL server at `upstream` (`host:port`), reading what
    /// clients send as PostgreSQL messages: it can freeze at a [`Cue`]. Clients must not use
    /// TLS (`sslmode=disable`).
    pub async fn postgres(upstream: String) -> Self {
        Self::start(upstream, true).await
    }

    /// A proxy in front of any TCP server at `upstream` (`host:port`), forwarding bytes as
    /// they come: only [`PartitionProxy::freeze`] and [`PartitionProxy::heal`].
    pub async fn tcp(upstream: String) -> Self {
        Self::start(upstream, false).await
    }

    async fn start(upstream: String, postgres: bool) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind loopback");
        let port = listener.local_addr().expect("local addr").port();
        let shared = Arc::new(Shared {
            upstream,
            postgres,
            state: Mutex::new(State {
                frozen: false,
                cue: None,
                links: HashMap::new(),
                next_id: 0,
                accepted: 0,
                abandoned: 0,
                cued: 0,
                lose_closes: false,
            }),
        });
        let accepting = Arc::clone(&shared);
        tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    return;
                };
                let _ = client.set_nodelay(true);
                let (id, killed) = {
                    let mut state = accepting.state();
                    let id = state.next_id;
                    state.next_id += 1;
                    state.accepted += 1;
                    let (kill, killed) = watch::channel(false);
                    let link = Link {
                        up: Pipe::default(),
                        down: Pipe::default(),
                        kill,
                        doomed: false,
                    };
                    state.links.insert(id, link);
                    (id, killed)
                };
                tokio::spawn(serve(Arc::clone(&accepting), id, client, killed));
            }
        });
        Self { port, shared }
    }

    /// The port to connect to.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Stops forwarding now, both ways, on every connection, open or opened later.
    pub fn freeze(&self) {
        self.shared.state().frozen = true;
    }

    /// Forwards everything held, in order, and goes on forwarding. Disarms a cue not yet met.
    pub fn heal(&self) {
        let mut state = self.shared.state();
        state.frozen = false;
        state.cue = None;
        for link in state.links.values_mut() {
            if link.doomed {
                link.up.units.clear();
                link.down.units.clear();
                link.end();
            }
            link.up.wake.notify_one();
            link.down.wake.notify_one();
        }
    }

    /// From now on, a client that closes its connection while the proxy is frozen has its
    /// close lost in the partition too: its held bytes are still dropped, but its upstream
    /// connection stays open, the server hearing nothing of it, until the proxy heals (and
    /// then closes it). A server that must notice a vanished client by itself (a timeout of its
    /// own) is tested so.
    pub fn lose_closes(&self) {
        self.shared.state().lose_closes = true;
    }

    /// Freezes, as [`PartitionProxy::freeze`], when the next client message `cue` matches
    /// arrives; that message is held, with everything after it.
    pub fn freeze_at(&self, cue: Cue) {
        self.arm(cue, AtCue::Hold);
    }

    /// Freezes when the next client message `cue` matches arrives, once that message is on
    /// its way to the server: it reaches the server (a `COMMIT` commits), and its answer and
    /// everything else after it are held.
    pub fn freeze_after(&self, cue: Cue) {
        self.arm(cue, AtCue::Forward);
    }

    fn arm(&self, cue: Cue, at: AtCue) {
        assert!(
            self.shared.postgres,
            "a cue needs PartitionProxy::postgres: this proxy does not read messages"
        );
        self.shared.state().cue = Some((cue, at));
    }

    /// Whether the proxy is frozen now.
    pub fn is_frozen(&self) -> bool {
        self.shared.state().frozen
    }

    /// How many cues were met so far.
    pub fn cued(&self) -> usize {
        self.shared.state().cued
    }

    /// Client messages (with [`PartitionProxy::tcp`]: reads of client bytes) held now.
    pub fn held_messages(&self) -> usize {
        let state = self.shared.state();
        state
            .links
            .values()
            .map(|link| link.up.held(state.frozen))
            .sum()
    }

    /// Reads of server bytes (answers) held now.
    pub fn held_answers(&self) -> usize {
        let state = self.shared.state();
        state
            .links
            .values()
            .map(|link| link.down.held(state.frozen))
            .sum()
    }

    /// Connections with bytes held now, either way.
    pub fn held_connections(&self) -> usize {
        let state = self.shared.state();
        let frozen = state.frozen;
        state
            .links
            .values()
            .filter(|link| link.up.held(frozen) + link.down.held(frozen) > 0)
            .count()
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> usize {
        self.shared.state().accepted
    }

    /// Connections open now (accepted, and not yet closed on both sides).
    pub fn open_connections(&self) -> usize {
        self.shared.state().links.len()
    }

    /// Connections whose client closed while the proxy was frozen: their held bytes were
    /// dropped and their upstream connection closed (see the module's documentation; with
    /// [`PartitionProxy::lose_closes`], closed at heal).
    pub fn abandoned(&self) -> usize {
        self.shared.state().abandoned
    }
}

/// Runs one connection until both sides are closed, or it is abandoned or broken.
async fn serve(shared: Arc<Shared>, id: u64, client: TcpStream, mut killed: watch::Receiver<bool>) {
    let (client_read, client_write) = client.into_split();
    let work = async {
        tokio::join!(read_client(&shared, id, client_read), async {
            // No upstream connection while frozen: its first packets would not get through.
            if !wait_thawed(&shared, id).await {
                return;
            }
            let Ok(server) = TcpStream::connect(&shared.upstream).await else {
                end(&shared, id);
                return;
            };
            let _ = server.set_nodelay(true);
            let (server_read, server_write) = server.into_split();
            tokio::join!(
                write(&shared, id, Side::Up, server_write),
                read_server(&shared, id, server_read),
                write(&shared, id, Side::Down, client_write),
            );
        })
    };
    tokio::select! {
        _ = work => {}
        _ = killed.wait_for(|kill| *kill) => {}
    }
    shared.state().links.remove(&id);
}

/// Ends a link: every task of it stops, both sockets close.
fn end(shared: &Shared, id: u64) {
    if let Some(link) = shared.state().links.get_mut(&id) {
        link.end();
    }
}

/// Waits until the proxy is not frozen; false if the link ended meanwhile.
async fn wait_thawed(shared: &Shared, id: u64) -> bool {
    loop {
        let wake = {
            let state = shared.state();
            let Some(link) = state.links.get(&id) else {
                return false;
            };
            if *link.kill.borrow() {
                return false;
            }
            if !state.frozen {
                return true;
            }
            Arc::clone(&link.up.wake)
        };
        wake.notified().await;
    }
}

#[derive(Debug, Clone, Copy)]
enum Side {
    Up,
    Down,
}

impl Link {
    fn pipe(&mut self, side: Side) -> &mut Pipe {
        match side {
            Side::Up => &mut self.up,
            Side::Down => &mut self.down,
        }
    }
}

/// Reads what the client sends, unit by unit, into the link's upstream pipe, meeting the cue;
/// at its end, ends the pipe, or abandons the link if the proxy is frozen.
async fn read_client(shared: &Shared, id: u64, mut client: OwnedReadHalf) {
    let mut untyped = shared.postgres;
    // The SQL of each statement this connection prepared, by name.
    let mut prepared: HashMap<Vec<u8>, String> = HashMap::new();
    loop {
        let read = if shared.postgres {
            read_message(&mut client, &mut untyped).await
        } else {
            read_chunk(&mut client).await
        };
        let mut state = shared.state();
        let state = &mut *state;
        let Some(link) = state.links.get_mut(&id) else {
            return;
        };
        let Some((bytes, kind_at)) = read else {
            if state.frozen {
                // Abandoned: what it sent and what it was sent never arrive.
                state.abandoned += 1;
                link.up.units.clear();
                link.down.units.clear();
                if state.lose_closes {
                    link.doomed = true;
                } else {
                    link.end();
                }
            } else {
                link.up.ended = true;
                link.up.wake.notify_one();
            }
            return;
        };
        let mut forced = false;
        let mut message = PgMessage {
            kind: kind_at.map(|at| bytes[at]),
            body: &bytes[kind_at.map_or(4, |at| at + 5)..],
            bound: None,
        };
        if let Some(name) = message.statement_name() {
            if message.kind == Some(b'P') {
                if let Some(sql) = message.sql() {
                    prepared.insert(name.to_vec(), sql.to_owned());
                }
            } else {
                message.bound = prepared.get(name).map(String::as_str);
            }
        }
        if let Some((cue, at)) = &state.cue
            && (cue.matches)(&message)
        {
            let at = *at;
            state.cue = None;
            state.cued += 1;
            state.frozen = true;
            if at == AtCue::Forward {
                forced = true;
                for unit in &mut link.up.units {
                    unit.forced = true;
                }
            }
        }
        link.up.units.push_back(Unit { bytes, forced });
        link.up.wake.notify_one();
    }
}

/// Reads one PostgreSQL message; `None` at the end of the stream. Returns its bytes and where
/// its type byte is (`None`: an untyped message, length first).
async fn read_message(
    client: &mut OwnedReadHalf,
    untyped: &mut bool,
) -> Option<(Vec<u8>, Option<usize>)> {
    let header = if *untyped { 4 } else { 5 };
    let mut bytes = vec![0u8; header];
    client.read_exact(&mut bytes).await.ok()?;
    let length = u32::from_be_bytes(bytes[header - 4..].try_into().expect("4 bytes")) as usize;
    bytes.resize(header - 4 + length.max(4), 0);
    client.read_exact(&mut bytes[header..]).await.ok()?;
    if *untyped {
        let code = bytes
            .get(4..8)
            .map(|c| u32::from_be_bytes(c.try_into().expect("4 bytes")));
        *untyped = code.is_some_and(|code| NEGOTIATIONS.contains(&code));
        Some((bytes, None))
    } else {
        Some((bytes, Some(0)))
    }
}

/// Reads what is there, up to 64 KiB; `None` at the end of the stream.
async fn read_chunk(stream: &mut OwnedReadHalf) -> Option<(Vec<u8>, Option<usize>)> {
    let mut buffer = vec![0u8; 64 * 1024];
    match stream.read(&mut buffer).await {
        Ok(0) | Err(_) => None,
        Ok(n) => {
            buffer.truncate(n);
            Some((buffer, None))
        }
    }
}

/// Reads what the server sends into the link's downstream pipe; at its end, ends the pipe.
async fn read_server(shared: &Shared, id: u64, mut server: OwnedReadHalf) {
    loop {
        let read = read_chunk(&mut server).await;
        let mut state = shared.state();
        let Some(link) = state.links.get_mut(&id) else {
            return;
        };
        match read {
            Some((bytes, _)) => link.down.units.push_back(Unit {
                bytes,
                forced: false,
            }),
            None => link.down.ended = true,
        }
        link.down.wake.notify_one();
        if link.down.ended {
            return;
        }
    }
}

/// Writes what the pipe of `side` holds to `to` while the proxy is not frozen (and what is
/// forced through a freeze); at the pipe's end, shuts `to` down.
async fn write(shared: &Shared, id: u64, side: Side, mut to: OwnedWriteHalf) {
    enum Step {
        Write(Unit),
        Wait(Arc<Notify>),
        End,
    }
    loop {
        let step = {
            let mut state = shared.state();
            let frozen = state.frozen;
            let Some(link) = state.links.get_mut(&id) else {
                return;
            };
            let pipe = link.pipe(side);
            match pipe.units.front().map(|unit| !frozen || unit.forced) {
                Some(true) => Step::Write(pipe.units.pop_front().expect("a unit")),
                None if pipe.ended => Step::End,
                _ => Step::Wait(Arc::clone(&pipe.wake)),
            }
        };
        match step {
            Step::Write(unit) => {
                if to.write_all(&unit.bytes).await.is_err() {
                    end(shared, id);
                    return;
                }
            }
            Step::Wait(wake) => wake.notified().await,
            Step::End => {
                let _ = to.shutdown().await;
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use sqlx::{Connection, Executor, PgConnection, postgres::PgConnectOptions};

    use super::*;

    /// How long a test here may take: only a hang reaches it.
    const TEST_DEADLINE: Duration = Duration::from_secs(30);

    /// Waits for `condition`, at most 20 s: within the test's deadline, saying what it waited for.
    async fn wait_until<F, Fut>(what: &str, condition: F)
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = bool>,
    {
        crate::wait_within(Duration::from_secs(20), what, condition).await;
    }

    fn through(proxy: &PartitionProxy, connect: &PgConnectOptions) -> PgConnectOptions {
        connect
            .clone()
            .host("127.0.0.1")
            .port(proxy.port())
            .ssl_mode(sqlx::postgres::PgSslMode::Disable)
    }

    fn upstream(connect: &PgConnectOptions) -> String {
        format!("{}:{}", connect.get_host(), connect.get_port())
    }

    async fn rows(direct: &mut PgConnection) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM proxied")
            .fetch_one(direct)
            .await
            .expect("count")
    }

    /// A statement held at its cue has not reached the server (a direct connection does not
    /// see its row) and its client waits; after heal it runs, and the connection goes on.
    #[sqlx::test(migrations = false)]
    async fn a_statement_frozen_at_its_cue_runs_only_after_heal(
        _: sqlx::postgres::PgPoolOptions,
        connect: PgConnectOptions,
    ) {
        tokio::time::timeout(TEST_DEADLINE, async {
            let proxy = PartitionProxy::postgres(upstream(&connect)).await;
            let mut direct = PgConnection::connect_with(&connect).await.unwrap();
            direct
                .execute("CREATE TABLE proxied (n int)")
                .await
                .unwrap();
            let mut proxied = PgConnection::connect_with(&through(&proxy, &connect))
                .await
                .unwrap();
            proxy.freeze_at(Cue::statement("INSERT INTO proxied"));
            let insert = tokio::spawn(async move {
                sqlx::query("INSERT INTO proxied VALUES (1)")
                    .execute(&mut proxied)
                    .await
                    .expect("the insert runs after heal");
                proxied
            });
            wait_until("the insert to be held", || async {
                proxy.held_messages() >= 1
            })
            .await;
            assert_eq!(proxy.cued(), 1);
            assert!(proxy.is_frozen());
            assert_eq!(
                rows(&mut direct).await,
                0,
                "the held insert reached the server"
            );
            // Anything else through the proxy waits too, a new connection included.
            let opening = tokio::spawn({
                let options = through(&proxy, &connect);
                async move { PgConnection::connect_with(&options).await }
            });
            wait_until("the new connection's startup to be held", || async {
                proxy.held_connections() == 2
            })
            .await;
            assert!(!insert.is_finished() && !opening.is_finished());
            proxy.heal();
            let mut proxied = insert.await.unwrap();
            assert_eq!(rows(&mut direct).await, 1);
            let mut opened = opening
                .await
                .unwrap()
                .expect("the connection opens after heal");
            assert_eq!(rows(&mut opened).await, 1);
            assert_eq!(
                rows(&mut proxied).await,
                1,
                "the connection goes on after heal"
            );
            assert_eq!(proxy.abandoned(), 0);
        })
        .await
        .expect("the test's deadline");
    }

    /// A statement forwarded at its cue runs (a direct connection sees its row); its answer is
    /// held until heal.
    #[sqlx::test(migrations = false)]
    async fn a_statement_forwarded_at_its_cue_runs_and_its_answer_waits_for_heal(
        _: sqlx::postgres::PgPoolOptions,
        connect: PgConnectOptions,
    ) {
        tokio::time::timeout(TEST_DEADLINE, async {
            let proxy = PartitionProxy::postgres(upstream(&connect)).await;
            let mut direct = PgConnection::connect_with(&connect).await.unwrap();
            direct
                .execute("CREATE TABLE proxied (n int)")
                .await
                .unwrap();
            let mut proxied = PgConnection::connect_with(&through(&proxy, &connect))
                .await
                .unwrap();
            sqlx::raw_sql("BEGIN; INSERT INTO proxied VALUES (1)")
                .execute(&mut proxied)
                .await
                .unwrap();
            proxy.freeze_after(Cue::commit());
            let commit =
                tokio::spawn(async move { sqlx::raw_sql("COMMIT").execute(&mut proxied).await });
            wait_until("the COMMIT's answer to be held", || async {
                proxy.held_answers() >= 1
            })
            .await;
            assert_eq!(rows(&mut direct).await, 1, "the COMMIT reached the server");
            assert!(!commit.is_finished());
            proxy.heal();
            commit
                .await
                .unwrap()
                .expect("the COMMIT's answer arrives after heal");
        })
        .await
        .expect("the test's deadline");
    }

    /// A client that closes its connection while its COMMIT is held abandons it: the COMMIT is
    /// dropped, the server's connection is closed and its transaction rolled back, before heal.
    #[sqlx::test(migrations = false)]
    async fn a_connection_its_client_closes_while_frozen_is_closed_upstream_and_its_bytes_dropped(
        _: sqlx::postgres::PgPoolOptions,
        connect: PgConnectOptions,
    ) {
        tokio::time::timeout(TEST_DEADLINE, async {
            let proxy = PartitionProxy::postgres(upstream(&connect)).await;
            let direct = sqlx::PgPool::connect_with(connect.clone()).await.unwrap();
            direct
                .execute("CREATE TABLE proxied (n int)")
                .await
                .unwrap();
            let options = through(&proxy, &connect).application_name("abandoned");
            let mut proxied = PgConnection::connect_with(&options).await.unwrap();
            sqlx::raw_sql("BEGIN; INSERT INTO proxied VALUES (1)")
                .execute(&mut proxied)
                .await
                .unwrap();
            proxy.freeze_at(Cue::commit());
            let commit =
                tokio::spawn(async move { sqlx::raw_sql("COMMIT").execute(&mut proxied).await });
            wait_until("the COMMIT to be held", || async {
                proxy.held_messages() >= 1
            })
            .await;
            // The client gives up: its connection is dropped, the socket closed.
            commit.abort();
            assert!(commit.await.unwrap_err().is_cancelled());
            wait_until("the connection to be abandoned", || async {
                proxy.abandoned() == 1
            })
            .await;
            wait_until("the server to see the abandoned connection go", || async {
                let sql =
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'abandoned'";
                sqlx::query_scalar::<_, i64>(sql)
                    .fetch_one(&direct)
                    .await
                    .unwrap()
                    == 0
            })
            .await;
            assert!(proxy.is_frozen(), "the server saw the close while frozen");
            proxy.heal();
            let mut direct = direct.acquire().await.unwrap();
            assert_eq!(
                rows(&mut direct).await,
                0,
                "the dropped COMMIT never arrived"
            );
            assert_eq!(proxy.open_connections(), 0);
        })
        .await
        .expect("the test's deadline");
    }

    /// With closes lost, an abandoned connection stays open upstream while frozen (the
    /// server still has its session) and is closed at heal.
    #[sqlx::test(migrations = false)]
    async fn a_lost_close_keeps_the_upstream_connection_open_until_heal(
        _: sqlx::postgres::PgPoolOptions,
        connect: PgConnectOptions,
    ) {
        tokio::time::timeout(TEST_DEADLINE, async {
            let proxy = PartitionProxy::postgres(upstream(&connect)).await;
            proxy.lose_closes();
            let direct = sqlx::PgPool::connect_with(connect.clone()).await.unwrap();
            let sessions = || async {
                let sql = "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'lost'";
                sqlx::query_scalar::<_, i64>(sql)
                    .fetch_one(&direct)
                    .await
                    .unwrap()
            };
            let options = through(&proxy, &connect).application_name("lost");
            let mut proxied = PgConnection::connect_with(&options).await.unwrap();
            proxy.freeze_at(Cue::statement("SELECT 1"));
            let query =
                tokio::spawn(async move { sqlx::raw_sql("SELECT 1").execute(&mut proxied).await });
            wait_until("the query to be held", || async {
                proxy.held_messages() >= 1
            })
            .await;
            query.abort();
            assert!(query.await.unwrap_err().is_cancelled());
            wait_until("the connection to be abandoned", || async {
                proxy.abandoned() == 1
            })
            .await;
            assert_eq!(proxy.open_connections(), 1, "kept open upstream");
            assert_eq!(sessions().await, 1, "the server heard of the close");
            proxy.heal();
            wait_until("the server to see the connection go after heal", || async {
                sessions().await == 0
            })
            .await;
        })
        .await
        .expect("the test's deadline");
    }

    /// Without parsing, [`PartitionProxy::freeze`] holds any bytes, both ways, until heal.
    #[sqlx::test(migrations = false)]
    async fn the_tcp_proxy_holds_every_byte_while_frozen_and_delivers_them_after_heal(
        _: sqlx::postgres::PgPoolOptions,
        connect: PgConnectOptions,
    ) {
        tokio::time::timeout(TEST_DEADLINE, async {
            let proxy = PartitionProxy::tcp(upstream(&connect)).await;
            let mut proxied = PgConnection::connect_with(&through(&proxy, &connect))
                .await
                .unwrap();
            proxy.freeze();
            let query = tokio::spawn(async move {
                let one: i32 = sqlx::query_scalar("SELECT 1")
                    .fetch_one(&mut proxied)
                    .await
                    .expect("the query runs after heal");
                one
            });
            wait_until("the query to be held", || async {
                proxy.held_messages() >= 1
            })
            .await;
            assert!(!query.is_finished());
            proxy.heal();
            assert_eq!(query.await.unwrap(), 1);
        })
        .await
        .expect("the test's deadline");
    }
}
