//! The requests of a campaign: what kinds there are, how each is made, and which statuses may
//! come back.

use super::*;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Route {
    Payments,
    Payouts,
    Refunds,
    Other,
}

impl Route {
    pub(super) fn path(self) -> &'static str {
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
pub(super) enum Kind {
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

pub(super) const KINDS: [(Kind, usize); 17] = [
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

/// `(tenant, key)`: where a key lives.
pub(super) type KeyScope = (String, String);

/// A valid request to a POST route, kept so that later requests can repeat it.
#[derive(Clone)]
pub(super) struct Sent {
    pub(super) route: Route,
    pub(super) tenant: String,
    pub(super) key: String,
    pub(super) fields: Vec<(String, String)>,
    /// Bodies with an integer beyond 2^53 are fingerprinted byte for byte: resend them as sent.
    pub(super) exact: Option<String>,
    pub(super) expect: Vec<u16>,
}

/// A generated request and what may come back.
pub(super) struct Plan {
    pub(super) kind: Kind,
    pub(super) what: String,
    pub(super) route: Route,
    /// `(tenant, key)` when both are valid, for the replay check.
    pub(super) scope: Option<KeyScope>,
    pub(super) wire: Vec<u8>,
    pub(super) head: bool,
    pub(super) expect: Vec<u16>,
    /// An error answer without a body is acceptable (the router's 404/405, hyper's 400).
    pub(super) empty_ok: bool,
    /// The expected problem `type` of an error answer, when it is certain.
    pub(super) problem: Option<String>,
    /// Axum's own `Path` rejection, `text/plain`, is accepted: a known deviation (the example's
    /// handlers take `axum::extract::Path`), counted and printed.
    pub(super) plain_ok: bool,
    pub(super) sent: Option<Sent>,
}

impl Plan {
    pub(super) fn new(
        kind: Kind,
        what: impl Into<String>,
        route: Route,
        wire: &Wire,
        expect: &[u16],
    ) -> Self {
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

    pub(super) fn problem(mut self, problem: impl Into<String>) -> Self {
        self.problem = Some(problem.into());
        self
    }

    pub(super) fn empty_ok(mut self) -> Self {
        self.empty_ok = true;
        self
    }
}

pub(super) fn example(kind: &str) -> String {
    format!("{EXAMPLE_TYPE}{kind}")
}

/// A JSON object from raw JSON member values, in random order with random whitespace (the same
/// request to the fingerprint, which canonicalises JSON).
pub(super) fn object(rng: &mut Rng, fields: &[(String, String)]) -> String {
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

pub(super) fn text(value: &str) -> String {
    serde_json::to_string(value).expect("a string")
}

/// The campaign's state: what was sent and seen so far.
pub(super) struct Campaign {
    pub(super) rng: Rng,
    pub(super) next_key: usize,
    pub(super) sent: Vec<Sent>,
    /// Payments created so far, as `(tenant, id)`.
    pub(super) payments: Vec<(String, String)>,
    /// Keys sent with a changed body: if that one ran first, the key is stored with its body.
    pub(super) changed: HashSet<KeyScope>,
}

impl Campaign {
    pub(super) fn fresh_key(&mut self) -> (String, String) {
        self.next_key += 1;
        let len = self.rng.range(1, 24);
        let bare = format!("{}-{}", self.rng.word(len), self.next_key);
        match self.rng.below(10) {
            0..=2 => (format!("\"{bare}\""), bare),
            3 => (format!("  {bare}\t"), bare),
            _ => (bare.clone(), bare),
        }
    }

    pub(super) fn tenant(&mut self) -> String {
        (*self.rng.pick(&TENANTS)).to_owned()
    }

    /// A valid payment or payout body and the statuses its customer leads to.
    pub(super) fn transfer(&mut self) -> (Vec<(String, String)>, Option<String>, Vec<u16>) {
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

    pub(super) fn refund_body(&mut self, tenant: &str) -> (Vec<(String, String)>, Vec<u16>) {
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

    pub(super) fn valid(&mut self) -> Plan {
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

    pub(super) fn repeat(&mut self, changed: bool) -> Plan {
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

    pub(super) fn nul_in_json(&mut self) -> Plan {
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

    pub(super) fn post(&mut self, route: Route) -> Wire {
        let fields = if route == Route::Refunds {
            let tenant = self.tenant();
            self.refund_body(&tenant).0
        } else {
            self.transfer().0
        };
        Wire::new("POST", route.path()).json(object(&mut self.rng, &fields))
    }

    pub(super) fn transfer_body(&mut self) -> String {
        let fields = self.transfer().0;
        object(&mut self.rng, &fields)
    }

    pub(super) fn any_post_route(&mut self) -> Route {
        *self.rng.pick(&[
            Route::Payments,
            Route::Payments,
            Route::Payouts,
            Route::Refunds,
        ])
    }

    pub(super) fn bad_key(&mut self) -> Plan {
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

    pub(super) fn repeated_key(&mut self) -> Plan {
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

    pub(super) fn no_key(&mut self) -> Plan {
        let route = self.any_post_route();
        let tenant = self.tenant();
        let wire = self.post(route).tenant(&tenant);
        Plan::new(Kind::NoKey, "no key", route, &wire, &[400])
            .problem(ProblemKind::MissingKey.type_uri())
    }

    pub(super) fn bad_auth(&mut self) -> Plan {
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
    pub(super) fn keyed(&mut self, route: Route) -> (Wire, KeyScope) {
        let tenant = self.tenant();
        let (wire_key, key) = self.fresh_key();
        (
            Wire::new("POST", route.path())
                .tenant(&tenant)
                .key(&wire_key),
            (tenant, key),
        )
    }

    pub(super) fn random_body(&mut self) -> Plan {
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

    pub(super) fn deep_json(&mut self) -> Plan {
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

    pub(super) fn wrong_shape(&mut self) -> Plan {
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

    pub(super) fn wrong_content_type(&mut self) -> Plan {
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

    pub(super) fn wrong_method(&mut self) -> Plan {
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

    pub(super) fn wrong_path(&mut self) -> Plan {
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

    pub(super) fn too_large(&mut self) -> Plan {
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

    pub(super) fn read(&mut self) -> Plan {
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

    pub(super) fn broken_http(&mut self) -> Plan {
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

    pub(super) fn plan(&mut self) -> Plan {
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

/// Requests of one batch that share a key run concurrently, in any order: each may get what
/// any of them may get, or 409 while another runs, or 422 after another one's body finished.
pub(super) fn race_in_batch(batch: &mut [Plan]) {
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
