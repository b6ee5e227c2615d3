//! The attribute's output, pretty-printed and compared with the files under
//! `tests/expansion/`, one per case: a change to the generated code shows there as a diff to
//! read. Rewrite them with `IDEM_SNAPSHOTS=overwrite cargo test -p idem-macros`, then read the
//! diff before committing it.
//!
//! The cases cover every mode and argument (transactional with a scope parameter or global,
//! external with a lease and a backend, `Steps`, `IdempotencyContext`, `timeout`, `wait`,
//! `replay_5xx`, `state`, `fingerprint_only`, `fingerprint_except`, type and const parameters, a custom last extractor, none at all) and
//! a few refusals (the errors beside the renamed function and its stand-in).

use std::{fs, path::PathBuf};

use proc_macro2::{Delimiter, TokenStream, TokenTree};

/// Whether idem-runtime has more than one database on (features are unified across the
/// packages of one build): an `external` handler without `backend` is then refused.
const SEVERAL_DATABASES: bool = cfg!(any(
    all(feature = "postgres", feature = "sqlite"),
    all(feature = "postgres", feature = "mysql"),
    all(feature = "sqlite", feature = "mysql"),
));

/// Each case: its name (the snapshot's file name) and a handler with its attribute, first (or
/// a tonic service's impl with `#[grpc]` first).
const CASES: &[(&str, &str)] = &[
    (
        "grpc_transactional_method",
        r#"
        #[grpc]
        #[tonic::async_trait]
        impl<DB: Sql> Payments for PaymentsApi<DB> {
            #[idempotent(scope = "tenant", retention = "24h", wait = "10s")]
            async fn create_payment(
                &self,
                tenant: Tenant,
                tx: &mut Transaction<'_, DB>,
                request: Request<CreatePaymentRequest>,
            ) -> Result<Response<Payment>, Status> {
                let payment = record(&tenant, tx, request.into_inner()).await?;
                Ok(Response::new(payment))
            }

            async fn get_payment(&self, request: Request<GetPaymentRequest>) -> Result<Response<Payment>, Status> {
                read(request).await
            }
        }
        "#,
    ),
    (
        "grpc_external_method_with_named_server",
        r#"
        #[grpc(server = refunds_server::RefundsServer)]
        impl refunds_server::Refunds for RefundsApi {
            #[idempotent(global, external, lease = "10s", timeout = "5s", backend = Sqlite)]
            async fn refund(&self, ctx: IdempotencyContext, request: Request<Refund>) -> Result<Response<Refund>, Status> {
                call_processor(ctx.derive("processor"), request.into_inner()).await
            }
        }
        "#,
    ),
    (
        "fingerprint_only_fields",
        r#"
        #[idempotent(scope = "tenant", fingerprint_only = ["/amount", "/payer/id"])]
        async fn pay(tenant: Tenant, tx: &mut Transaction<'_, Postgres>, Json(body): Json<Value>) {
            let _ = (tenant, tx, body);
        }
        "#,
    ),
    (
        "webhook_key_header",
        r#"
        #[idempotent(scope = "endpoint", key_header = "Webhook-Id", retention = "3d")]
        async fn receive(
            endpoint: ProcessorWebhooks,
            tx: &mut Transaction<'_, Postgres>,
            Verified(event): Verified<Event>,
        ) -> Json<Value> {
            credit(tx, event).await
        }
        "#,
    ),
    (
        "optional_key_in_body",
        r#"
        #[idempotent(global, key_pointer = "/request_id", key_optional, external, backend = Sqlite)]
        pub async fn notify(Json(body): Json<Value>) -> StatusCode {
            send(body).await
        }
        "#,
    ),
    (
        "grpc_key_field_a_keyword",
        r#"
        #[grpc]
        #[tonic::async_trait]
        impl<DB: Sql> Payments for PaymentsApi<DB> {
            #[idempotent(scope = "tenant", key_field = "type")]
            async fn create_payment(
                &self,
                tenant: Tenant,
                tx: &mut Transaction<'_, DB>,
                request: Request<CreatePaymentRequest>,
            ) -> Result<Response<Payment>, Status> {
                let payment = record(&tenant, tx, request.into_inner()).await?;
                Ok(Response::new(payment))
            }
        }
        "#,
    ),
    (
        "fingerprint_except_fields",
        r#"
        #[idempotent(global, fingerprint_except = ["/sent_at"])]
        async fn log(tx: &mut Transaction<'_, Postgres>, Json(body): Json<Value>) {
            let _ = (tx, body);
        }
        "#,
    ),
    (
        "transactional_scope_param",
        r#"
        #[idempotent(scope = "account", retention = "7d")]
        async fn create_payment(
            Path(account): Path<String>,
            tx: &mut Transaction<'_, Postgres>,
            Json(body): Json<NewPayment>,
        ) -> (StatusCode, Json<Payment>) {
            let _ = &mut **tx;
            (StatusCode::CREATED, Json(Payment { account, amount: body.amount }))
        }
        "#,
    ),
    (
        "transactional_plain_scope_type",
        r#"
        #[idempotent(scope = "tenant")]
        async fn close_account(tenant: Tenant, tx: &mut Transaction<'_, Postgres>) -> StatusCode {
            let _ = (tenant, tx);
            StatusCode::NO_CONTENT
        }
        "#,
    ),
    (
        "global_without_extractor",
        r#"
        #[idempotent(global)]
        async fn rotate(tx: &mut Transaction<'_, Postgres>) {
            let _ = &mut **tx;
        }
        "#,
    ),
    (
        "global_with_retention_and_body",
        r#"
        #[idempotent(global, retention = "90m")]
        async fn import(tx: &mut Transaction<'_, Postgres>, Json(rows): Json<Vec<i64>>) -> StatusCode {
            let _ = (&mut **tx, rows);
            StatusCode::ACCEPTED
        }
        "#,
    ),
    (
        "scope_in_pattern_before_transaction",
        r#"
        #[idempotent(scope = "tenant")]
        async fn cancel_payment(
            tx: &mut Transaction<'_, Postgres>,
            Extension(tenant): Extension<String>,
        ) -> StatusCode {
            let _ = (tenant, &mut **tx);
            StatusCode::OK
        }
        "#,
    ),
    (
        "external_lease_backend_context",
        r#"
        #[idempotent(external, scope = "account", retention = "24h", lease = "5s", backend = Postgres)]
        async fn send_email(
            Path(account): Path<String>,
            ctx: IdempotencyContext,
            Json(body): Json<serde_json::Value>,
        ) -> (StatusCode, String) {
            let downstream_key = ctx.derive("email");
            let _ = (account, body);
            (StatusCode::ACCEPTED, downstream_key)
        }
        "#,
    ),
    (
        "external_default_backend",
        r#"
        #[idempotent(external, scope = "account")]
        async fn ping(Path(account): Path<String>) -> String {
            account
        }
        "#,
    ),
    (
        "external_timeout",
        r#"
        #[idempotent(external, scope = "account", lease = "1m", timeout = "59s", backend = sqlx::Postgres)]
        async fn send_email(Path(account): Path<String>, ctx: IdempotencyContext) -> String {
            format!("{account} {}", ctx.derive("email"))
        }
        "#,
    ),
    (
        "steps",
        r#"
        #[idempotent(external, scope = "tenant", retention = "24h", lease = "5s")]
        async fn create_order(
            Path(tenant): Path<String>,
            steps: Steps<Postgres>,
            Json(quantity): Json<i64>,
        ) -> Result<(StatusCode, String), OrderError> {
            let reserved: i64 = steps.step("reserve", async |tx| Ok(quantity)).await?;
            let charge: String = steps.call("charge", async |key| charge(key, reserved).await).await?;
            Ok((StatusCode::CREATED, format!("{tenant} {charge}")))
        }
        "#,
    ),
    (
        "context_in_transactional_mode",
        r#"
        #[idempotent(global)]
        async fn charge(ctx: IdempotencyContext, tx: &mut sqlx::Transaction<'_, Postgres>) -> String {
            let _ = &mut **tx;
            ctx.derive("charge")
        }
        "#,
    ),
    (
        "timeout_wait_impl_trait",
        r#"
        #[idempotent(scope = "account", retention = "24h", timeout = "2m", wait = "5s")]
        async fn create_payment(
            Path(account): Path<String>,
            tx: &mut Transaction<'_, Postgres>,
            Json(body): Json<serde_json::Value>,
        ) -> Result<impl IntoResponse, StatusCode> {
            let _ = (account, tx, body);
            Ok(StatusCode::CREATED)
        }
        "#,
    ),
    (
        "state_and_replay_5xx",
        r#"
        #[idempotent(scope = "tenant", retention = "1h30m", replay_5xx = true, state = AppState)]
        async fn create_payment(
            State(state): State<AppState>,
            tenant: Tenant,
            tx: &mut Transaction<'_, Postgres>,
            Json(body): Json<NewPayment>,
        ) -> StatusCode {
            let _ = (state, tenant, tx, body);
            StatusCode::CREATED
        }
        "#,
    ),
    (
        "generic_database",
        r#"
        #[idempotent(scope = "tenant")]
        async fn named<DB: Backend>(tenant: String, tx: &mut Transaction<'_, DB>) -> Named<DB> {
            let _ = (tenant, tx);
            Named(std::marker::PhantomData)
        }
        "#,
    ),
    (
        "generic_database_with_state",
        r#"
        #[idempotent(scope = "tenant", state = Store<DB>)]
        async fn checked<DB>(tenant: String, tx: &mut Transaction<'_, DB>) -> StatusCode
        where
            DB: Backend,
        {
            let _ = (tenant, tx);
            StatusCode::CREATED
        }
        "#,
    ),
    (
        "const_parameter",
        r#"
        #[idempotent(scope = "tenant")]
        async fn headers<const N: usize>(
            tenant: String,
            tx: &mut Transaction<'_, Postgres>,
        ) -> (StatusCode, [(HeaderName, &'static str); N]) {
            let _ = (tenant, tx);
            (StatusCode::OK, std::array::from_fn(|_| (header::CACHE_CONTROL, "no-store")))
        }
        "#,
    ),
    (
        "custom_last_extractor_and_attributes",
        r#"
        #[idempotent(scope = "tenant", state = AppState)]
        /// Creates a payment.
        #[allow(unused_variables)]
        pub(crate) async fn create(
            tenant: Tenant,
            tx: &mut Transaction<'_, Postgres>,
            #[allow(unused)] caller: Caller,
        ) -> StatusCode {
            StatusCode::CREATED
        }
        "#,
    ),
    (
        "refused_several_errors",
        r#"
        #[idempotent(scope = "tenant", retention = "1.5h", replay_5xx = 1)]
        fn create(Json(body): Json<serde_json::Value>, tenant: String) {
            let _ = (body, tenant);
        }
        "#,
    ),
    (
        "refused_no_arguments",
        r#"
        #[idempotent]
        async fn create(tenant: String, tx: &mut Transaction<'_, Postgres>) {
            let _ = (tenant, tx);
        }
        "#,
    ),
    (
        "refused_generic_with_lifetime",
        r#"
        #[idempotent(scope = "tenant")]
        pub async fn create<'a, DB: Backend>(tenant: String, tx: &mut Transaction<'a, DB>) -> &'a str
        where
            DB: Send,
        {
            let _ = (tenant, tx);
            ""
        }
        "#,
    ),
    (
        "refused_not_a_function",
        r#"
        #[idempotent(global)]
        struct CreatePayment {
            amount: i64,
        }
        "#,
    ),
];

/// Whether a case is left out of this build: see [`SEVERAL_DATABASES`].
fn skipped(name: &str) -> bool {
    SEVERAL_DATABASES && name == "external_default_backend"
}

/// Splits `#[idempotent(<args>)] <item>` into the attribute's arguments and the item.
fn split_attribute(source: &str) -> (TokenStream, TokenStream) {
    let tokens: TokenStream = source.parse().expect("a case is valid Rust tokens");
    let mut tokens = tokens.into_iter();
    match tokens.next() {
        Some(TokenTree::Punct(pound)) if pound.as_char() == '#' => {}
        other => panic!("a case starts with its `#[idempotent]` attribute, not {other:?}"),
    }
    let Some(TokenTree::Group(attribute)) = tokens.next() else {
        panic!("a case starts with its `#[idempotent]` attribute");
    };
    let mut inside = attribute.stream().into_iter();
    assert!(
        matches!(inside.next(), Some(TokenTree::Ident(name)) if name == "idempotent" || name == "grpc"),
        "a case starts with its `#[idempotent]` or `#[grpc]` attribute"
    );
    let args = match inside.next() {
        None => TokenStream::new(),
        Some(TokenTree::Group(args)) if args.delimiter() == Delimiter::Parenthesis => args.stream(),
        Some(other) => panic!("unexpected {other} in the attribute"),
    };
    (args, tokens.collect())
}

/// What the attribute emits for the case, pretty-printed.
fn expanded(source: &str) -> String {
    let (args, item) = split_attribute(source);
    let tokens = if source.trim_start().starts_with("#[grpc") {
        crate::grpc::service(args, item)
    } else {
        crate::expand_or_refuse(args, item)
    };
    let file: syn::File = syn::parse2(tokens.clone())
        .unwrap_or_else(|error| panic!("the expansion does not parse ({error}):\n{tokens}"));
    prettyplease::unparse(&file)
}

/// The folder of the snapshot files.
fn snapshot_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/expansion")
}

/// The lines where `expected` and `actual` part, each side's with `-` or `+`, between the
/// lines they share at the start and at the end.
fn diff(expected: &str, actual: &str) -> String {
    let expected: Vec<&str> = expected.lines().collect();
    let actual: Vec<&str> = actual.lines().collect();
    let start = expected
        .iter()
        .zip(&actual)
        .take_while(|(a, b)| a == b)
        .count();
    let end = expected[start..]
        .iter()
        .rev()
        .zip(actual[start..].iter().rev())
        .take_while(|(a, b)| a == b)
        .count();
    let mut out = format!("@@ line {} @@\n", start + 1);
    for line in &expected[start..expected.len() - end] {
        out.push_str(&format!("-{line}\n"));
    }
    for line in &actual[start..actual.len() - end] {
        out.push_str(&format!("+{line}\n"));
    }
    out
}

#[test]
fn each_expansion_matches_its_snapshot() {
    let overwrite = std::env::var("IDEM_SNAPSHOTS").is_ok_and(|value| value == "overwrite");
    let dir = snapshot_dir();
    let mut failures = Vec::new();
    for (name, source) in CASES.iter().filter(|(name, _)| !skipped(name)) {
        let path = dir.join(format!("{name}.expanded.rs"));
        let actual = expanded(source);
        let expected = fs::read_to_string(&path).ok();
        if expected.as_deref() == Some(actual.as_str()) {
            continue;
        }
        if overwrite {
            fs::create_dir_all(&dir).expect("create the snapshot folder");
            fs::write(&path, &actual).expect("write the snapshot");
            continue;
        }
        failures.push(match expected {
            Some(expected) => format!(
                "{} differs from the expansion:\n{}",
                path.display(),
                diff(&expected, &actual)
            ),
            None => format!("{} is missing; the expansion is:\n{actual}", path.display()),
        });
    }
    assert!(
        failures.is_empty(),
        "{}\n\nIf the change is intended, rewrite the snapshots with `IDEM_SNAPSHOTS=overwrite cargo test -p idem-macros` and read their diff.",
        failures.join("\n\n")
    );
}

#[test]
fn each_snapshot_has_its_case() {
    let Ok(entries) = fs::read_dir(snapshot_dir()) else {
        return;
    };
    for entry in entries {
        let file = entry.expect("read the snapshot folder").file_name();
        let file = file.to_string_lossy();
        let name = file.strip_suffix(".expanded.rs").unwrap_or(&file);
        assert!(
            CASES.iter().any(|(case, _)| *case == name),
            "tests/expansion/{file} has no case in `CASES`: delete it"
        );
    }
}
