//! An HTTP proxy in front of a service that misbehaves on cue, for the client's tests: it can
//! forward a request and then drop the connection before the answer (the service acted, the
//! client cannot know), answer a status of its own with `Retry-After` without forwarding, wait
//! before forwarding, or forward and never answer. It notes every request it receives.

use std::{
    collections::VecDeque,
    sync::{Arc, Mutex},
    time::Duration,
};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, Response, StatusCode, body::Incoming, server::conn::http1};
use hyper_util::rt::TokioIo;
use tokio::{net::TcpListener, time::Instant};

/// What the proxy does with one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fault {
    /// Forward it and pass the answer back.
    Pass,
    /// Forward it, then close the connection without an answer.
    DropAfterForward,
    /// Answer `status` (with `Retry-After: <seconds>` if given) without forwarding.
    Answer(u16, Option<u64>),
    /// Wait, then forward it.
    Delay(Duration),
    /// Forward it and never answer.
    Hang,
}

/// A request the proxy received.
#[derive(Debug, Clone)]
pub struct Seen {
    /// When it arrived.
    pub at: Instant,
    /// Its `Idempotency-Key`, if any.
    pub key: Option<String>,
    /// Its body.
    pub body: Bytes,
    /// What the proxy did with it.
    pub fault: Fault,
}

#[derive(Debug, Default)]
struct State {
    script: VecDeque<Fault>,
    otherwise: Option<Fault>,
    seen: Vec<Seen>,
    forwarded: usize,
}

/// The proxy: requests to [`FaultProxy::url`] go to the upstream service.
#[derive(Debug, Clone)]
pub struct FaultProxy {
    url: String,
    state: Arc<Mutex<State>>,
}

impl FaultProxy {
    /// Listens on a loopback port and forwards to `upstream` (`http://host:port`).
    pub async fn start(upstream: String) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind loopback");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        let state = Arc::new(Mutex::new(State::default()));
        let shared = Arc::clone(&state);
        let client = reqwest::Client::new();
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let (state, client, upstream) =
                    (Arc::clone(&shared), client.clone(), upstream.clone());
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |request| {
                        handle(
                            Arc::clone(&state),
                            client.clone(),
                            upstream.clone(),
                            request,
                        )
                    });
                    // An error from the service closes the connection without an answer.
                    let _ = http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Self { url, state }
    }

    /// The proxy's base URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The next requests meet `faults`, one each, in order; then [`FaultProxy::otherwise`].
    pub fn script(&self, faults: impl IntoIterator<Item = Fault>) {
        self.state.lock().unwrap().script.extend(faults);
    }

    /// What requests meet once the script is used up (default: [`Fault::Pass`]).
    pub fn otherwise(&self, fault: Fault) {
        self.state.lock().unwrap().otherwise = Some(fault);
    }

    /// Every request received so far, in order.
    pub fn seen(&self) -> Vec<Seen> {
        self.state.lock().unwrap().seen.clone()
    }

    /// How many requests reached the upstream service.
    pub fn forwarded(&self) -> usize {
        self.state.lock().unwrap().forwarded
    }
}

/// Why a connection was closed without an answer.
#[derive(Debug)]
struct Dropped;

impl std::fmt::Display for Dropped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the proxy dropped the connection on cue")
    }
}

impl std::error::Error for Dropped {}

async fn handle(
    state: Arc<Mutex<State>>,
    client: reqwest::Client,
    upstream: String,
    request: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Dropped> {
    let at = Instant::now();
    let (parts, body) = request.into_parts();
    let body = body.collect().await.map_err(|_| Dropped)?.to_bytes();
    let fault = {
        let mut state = state.lock().unwrap();
        let fault = state
            .script
            .pop_front()
            .or_else(|| state.otherwise.clone())
            .unwrap_or(Fault::Pass);
        state.seen.push(Seen {
            at,
            key: parts
                .headers
                .get("idempotency-key")
                .and_then(|value| value.to_str().ok())
                .map(str::to_owned),
            body: body.clone(),
            fault: fault.clone(),
        });
        fault
    };
    if let Fault::Answer(status, retry_after) = fault {
        let mut answer = Response::builder().status(status);
        if let Some(seconds) = retry_after {
            answer = answer.header("retry-after", seconds.to_string());
        }
        return Ok(answer.body(Full::new(Bytes::new())).expect("an answer"));
    }
    if let Fault::Delay(wait) = fault {
        tokio::time::sleep(wait).await;
    }
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let mut forward = client.request(parts.method.clone(), format!("{upstream}{path}"));
    for (name, value) in &parts.headers {
        if name != hyper::header::HOST {
            forward = forward.header(name, value);
        }
    }
    let answer = forward.body(body).send().await.map_err(|_| Dropped)?;
    state.lock().unwrap().forwarded += 1;
    match fault {
        Fault::DropAfterForward => return Err(Dropped),
        Fault::Hang => std::future::pending::<()>().await,
        _ => {}
    }
    let mut response = Response::builder()
        .status(StatusCode::from_u16(answer.status().as_u16()).expect("a status"));
    for (name, value) in answer.headers() {
        if name != "content-length" && name != "transfer-encoding" {
            response = response.header(name.as_str(), value.as_bytes());
        }
    }
    let bytes = answer.bytes().await.map_err(|_| Dropped)?;
    Ok(response.body(Full::new(bytes)).expect("an answer"))
}
