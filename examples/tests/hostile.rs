//! Hostile input over HTTP: a seeded campaign of random, malformed and abusive requests against
//! the example service, served by `axum::serve` on a loopback port and sent over raw TCP (so
//! that repeated headers, invalid bytes and broken HTTP can be sent), on both databases.
//!
//! Every answer must be a documented status (never a 500), every problem must be
//! `application/problem+json`, a replay must repeat an earlier answer, the service must still
//! serve a valid payment at the end, and the rows written must match the first executions the
//! client saw: one payment or payout row per 201/402 without `Idempotent-Replayed: true`, one
//! refund row per such 201. Allowed, and named where they are: the router's empty 404/405 for an
//! unknown path or method, hyper's empty 400 for a request it cannot parse, and axum's `text/plain`
//! 400 for a path id that is not UTF-8 (the example's handlers take `axum::extract::Path`).
//!
//! At the end: a route whose scope comes from the path shows what idem does with a scope the
//! database cannot store (`%00`, or thousands of characters).
//!
//! The seed is printed; set `IDEM_HOSTILE_SEED` to replay a campaign (requests are sent four at
//! a time, so which duplicate of a key gets the 409 may differ between runs).

mod service;

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    net::SocketAddr,
    time::Instant,
};

use idem_runtime::ProblemKind;
use idem_tests::{App, TestDb, backend_tests};
use service::{executed_refunds, spawn_processor};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
};

/// Requests per database.
const REQUESTS: usize = 500;
/// Requests in flight at once.
const CONCURRENCY: usize = 4;
/// The store's default request body limit.
const LIMIT: usize = 1024 * 1024;
const DEFAULT_SEED: u64 = 0x1de4_5eed_2026;
const SEED_VAR: &str = "IDEM_HOSTILE_SEED";
const TENANTS: [&str; 3] = ["t_alpha", "t_beta", "t_gamma"];
/// Every status the guide's "What a request gets" and the example's errors document.
const DOCUMENTED: [u16; 12] = [200, 201, 400, 401, 402, 404, 405, 409, 413, 415, 422, 503];
const EXAMPLE_TYPE: &str = "tag:payments.idem.example,2026:";

/// SplitMix64: small, seedable, and good enough to pick requests.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn range(&mut self, low: usize, high: usize) -> usize {
        low + self.below(high - low + 1)
    }

    fn chance(&mut self, percent: usize) -> bool {
        self.below(100) < percent
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }

    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }

    fn word(&mut self, n: usize) -> String {
        const CHARS: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.~";
        (0..n).map(|_| *self.pick(CHARS) as char).collect()
    }
}

fn seed() -> u64 {
    match std::env::var(SEED_VAR) {
        Ok(text) => text
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{SEED_VAR} must be an unsigned integer, got {text:?}")),
        Err(_) => DEFAULT_SEED,
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Route {
    Payments,
    Payouts,
    Refunds,
    Other,
}

impl Route {
    fn path(self) -> &'static str {
        match self {
            Self::Payments => "/v1/payments",
            Self::Payouts => "/v1/payouts",
            Self::Refunds => "/v1/refunds",
            Self::Other => "/",
        }
    }
}

/// What a generated request is, for the tally and for failure messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Valid,
    Repeat,
    RepeatChanged,
    NulInJson,
    BadKey,
    RepeatedKey,
    NoKey,
    BadAuth,
    RandomBody,
    DeepJson,
    WrongShape,
    WrongContentType,
    WrongMethod,
    WrongPath,
    TooLarge,
    Read,
    BrokenHttp,
}

const KINDS: [(Kind, usize); 17] = [
    (Kind::Valid, 22),
    (Kind::Repeat, 9),
    (Kind::RepeatChanged, 5),
    (Kind::NulInJson, 8),
    (Kind::BadKey, 6),
    (Kind::RepeatedKey, 3),
    (Kind::NoKey, 2),
    (Kind::BadAuth, 5),
    (Kind::RandomBody, 5),
    (Kind::DeepJson, 4),
    (Kind::WrongShape, 6),
    (Kind::WrongContentType, 4),
    (Kind::WrongMethod, 4),
    (Kind::WrongPath, 4),
    (Kind::TooLarge, 3),
    (Kind::Read, 7),
    (Kind::BrokenHttp, 3),
];

/// One HTTP/1.1 request, written by hand.
struct Wire {
    method: String,
    target: String,
    headers: Vec<(String, Vec<u8>)>,
    body: Vec<u8>,
    chunked: bool,
}

impl Wire {
    fn new(method: &str, target: impl Into<String>) -> Self {
        Self {
            method: method.to_owned(),
            target: target.into(),
            headers: Vec::new(),
            body: Vec::new(),
            chunked: false,
        }
    }

    fn header(mut self, name: &str, value: impl Into<Vec<u8>>) -> Self {
        self.headers.push((name.to_owned(), value.into()));
        self
    }

    fn tenant(self, tenant: &str) -> Self {
        self.header("Authorization", format!("Bearer {tenant}"))
    }

    fn key(self, key: &str) -> Self {
        self.header("Idempotency-Key", key)
    }

    fn json(self, body: impl Into<Vec<u8>>) -> Self {
        self.header("Content-Type", "application/json").body(body)
    }

    fn body(mut self, body: impl Into<Vec<u8>>) -> Self {
        self.body = body.into();
        self
    }

    fn bytes(&self) -> Vec<u8> {
        let mut out = format!(
            "{} {} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n",
            self.method, self.target
        )
        .into_bytes();
        for (name, value) in &self.headers {
            out.extend_from_slice(name.as_bytes());
            out.extend_from_slice(b": ");
            out.extend_from_slice(value);
            out.extend_from_slice(b"\r\n");
        }
        if self.chunked {
            out.extend_from_slice(b"Transfer-Encoding: chunked\r\n\r\n");
            for chunk in self.body.chunks(100_000) {
                out.extend_from_slice(format!("{:x}\r\n", chunk.len()).as_bytes());
                out.extend_from_slice(chunk);
                out.extend_from_slice(b"\r\n");
            }
            out.extend_from_slice(b"0\r\n\r\n");
        } else {
            if !self.body.is_empty() || self.method == "POST" {
                out.extend_from_slice(
                    format!("Content-Length: {}\r\n", self.body.len()).as_bytes(),
                );
            }
            out.extend_from_slice(b"\r\n");
            out.extend_from_slice(&self.body);
        }
        out
    }
}

/// `(tenant, key)`: where a key lives.
type KeyScope = (String, String);

/// A valid request to a POST route, kept so that later requests can repeat it.
#[derive(Clone)]
struct Sent {
    route: Route,
    tenant: String,
    key: String,
    fields: Vec<(String, String)>,
    /// Bodies with an integer beyond 2^53 are fingerprinted byte for byte: resend them as sent.
    exact: Option<String>,
    expect: Vec<u16>,
}

/// A generated request and what may come back.
struct Plan {
    kind: Kind,
    what: String,
    route: Route,
    /// `(tenant, key)` when both are valid, for the replay check.
    scope: Option<KeyScope>,
    wire: Vec<u8>,
    head: bool,
    expect: Vec<u16>,
    /// An error answer without a body is acceptable (the router's 404/405, hyper's 400).
    empty_ok: bool,
    /// The expected problem `type` of an error answer, when it is certain.
    problem: Option<String>,
    /// Axum's own `Path` rejection, `text/plain`, is accepted: a known deviation (the example's
    /// handlers take `axum::extract::Path`), counted and printed.
    plain_ok: bool,
    sent: Option<Sent>,
}

impl Plan {
    fn new(kind: Kind, what: impl Into<String>, route: Route, wire: &Wire, expect: &[u16]) -> Self {
        Self {
            kind,
            what: what.into(),
            route,
            scope: None,
            wire: wire.bytes(),
            head: wire.method == "HEAD",
            expect: expect.to_vec(),
            empty_ok: false,
            problem: None,
            plain_ok: false,
            sent: None,
        }
    }

    fn problem(mut self, problem: impl Into<String>) -> Self {
        self.problem = Some(problem.into());
        self
    }

    fn empty_ok(mut self) -> Self {
        self.empty_ok = true;
        self
    }
}

fn example(kind: &str) -> String {
    format!("{EXAMPLE_TYPE}{kind}")
}

/// A JSON object from raw JSON member values, in random order with random whitespace (the same
/// request to the fingerprint, which canonicalises JSON).
fn object(rng: &mut Rng, fields: &[(String, String)]) -> String {
    let mut order: Vec<usize> = (0..fields.len()).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, rng.below(i + 1));
    }
    let space = |rng: &mut Rng| *rng.pick(&["", "", " ", "\n  ", "\t"]);
    let mut out = String::from("{");
    for (n, i) in order.into_iter().enumerate() {
        if n > 0 {
            out.push(',');
        }
        let (name, value) = &fields[i];
        out.push_str(space(rng));
        out.push_str(&serde_json::to_string(name).expect("a name"));
        out.push_str(space(rng));
        out.push(':');
        out.push_str(space(rng));
        out.push_str(value);
    }
    out.push_str(space(rng));
    out.push('}');
    out
}

fn text(value: &str) -> String {
    serde_json::to_string(value).expect("a string")
}

/// The campaign's state: what was sent and seen so far.
struct Campaign {
    rng: Rng,
    next_key: usize,
    sent: Vec<Sent>,
    /// Payments created so far, as `(tenant, id)`.
    payments: Vec<(String, String)>,
    /// Keys sent with a changed body: if that one ran first, the key is stored with its body.
    changed: HashSet<KeyScope>,
}

impl Campaign {
    fn fresh_key(&mut self) -> (String, String) {
        self.next_key += 1;
        let len = self.rng.range(1, 24);
        let bare = format!("{}-{}", self.rng.word(len), self.next_key);
        match self.rng.below(10) {
            0..=2 => (format!("\"{bare}\""), bare),
            3 => (format!("  {bare}\t"), bare),
            _ => (bare.clone(), bare),
        }
    }

    fn tenant(&mut self) -> String {
        (*self.rng.pick(&TENANTS)).to_owned()
    }

    /// A valid payment or payout body and the statuses its customer leads to.
    fn transfer(&mut self) -> (Vec<(String, String)>, Option<String>, Vec<u16>) {
        let n = self.rng.below(1_000_000);
        let (customer, expect): (String, &[u16]) = match self.rng.below(20) {
            0..=2 => ("cus_declined".into(), &[402]),
            3 => ("cus_unavailable".into(), &[503]),
            4 => (format!("cüstomer_ñ_{n}_💳"), &[201]),
            // The text `\u0000`, spelled with an escaped backslash: not a NUL.
            5 => (format!("cus_\\u0000_{n}"), &[201]),
            _ => (format!("cus_{n}"), &[201]),
        };
        let amount: i64 = match self.rng.below(20) {
            0 => i64::MAX,
            1 => 1,
            _ => self.rng.range(1, 10_000_000) as i64,
        };
        let currency = *self.rng.pick(&["usd", "eur", "GBP", "jpy"]);
        let mut fields = vec![
            ("amount".to_owned(), amount.to_string()),
            ("currency".to_owned(), text(currency)),
            ("customer".to_owned(), text(&customer)),
        ];
        if self.rng.chance(10) {
            fields.push((
                "metadata".to_owned(),
                r#"{"order": [1, 2.5, null, true, "x"]}"#.to_owned(),
            ));
        }
        let exact = (amount > 1 << 53).then(|| object(&mut self.rng, &fields));
        (fields, exact, expect.to_vec())
    }

    fn refund_body(&mut self, tenant: &str) -> (Vec<(String, String)>, Vec<u16>) {
        let own: Vec<&(String, String)> =
            self.payments.iter().filter(|(t, _)| t == tenant).collect();
        let (payment, expect): (String, &[u16]) = match self.rng.below(10) {
            0..=5 if !own.is_empty() => (self.rng.pick(&own).1.clone(), &[201]),
            6 if !self.payments.is_empty() => {
                let (owner, id) = self.rng.pick(&self.payments).clone();
                (id, if owner == tenant { &[201] } else { &[404] })
            }
            _ => (format!("pay_{}", self.rng.word(32)), &[404]),
        };
        let (amount, expect) = if self.rng.chance(10) {
            (0, &[400][..])
        } else {
            (self.rng.range(1, 5000) as i64, expect)
        };
        (
            vec![
                ("payment".to_owned(), text(&payment)),
                ("amount".to_owned(), amount.to_string()),
            ],
            expect.to_vec(),
        )
    }

    fn valid(&mut self) -> Plan {
        let tenant = self.tenant();
        let (wire_key, key) = self.fresh_key();
        let (route, fields, exact, expect) = match self.rng.below(10) {
            0..=5 => {
                let (fields, exact, expect) = self.transfer();
                (Route::Payments, fields, exact, expect)
            }
            6 | 7 => {
                let (fields, exact, expect) = self.transfer();
                (Route::Payouts, fields, exact, expect)
            }
            _ => {
                let (fields, expect) = self.refund_body(&tenant);
                (Route::Refunds, fields, None, expect)
            }
        };
        let body = exact
            .clone()
            .unwrap_or_else(|| object(&mut self.rng, &fields));
        let content_type = *self.rng.pick(&[
            "application/json",
            "application/json",
            "application/json; charset=utf-8",
            "application/merge-patch+json",
        ]);
        // A query string is part of the request (and of its fingerprint), not an error.
        let target = if self.rng.chance(10) {
            format!("{}?trace=%00%FF&x=1", route.path())
        } else {
            route.path().to_owned()
        };
        let wire = Wire::new("POST", target)
            .tenant(&tenant)
            .key(&wire_key)
            .header("Content-Type", content_type)
            .body(body.clone());
        let sent = Sent {
            route,
            tenant: tenant.clone(),
            key: key.clone(),
            fields,
            exact,
            expect: expect.clone(),
        };
        let mut plan = Plan::new(Kind::Valid, format!("valid: {body}"), route, &wire, &expect);
        plan.scope = Some((tenant, key));
        // Only unqueried requests are repeated (the repeat uses the bare path).
        if !wire_target_has_query(&wire) {
            plan.sent = Some(sent);
        }
        plan
    }

    fn repeat(&mut self, changed: bool) -> Plan {
        if self.sent.is_empty() {
            return self.valid();
        }
        // Often the latest, which may still be in flight: a 409 or a replay.
        let original = if self.rng.chance(40) {
            self.sent[self.sent.len() - 1].clone()
        } else {
            self.rng.pick(&self.sent).clone()
        };
        let mut fields = original.fields.clone();
        if changed {
            // Another amount: a different request under the same key.
            let amount = fields
                .iter_mut()
                .find(|(name, _)| name == "amount")
                .expect("an amount");
            let value: i64 = amount.1.parse().expect("an integer");
            amount.1 = value.wrapping_add(1).max(1).to_string();
        }
        let body = match (&original.exact, changed) {
            (Some(exact), false) => exact.clone(),
            _ => object(&mut self.rng, &fields),
        };
        let wire_key = if self.rng.chance(50) {
            format!("\"{}\"", original.key)
        } else {
            original.key.clone()
        };
        let wire = Wire::new("POST", original.route.path())
            .tenant(&original.tenant)
            .key(&wire_key)
            .json(body.clone());
        // The first may still run (409) or may not have been stored (a 503 on payments, which
        // lets this one run); a changed body is refused once the first is stored (422).
        let mut expect = original.expect.clone();
        expect.push(409);
        let scope = (original.tenant.clone(), original.key.clone());
        if changed {
            expect.extend([422, 201, 402, 400, 404]);
            self.changed.insert(scope);
        } else if self.changed.contains(&scope) {
            expect.push(422);
        }
        let kind = if changed {
            Kind::RepeatChanged
        } else {
            Kind::Repeat
        };
        let mut plan = Plan::new(
            kind,
            format!("repeat: {body}"),
            original.route,
            &wire,
            &expect,
        );
        plan.scope = Some((original.tenant, original.key));
        plan
    }

    fn nul_in_json(&mut self) -> Plan {
        let tenant = self.tenant();
        let (wire_key, key) = self.fresh_key();
        let (route, mut fields) = if self.rng.chance(25) {
            (Route::Refunds, self.refund_body(&tenant).0)
        } else {
            let route = *self.rng.pick(&[Route::Payments, Route::Payouts]);
            (route, self.transfer().0)
        };
        match self.rng.below(4) {
            0 => {
                // Inside a string the handler stores or looks up.
                let names: &[&str] = if route == Route::Refunds {
                    &["payment"]
                } else {
                    &["customer", "currency"]
                };
                let name = *self.rng.pick(names);
                let field = fields
                    .iter_mut()
                    .find(|(n, _)| n == name)
                    .expect("the field");
                let inner = &field.1[1..field.1.len() - 1];
                let cut = inner.len() / 2;
                let cut = (0..=cut)
                    .rev()
                    .find(|i| inner.is_char_boundary(*i))
                    .unwrap_or(0);
                field.1 = format!("\"{}\\u0000{}\"", &inner[..cut], &inner[cut..]);
            }
            1 => fields.push((
                "metadata".to_owned(),
                r#"{"note": ["a", "b\u0000c"]}"#.to_owned(),
            )),
            2 => fields.push(("x\u{0}".to_owned(), "1".to_owned())),
            _ => {
                let name = if route == Route::Refunds {
                    "payment"
                } else {
                    "customer"
                };
                fields.retain(|(n, _)| n != name);
                fields.push((name.to_owned(), r#""\u0000""#.to_owned()));
            }
        }
        let body = object(&mut self.rng, &fields);
        let wire = Wire::new("POST", route.path())
            .tenant(&tenant)
            .key(&wire_key)
            .json(body.clone());
        let mut plan = Plan::new(
            Kind::NulInJson,
            format!("NUL: {body}"),
            route,
            &wire,
            &[400],
        )
        .problem(example("invalid-json"));
        plan.scope = Some((tenant, key));
        plan
    }

    fn post(&mut self, route: Route) -> Wire {
        let fields = if route == Route::Refunds {
            let tenant = self.tenant();
            self.refund_body(&tenant).0
        } else {
            self.transfer().0
        };
        Wire::new("POST", route.path()).json(object(&mut self.rng, &fields))
    }

    fn transfer_body(&mut self) -> String {
        let fields = self.transfer().0;
        object(&mut self.rng, &fields)
    }

    fn any_post_route(&mut self) -> Route {
        *self.rng.pick(&[
            Route::Payments,
            Route::Payments,
            Route::Payouts,
            Route::Refunds,
        ])
    }

    fn bad_key(&mut self) -> Plan {
        let route = self.any_post_route();
        let tenant = self.tenant();
        let long = self.rng.word(256);
        let bad: Vec<u8> = match self.rng.below(10) {
            0 => Vec::new(),
            1 => b"\"\"".to_vec(),
            2 => long.into_bytes(),
            3 => b"a b".to_vec(),
            4 => b"\"unterminated".to_vec(),
            5 => b"\"bad \\x escape\"".to_vec(),
            6 => b"\"k\";param=1".to_vec(),
            7 => vec![b'k', 0xc3, 0xa9, b'y'],
            8 => vec![b'k', 0xff, 0xfe],
            _ => b"tab\there".to_vec(),
        };
        let what = format!("bad key {:?}", String::from_utf8_lossy(&bad));
        let wire = self
            .post(route)
            .tenant(&tenant)
            .header("Idempotency-Key", bad);
        Plan::new(Kind::BadKey, what, route, &wire, &[400])
            .problem(ProblemKind::MalformedKey.type_uri())
    }

    fn repeated_key(&mut self) -> Plan {
        let route = self.any_post_route();
        let tenant = self.tenant();
        let (first, _) = self.fresh_key();
        let second = if self.rng.chance(50) {
            first.clone()
        } else {
            self.fresh_key().0
        };
        let mut wire = self.post(route).tenant(&tenant).key(&first);
        for _ in 0..self.rng.range(1, 3) {
            let name = *self
                .rng
                .pick(&["Idempotency-Key", "idempotency-key", "IDEMPOTENCY-KEY"]);
            wire = wire.header(name, second.clone());
        }
        Plan::new(
            Kind::RepeatedKey,
            "repeated key header",
            route,
            &wire,
            &[400],
        )
        .problem(ProblemKind::MalformedKey.type_uri())
    }

    fn no_key(&mut self) -> Plan {
        let route = self.any_post_route();
        let tenant = self.tenant();
        let wire = self.post(route).tenant(&tenant);
        Plan::new(Kind::NoKey, "no key", route, &wire, &[400])
            .problem(ProblemKind::MissingKey.type_uri())
    }

    fn bad_auth(&mut self) -> Plan {
        let route = self.any_post_route();
        let (key, _) = self.fresh_key();
        let mut wire = self.post(route).key(&key);
        let auth: Option<Vec<u8>> = match self.rng.below(6) {
            0 => None,
            1 => Some(b"Basic dGVzdDp0ZXN0".to_vec()),
            2 => Some(b"Bearer ".to_vec()),
            3 => Some(b"bearer t_alpha".to_vec()),
            4 => Some(vec![b'B', b'e', b'a', b'r', b'e', b'r', b' ', 0xff, 0xfe]),
            _ => Some(b"Bearer".to_vec()),
        };
        let what = format!("auth {:?}", auth.as_deref().map(String::from_utf8_lossy));
        if let Some(auth) = auth {
            wire = wire.header("Authorization", auth);
        }
        Plan::new(Kind::BadAuth, what, route, &wire, &[401]).problem(example("unauthorized"))
    }

    /// A POST to `route` with a valid tenant and a fresh key, and its `(tenant, key)`.
    fn keyed(&mut self, route: Route) -> (Wire, KeyScope) {
        let tenant = self.tenant();
        let (wire_key, key) = self.fresh_key();
        (
            Wire::new("POST", route.path())
                .tenant(&tenant)
                .key(&wire_key),
            (tenant, key),
        )
    }

    fn random_body(&mut self) -> Plan {
        let route = self.any_post_route();
        let (wire, _) = self.keyed(route);
        let len = self.rng.range(0, 2000);
        let mut body = self.rng.bytes(len);
        if self.rng.chance(30) && !body.is_empty() {
            // Looks like JSON at first.
            body[0] = b'{';
        }
        let wire = wire.json(body);
        Plan::new(
            Kind::RandomBody,
            format!("{len} random bytes"),
            route,
            &wire,
            &[400, 422],
        )
        .problem(example("invalid-json"))
    }

    fn deep_json(&mut self) -> Plan {
        let route = *self.rng.pick(&[Route::Payments, Route::Payouts]);
        let (wire, scope) = self.keyed(route);
        let depth = *self.rng.pick(&[64, 126, 127, 128, 129, 1000, 100_000]);
        let (body, expect): (String, &[u16]) = match self.rng.below(4) {
            0 => (
                format!("{}{}", "[".repeat(depth), "]".repeat(depth)),
                &[400, 422],
            ),
            1 => (
                format!("{}1{}", "{\"a\":".repeat(depth), "}".repeat(depth)),
                &[400, 422],
            ),
            2 => ("[".repeat(depth), &[400, 422]),
            _ => {
                // Nested inside a field the route ignores: a valid payment while within serde's
                // recursion limit.
                let (mut fields, _, expect) = self.transfer();
                fields.push((
                    "extra".to_owned(),
                    format!("{}{}", "[".repeat(depth), "]".repeat(depth)),
                ));
                let mut allowed = expect;
                allowed.push(400);
                let body = object(&mut self.rng, &fields);
                let wire = wire.json(body);
                let mut plan = Plan::new(
                    Kind::DeepJson,
                    format!("payment with {depth} nested arrays"),
                    route,
                    &wire,
                    &allowed,
                );
                plan.scope = Some(scope);
                return plan;
            }
        };
        let wire = wire.json(body);
        Plan::new(
            Kind::DeepJson,
            format!("{depth} nested"),
            route,
            &wire,
            expect,
        )
        .problem(example("invalid-json"))
    }

    fn wrong_shape(&mut self) -> Plan {
        let route = *self.rng.pick(&[Route::Payments, Route::Payouts]);
        let (wire, _) = self.keyed(route);
        let (body, expect, problem): (&str, &[u16], &str) = match self.rng.below(16) {
            0 => ("[]", &[422], "invalid-json"),
            1 => ("\"payment\"", &[422], "invalid-json"),
            2 => ("null", &[422], "invalid-json"),
            3 => ("{}", &[422], "invalid-json"),
            4 => (
                r#"{"amount":"1","currency":"usd","customer":"c"}"#,
                &[422],
                "invalid-json",
            ),
            5 => (
                r#"{"amount":1.5,"currency":"usd","customer":"c"}"#,
                &[422],
                "invalid-json",
            ),
            6 => (
                r#"{"amount":9223372036854775808,"currency":"usd","customer":"c"}"#,
                &[422],
                "invalid-json",
            ),
            7 => (
                r#"{"amount":1e400,"currency":"usd","customer":"c"}"#,
                &[400],
                "invalid-json",
            ),
            8 => (
                r#"{"amount":1,"amount":2,"currency":"usd","customer":"c"}"#,
                &[422],
                "invalid-json",
            ),
            9 => (
                r#"{"amount":1,"currency":"usd","customer":null}"#,
                &[422],
                "invalid-json",
            ),
            10 => (
                r#"{"amount":1,"currency":"usd","customer":"c"} trailing"#,
                &[400],
                "invalid-json",
            ),
            11 => (
                r#"{"amount":1,"currency":"usd","customer":"\ud800"}"#,
                &[400],
                "invalid-json",
            ),
            12 => (
                r#"{"amount":0,"currency":"usd","customer":"c"}"#,
                &[400],
                "invalid-request",
            ),
            13 => (
                r#"{"amount":-7,"currency":"usd","customer":"c"}"#,
                &[400],
                "invalid-request",
            ),
            14 => (
                r#"{"amount":1,"currency":"u$d","customer":"c"}"#,
                &[400],
                "invalid-request",
            ),
            _ => (
                r#"{"amount":1,"currency":"usd","customer":""}"#,
                &[400],
                "invalid-request",
            ),
        };
        let wire = wire.json(body);
        Plan::new(
            Kind::WrongShape,
            format!("shape {body}"),
            route,
            &wire,
            expect,
        )
        .problem(example(problem))
    }

    fn wrong_content_type(&mut self) -> Plan {
        let route = self.any_post_route();
        let (wire, _) = self.keyed(route);
        let body = self.transfer_body();
        let content_type = *self.rng.pick(&[
            None,
            Some("text/plain"),
            Some("application/x-www-form-urlencoded"),
            Some("multipart/form-data; boundary=x"),
            Some("application/jsonx"),
            Some("json"),
            Some(""),
        ]);
        let wire = match content_type {
            Some(content_type) => wire.header("Content-Type", content_type),
            None => wire,
        }
        .body(body);
        Plan::new(
            Kind::WrongContentType,
            format!("content type {content_type:?}"),
            route,
            &wire,
            &[415],
        )
        .problem(example("invalid-json"))
    }

    fn wrong_method(&mut self) -> Plan {
        let tenant = self.tenant();
        let (method, path) = match self.rng.below(6) {
            0 => (
                *self.rng.pick(&["PUT", "DELETE", "PATCH"]),
                "/v1/payments".to_owned(),
            ),
            1 => ("POST", format!("/v1/payments/pay_{}", self.rng.word(8))),
            2 => ("DELETE", format!("/v1/refunds/re_{}", self.rng.word(8))),
            3 => ("OPTIONS", "/v1/payouts".to_owned()),
            4 => ("FROB", "/v1/payments".to_owned()),
            _ => {
                // HEAD is GET without a body.
                let wire = Wire::new("HEAD", "/v1/payments").tenant(&tenant);
                return Plan::new(Kind::WrongMethod, "HEAD", Route::Other, &wire, &[200]);
            }
        };
        let (key, _) = self.fresh_key();
        let wire = Wire::new(method, path.clone())
            .tenant(&tenant)
            .key(&key)
            .json(self.transfer_body());
        Plan::new(
            Kind::WrongMethod,
            format!("{method} {path}"),
            Route::Other,
            &wire,
            &[405],
        )
        .empty_ok()
    }

    fn wrong_path(&mut self) -> Plan {
        let tenant = self.tenant();
        let path = match self.rng.below(8) {
            0 => "/".to_owned(),
            1 => "/v1".to_owned(),
            2 => "/v1/payments/".to_owned(),
            3 => "//v1/payments".to_owned(),
            4 => "/v1/%70ayments".to_owned(),
            5 => format!("/v1/payments/{}/{}", self.rng.word(4), self.rng.word(4)),
            6 => format!("/v2/{}", self.rng.word(10)),
            _ => "/v1/pay%00ments".to_owned(),
        };
        let method = *self.rng.pick(&["GET", "POST"]);
        let (key, _) = self.fresh_key();
        let wire = Wire::new(method, path.clone())
            .tenant(&tenant)
            .key(&key)
            .json(self.transfer_body());
        Plan::new(
            Kind::WrongPath,
            format!("{method} {path}"),
            Route::Other,
            &wire,
            &[404],
        )
        .empty_ok()
    }

    fn too_large(&mut self) -> Plan {
        let route = *self.rng.pick(&[Route::Payments, Route::Payouts]);
        let (wire, _) = self.keyed(route);
        let skeleton = r#"{"amount":1,"currency":"usd","customer":""}"#;
        let variant = self.rng.below(5);
        let size = match variant {
            // Exactly at the limit: accepted by the layer, so the handler must refuse it.
            4 => LIMIT,
            _ => LIMIT + self.rng.range(1, 512 * 1024),
        };
        let customer = "c".repeat(size - skeleton.len());
        let body = format!(r#"{{"amount":1,"currency":"usd","customer":"{customer}"}}"#);
        let mut wire = wire.json(body);
        let (what, expect, problem) = match variant {
            0 | 1 => (
                "over the limit",
                &[413][..],
                ProblemKind::BodyTooLarge.type_uri(),
            ),
            2 => {
                wire.chunked = true;
                (
                    "over the limit, chunked",
                    &[413][..],
                    ProblemKind::BodyTooLarge.type_uri(),
                )
            }
            3 => {
                wire.headers.retain(|(name, _)| name != "Authorization");
                (
                    "over the limit, unauthenticated",
                    &[401][..],
                    example("unauthorized"),
                )
            }
            _ => (
                "a customer filling the limit",
                &[400][..],
                example("invalid-request"),
            ),
        };
        Plan::new(
            Kind::TooLarge,
            format!("{what}: {size} bytes"),
            route,
            &wire,
            expect,
        )
        .problem(problem)
    }

    fn read(&mut self) -> Plan {
        let tenant = self.tenant();
        let (target, expect, problem): (String, &[u16], Option<&str>) = match self.rng.below(10) {
            0 => (
                self.rng
                    .pick(&["/v1/payments", "/v1/payouts", "/v1/refunds"])
                    .to_string(),
                &[200],
                None,
            ),
            1 | 2 if !self.payments.is_empty() => {
                let (owner, id) = self.rng.pick(&self.payments).clone();
                let expect: &[u16] = if owner == tenant { &[200] } else { &[404] };
                (format!("/v1/payments/{id}"), expect, None)
            }
            3 => (
                format!("/v1/payouts/po_{}", self.rng.word(12)),
                &[404],
                Some("not-found"),
            ),
            4 => (
                format!("/v1/refunds/{}", self.rng.word(12)),
                &[404],
                Some("not-found"),
            ),
            5 => (
                "/v1/payments/caf%C3%A9".to_owned(),
                &[404],
                Some("not-found"),
            ),
            9 => {
                let wire = Wire::new("GET", "/v1/payments/caf%E9").tenant(&tenant);
                let mut plan = Plan::new(
                    Kind::Read,
                    "GET /v1/payments/caf%E9",
                    Route::Other,
                    &wire,
                    &[400],
                );
                plan.plain_ok = true;
                return plan;
            }
            6 => (
                format!(
                    "/v1/{}/pay%00{}",
                    self.rng.pick(&["payments", "payouts", "refunds"]),
                    self.rng.word(4)
                ),
                &[400],
                Some("invalid-request"),
            ),
            7 => ("/v1/payments?limit=%00&cursor=%FF".to_owned(), &[200], None),
            _ => (
                format!("/v1/payments/pay_{}", self.rng.word(32)),
                &[404],
                Some("not-found"),
            ),
        };
        let mut wire = Wire::new("GET", target.clone()).tenant(&tenant);
        if self.rng.chance(10) {
            wire = wire.json("{\"ignored\": \"\\u0000\"}");
        }
        let plan = Plan::new(
            Kind::Read,
            format!("GET {target}"),
            Route::Other,
            &wire,
            expect,
        );
        match problem {
            Some(problem) => plan.problem(example(problem)),
            None => plan,
        }
    }

    fn broken_http(&mut self) -> Plan {
        let (key, _) = self.fresh_key();
        let valid = format!(
            "POST /v1/payments HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer t_alpha\r\n\
             Idempotency-Key: {key}\r\nContent-Type: application/json\r\n"
        );
        let body = r#"{"amount":1,"currency":"usd","customer":"c"}"#;
        let (what, wire): (&str, Vec<u8>) = match self.rng.below(8) {
            0 => ("garbage", {
                let len = self.rng.range(1, 300);
                let mut bytes = self.rng.bytes(len);
                bytes.extend_from_slice(b"\r\n\r\n");
                bytes
            }),
            1 => (
                "NUL in the key header",
                format!(
                    "POST /v1/payments HTTP/1.1\r\nAuthorization: Bearer t_alpha\r\n\
                     Idempotency-Key: a\0b\r\nContent-Type: application/json\r\n\
                     Content-Length: {}\r\n\r\n{body}",
                    body.len()
                )
                .into_bytes(),
            ),
            2 => (
                "control character in a header",
                format!(
                    "{valid}X-Note: a\x01b\r\nContent-Length: {}\r\n\r\n{body}",
                    body.len()
                )
                .into_bytes(),
            ),
            3 => (
                "two different Content-Lengths",
                format!(
                    "{valid}Content-Length: {}\r\nContent-Length: 3\r\n\r\n{body}",
                    body.len()
                )
                .into_bytes(),
            ),
            4 => (
                "Content-Length not a number",
                format!("{valid}Content-Length: lots\r\n\r\n{body}").into_bytes(),
            ),
            5 => (
                "space in the path",
                b"GET /v1/pay ments HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(),
            ),
            6 => (
                "HTTP/9.9",
                b"GET /v1/payments HTTP/9.9\r\nHost: x\r\n\r\n".to_vec(),
            ),
            _ => (
                "header name with a space",
                format!(
                    "{valid}Bad Name: x\r\nContent-Length: {}\r\n\r\n{body}",
                    body.len()
                )
                .into_bytes(),
            ),
        };
        Plan {
            kind: Kind::BrokenHttp,
            what: what.to_owned(),
            route: Route::Other,
            scope: None,
            wire,
            head: false,
            expect: vec![400],
            empty_ok: true,
            problem: None,
            plain_ok: false,
            sent: None,
        }
    }

    fn plan(&mut self) -> Plan {
        let total: usize = KINDS.iter().map(|(_, weight)| weight).sum();
        let mut roll = self.rng.below(total);
        let kind = KINDS
            .iter()
            .find(|(_, weight)| {
                if roll < *weight {
                    true
                } else {
                    roll -= weight;
                    false
                }
            })
            .map(|(kind, _)| *kind)
            .expect("a kind");
        let plan = match kind {
            Kind::Valid => self.valid(),
            Kind::Repeat => self.repeat(false),
            Kind::RepeatChanged => self.repeat(true),
            Kind::NulInJson => self.nul_in_json(),
            Kind::BadKey => self.bad_key(),
            Kind::RepeatedKey => self.repeated_key(),
            Kind::NoKey => self.no_key(),
            Kind::BadAuth => self.bad_auth(),
            Kind::RandomBody => self.random_body(),
            Kind::DeepJson => self.deep_json(),
            Kind::WrongShape => self.wrong_shape(),
            Kind::WrongContentType => self.wrong_content_type(),
            Kind::WrongMethod => self.wrong_method(),
            Kind::WrongPath => self.wrong_path(),
            Kind::TooLarge => self.too_large(),
            Kind::Read => self.read(),
            Kind::BrokenHttp => self.broken_http(),
        };
        if let Some(sent) = &plan.sent {
            self.sent.push(sent.clone());
        }
        plan
    }
}

fn wire_target_has_query(wire: &Wire) -> bool {
    wire.target.contains('?')
}

/// An answer, read off the socket.
#[derive(Debug)]
struct Answer {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    fn replayed(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }
}

/// Parses `buf` as one response, if it holds a whole one (`eof`: nothing more will come).
fn parse_answer(buf: &[u8], head: bool, eof: bool) -> Result<Option<Answer>, String> {
    let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
        return if eof {
            Err(format!(
                "the connection closed after {} bytes, before a whole response head: {:?}",
                buf.len(),
                String::from_utf8_lossy(buf)
            ))
        } else {
            Ok(None)
        };
    };
    let head_text = String::from_utf8_lossy(&buf[..end]);
    let mut lines = head_text.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status: u16 = status_line
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("bad status line {status_line:?}"))?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|line| line.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let rest = &buf[end + 4..];
    let find = |name: &str| headers.iter().find(|(n, _)| n == name).map(|(_, v)| v);
    let body = if head || status == 204 || status == 304 {
        Some(Vec::new())
    } else if find("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked")) {
        dechunk(rest)
    } else if let Some(length) = find("content-length") {
        let length: usize = length.parse().map_err(|_| "bad content-length")?;
        (rest.len() >= length).then(|| rest[..length].to_vec())
    } else {
        eof.then(|| rest.to_vec())
    };
    match body {
        Some(body) => Ok(Some(Answer {
            status,
            headers,
            body,
        })),
        None if eof => Err(format!(
            "the connection closed inside the body of a {status}"
        )),
        None => Ok(None),
    }
}

fn dechunk(mut rest: &[u8]) -> Option<Vec<u8>> {
    let mut body = Vec::new();
    loop {
        let line_end = rest.windows(2).position(|w| w == b"\r\n")?;
        let size_text = String::from_utf8_lossy(&rest[..line_end]);
        let size = usize::from_str_radix(size_text.split(';').next()?.trim(), 16).ok()?;
        rest = &rest[line_end + 2..];
        if size == 0 {
            return Some(body);
        }
        if rest.len() < size + 2 {
            return None;
        }
        body.extend_from_slice(&rest[..size]);
        rest = &rest[size + 2..];
    }
}

/// Sends `wire` on a fresh connection and reads one response. The request is written while
/// the response is read, so a server that answers before reading a large body is seen as it
/// answers; the write half is kept open until then (a half-close would end the request).
async fn exchange(addr: SocketAddr, wire: Vec<u8>, head: bool) -> Result<Answer, String> {
    let stream = TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let (mut reader, mut writer) = stream.into_split();
    let sending = tokio::spawn(async move {
        let written = writer.write_all(&wire).await;
        (writer, written)
    });
    let mut buf = Vec::new();
    let mut chunk = vec![0_u8; 64 * 1024];
    let deadline = Instant::now() + idem_tests::DEADLINE;
    let answer = loop {
        if let Some(answer) = parse_answer(&buf, head, false)? {
            break answer;
        }
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, reader.read(&mut chunk)).await {
            Err(_) => {
                return Err(format!(
                    "no whole response in {:?} ({} bytes)",
                    idem_tests::DEADLINE,
                    buf.len()
                ));
            }
            Ok(Ok(0)) => {
                break parse_answer(&buf, head, true)?.ok_or("closed without a response")?;
            }
            Ok(Ok(n)) => buf.extend_from_slice(&chunk[..n]),
            Ok(Err(error)) => {
                return Err(format!(
                    "read failed after {} bytes: {error}; {:?}",
                    buf.len(),
                    String::from_utf8_lossy(&buf[..buf.len().min(200)])
                ));
            }
        }
    };
    sending.abort();
    Ok(answer)
}

/// Requests of one batch that share a key run concurrently, in any order: each may get what
/// any of them may get, or 409 while another runs, or 422 after another one's body finished.
fn race_in_batch(batch: &mut [Plan]) {
    let mut groups: HashMap<KeyScope, Vec<u16>> = HashMap::new();
    let mut sizes: HashMap<KeyScope, usize> = HashMap::new();
    for plan in batch.iter() {
        if let Some(scope) = &plan.scope {
            groups
                .entry(scope.clone())
                .or_default()
                .extend(&plan.expect);
            *sizes.entry(scope.clone()).or_default() += 1;
        }
    }
    for plan in batch.iter_mut() {
        if let Some(scope) = &plan.scope
            && sizes[scope] > 1
        {
            plan.expect.extend(&groups[scope]);
            plan.expect.extend([409, 422]);
        }
    }
}

/// What the campaign saw.
#[derive(Default)]
struct Tally {
    by_status: BTreeMap<u16, usize>,
    by_kind: BTreeMap<String, usize>,
    first: BTreeMap<Route, i64>,
    replays: usize,
    /// Axum's `text/plain` `Path` rejections seen (see [`Plan::plain_ok`]).
    plain: usize,
    /// Non-replayed answers per `(tenant, key)`: what a replay may repeat.
    seen: HashMap<KeyScope, Vec<(u16, Vec<u8>)>>,
    failures: Vec<String>,
}

impl Tally {
    fn fail(&mut self, plan: &Plan, answer: Option<&Answer>, why: String) {
        let got = answer.map_or_else(String::new, |a| {
            format!(
                " (got {} {:?}: {})",
                a.status,
                a.header("content-type"),
                String::from_utf8_lossy(&a.body[..a.body.len().min(300)])
            )
        });
        let what: String = plan.what.chars().take(200).collect();
        self.failures
            .push(format!("{:?} [{what}]: {why}{got}", plan.kind));
    }

    /// Checks one answer; returns the payment it created, if any.
    fn check(&mut self, plan: &Plan, answer: &Answer) -> Option<String> {
        let status = answer.status;
        *self.by_status.entry(status).or_default() += 1;
        *self
            .by_kind
            .entry(format!("{:?} {status}", plan.kind))
            .or_default() += 1;
        if !DOCUMENTED.contains(&status) {
            self.fail(
                plan,
                Some(answer),
                format!("{status} is not a documented status"),
            );
        }
        if !plan.expect.contains(&status) {
            self.fail(
                plan,
                Some(answer),
                format!("expected one of {:?}", plan.expect),
            );
        }
        if status >= 400 {
            self.check_problem(plan, answer);
        } else if status < 300 && !plan.head {
            let json = answer
                .header("content-type")
                .is_some_and(|v| v.starts_with("application/json"));
            if !json || serde_json::from_slice::<serde_json::Value>(&answer.body).is_err() {
                self.fail(plan, Some(answer), "a 2xx that is not JSON".into());
            }
        }
        let replayed = answer.replayed();
        if replayed {
            self.replays += 1;
        } else if let Some(scope) = &plan.scope {
            self.seen
                .entry(scope.clone())
                .or_default()
                .push((status, answer.body.clone()));
        }
        if !replayed && plan.kind != Kind::Read {
            let first = matches!(
                (plan.route, status),
                (Route::Payments | Route::Payouts, 201 | 402) | (Route::Refunds, 201)
            );
            if first {
                *self.first.entry(plan.route).or_default() += 1;
            }
        }
        (plan.route == Route::Payments && status == 201)
            .then(|| serde_json::from_slice::<serde_json::Value>(&answer.body).ok())
            .flatten()
            .and_then(|body| body["id"].as_str().map(str::to_owned))
    }

    fn check_problem(&mut self, plan: &Plan, answer: &Answer) {
        if plan.plain_ok && answer.header("content-type") == Some("text/plain; charset=utf-8") {
            self.plain += 1;
            return;
        }
        if answer.status == 409 && answer.header("retry-after").is_none() {
            self.fail(plan, Some(answer), "a 409 without Retry-After".into());
        }
        if answer.body.is_empty() && (plan.empty_ok || plan.head) {
            if plan.head && answer.header("content-type") != Some("application/problem+json") {
                self.fail(
                    plan,
                    Some(answer),
                    "a HEAD error that is not a problem".into(),
                );
            }
            return;
        }
        if answer.header("content-type") != Some("application/problem+json") {
            self.fail(
                plan,
                Some(answer),
                "an error that is not application/problem+json".into(),
            );
            return;
        }
        let Ok(problem) = serde_json::from_slice::<serde_json::Value>(&answer.body) else {
            self.fail(plan, Some(answer), "a problem that is not JSON".into());
            return;
        };
        if problem["status"] != answer.status
            || !problem["type"].is_string()
            || !problem["title"].is_string()
            || !problem["detail"].is_string()
        {
            self.fail(
                plan,
                Some(answer),
                "a problem without status, type, title, detail".into(),
            );
        }
        let kind = problem["type"].as_str().unwrap_or_default();
        if answer.status == 503 && kind != example("processor-unavailable") {
            self.fail(
                plan,
                Some(answer),
                "a 503 other than the processor's".into(),
            );
        }
        if let Some(expected) = &plan.problem
            && kind != expected
        {
            self.fail(
                plan,
                Some(answer),
                format!("expected the problem type {expected}"),
            );
        }
        if plan.kind == Kind::NulInJson
            && !problem["detail"]
                .as_str()
                .is_some_and(|d| d.contains("U+0000"))
        {
            self.fail(
                plan,
                Some(answer),
                "the problem does not say what is wrong".into(),
            );
        }
    }

    /// A replay repeats what an earlier request with its key answered.
    fn check_replay(&mut self, plan: &Plan, answer: &Answer) {
        if !answer.replayed() {
            return;
        }
        let earlier = plan
            .scope
            .as_ref()
            .and_then(|scope| self.seen.get(scope))
            .is_some_and(|seen| {
                seen.iter()
                    .any(|(status, body)| *status == answer.status && *body == answer.body)
            });
        if !earlier {
            self.fail(
                plan,
                Some(answer),
                "a replay of nothing this key answered".into(),
            );
        }
    }
}

backend_tests! {
    async fn hostile_requests_get_documented_problems_never_500_and_rows_match_first_executions(db) {
        let backend = match &db {
            TestDb::Postgres(_) => "postgres",
            TestDb::Sqlite(_) => "sqlite",
        };
        let processor = spawn_processor().await;
        let app = service::with_processor(db, processor.clone()).await;
        let addr = app.serve().await;
        let seed = seed();
        println!("{backend}: hostile campaign with seed {seed} ({SEED_VAR}={seed} replays it)");
        let started = Instant::now();
        let mut campaign = Campaign {
            rng: Rng(seed),
            next_key: 0,
            sent: Vec::new(),
            payments: Vec::new(),
            changed: HashSet::new(),
        };
        let mut tally = Tally::default();
        let mut planned = 0;
        while planned < REQUESTS {
            let mut batch: Vec<Plan> = (0..CONCURRENCY.min(REQUESTS - planned))
                .map(|_| campaign.plan())
                .collect();
            race_in_batch(&mut batch);
            planned += batch.len();
            let tasks: Vec<_> = batch
                .iter()
                .map(|plan| tokio::spawn(exchange(addr, plan.wire.clone(), plan.head)))
                .collect();
            let mut answers = Vec::with_capacity(tasks.len());
            for task in tasks {
                answers.push(task.await.expect("request task"));
            }
            for (plan, answer) in batch.iter().zip(&answers) {
                match answer {
                    Ok(answer) => {
                        if let (Some(id), Some((tenant, _))) = (tally.check(plan, answer), &plan.scope) {
                            campaign.payments.push((tenant.clone(), id));
                        }
                    }
                    Err(error) => {
                        *tally.by_kind.entry(format!("{:?} no answer", plan.kind)).or_default() += 1;
                        tally.fail(plan, None, format!("no answer: {error}"));
                    }
                }
            }
            for (plan, answer) in batch.iter().zip(&answers) {
                if let Ok(answer) = answer {
                    tally.check_replay(plan, answer);
                }
            }
        }

        let rows = [
            (Route::Payments, app.count("payments").await),
            (Route::Payouts, app.count("payouts").await),
            (Route::Refunds, app.count("refunds").await),
        ];
        let executed = executed_refunds(&processor).await.len() as i64;
        println!(
            "{backend}: {planned} requests in {:.1} s; by status: {:?}; replays: {}; \
             first executions: {:?}; rows: {rows:?}; refunds at the processor: {executed}",
            started.elapsed().as_secs_f64(),
            tally.by_status,
            tally.replays,
            tally.first,
        );
        println!("{backend}: by kind: {:?}", tally.by_kind);
        println!(
            "{backend}: text/plain Path rejections (known, not problems): {}",
            tally.plain
        );
        for failure in &tally.failures {
            println!("{backend}: FAILED {failure}");
        }
        assert!(
            tally.failures.is_empty(),
            "{} answers broke the contract (above)",
            tally.failures.len()
        );
        let first = |route| tally.first.get(&route).copied().unwrap_or_default();
        for (route, rows) in rows {
            assert_eq!(rows, first(route), "{route:?}: rows against first executions seen");
        }
        assert_eq!(executed, first(Route::Refunds), "refunds executed by the processor");

        // The service still serves a valid payment, and replays it.
        let body = r#"{"amount": 4200, "currency": "usd", "customer": "cus_final"}"#;
        let last = || {
            Wire::new("POST", "/v1/payments")
                .tenant("t_final")
                .key("the-last-key")
                .json(body)
                .bytes()
        };
        let made = exchange(addr, last(), false).await.expect("a final answer");
        let text = String::from_utf8_lossy(&made.body).into_owned();
        assert_eq!((made.status, made.replayed()), (201, false), "{text}");
        let again = exchange(addr, last(), false).await.expect("a final replay");
        assert_eq!((again.status, again.replayed()), (201, true));
        assert_eq!(again.body, made.body);
        assert_eq!(app.count("payments").await, first(Route::Payments) + 1);
    }
}

/// A test-only route whose scope comes from the path, as an application's `Path` extractor
/// gives it: percent-decoded, so `%00` arrives as NUL.
macro_rules! path_scoped {
    ($db:ty) => {
        use axum::{Router, extract::Path, http::StatusCode, routing::post};
        use idem_runtime::{Store, idempotent};
        use sqlx::Transaction;

        /// `POST /accounts/{account}/touch`.
        pub fn router(store: Store<$db>) -> Router {
            Router::new()
                .route("/accounts/{account}/touch", post(touch))
                .with_state(store)
        }

        #[idempotent(scope = "account", retention = "1h")]
        async fn touch(
            Path(account): Path<String>,
            tx: &mut Transaction<'_, $db>,
        ) -> (StatusCode, String) {
            sqlx::query("SELECT 1")
                .execute(&mut **tx)
                .await
                .expect("select");
            (StatusCode::CREATED, format!("touched {}", account.len()))
        }
    };
}

mod path_scoped_postgres {
    path_scoped!(sqlx::Postgres);
}

mod path_scoped_sqlite {
    path_scoped!(sqlx::Sqlite);
}

fn path_scoped_router(app: &App) -> axum::Router {
    match &app.db {
        idem_tests::Db::Postgres(pool) => {
            path_scoped_postgres::router(idem_runtime::Store::new(pool.clone()))
        }
        idem_tests::Db::Sqlite(pool) => {
            path_scoped_sqlite::router(idem_runtime::Store::new(pool.clone()))
        }
    }
}

/// Sends `path` to the path-scoped route with a fresh key.
async fn touch(app: &App, path: &str) -> idem_tests::Reply {
    use tower::ServiceExt;
    let request = idem_tests::Req::post(path).key("touch-1").build();
    let response = path_scoped_router(app)
        .oneshot(request)
        .await
        .expect("the router is infallible");
    idem_tests::Reply::read(response).await
}

/// A scope value PostgreSQL cannot store (NUL from `%00`, or one too long for the key's index)
/// is the caller's input, not a store outage: it is answered 400 `InvalidScope` on both
/// databases, never 503 `StoreUnavailable` ("retry with the same key", which cannot succeed).
async fn unstorable_scopes_are_400_invalid_scope(app: App) {
    let long = format!("/accounts/{}/touch", Rng(5).word(3000));
    for path in ["/accounts/a%00b/touch", long.as_str()] {
        let reply = touch(&app, path).await;
        assert_eq!(
            reply.problem(axum::http::StatusCode::BAD_REQUEST),
            ProblemKind::InvalidScope.type_uri(),
            "{}",
            &path[..path.len().min(40)],
        );
    }
}

#[sqlx::test(migrations = false)]
async fn postgres_unstorable_scopes_are_400_invalid_scope(
    _: sqlx::postgres::PgPoolOptions,
    connect: sqlx::postgres::PgConnectOptions,
) {
    let app = service::app(TestDb::Postgres(Box::new(connect))).await;
    unstorable_scopes_are_400_invalid_scope(app).await;
}

#[tokio::test]
async fn sqlite_unstorable_scopes_are_400_invalid_scope() {
    let app = service::app(TestDb::sqlite()).await;
    unstorable_scopes_are_400_invalid_scope(app).await;
}
