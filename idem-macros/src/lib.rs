//! The `#[idempotent]` attribute. Use it through `idem-runtime`, which re-exports it and holds
//! everything the generated code calls.
//!
//! The pipeline is parse (`args.rs`, with the JSON Pointers of `fingerprint_*` in `fields.rs`
//! and the durations in `duration.rs`), validate (`handler.rs`, one check a function, under
//! `handler/`), expand (`expand.rs`, one generated part a function, under `expand/`, the paths
//! into `idem-runtime` in `expand/paths.rs`), read in `expand_or_refuse`: every error of the
//! first two stages is collected (`errors.rs`) and reported at once, spanned on the offending
//! token, next to the unchanged function (renamed) and a stand-in handler of the original name
//! (`expand/refused.rs`), so that the rest of the crate still type-checks and `.route(...)`
//! adds no error of its own.
//!
//! `#[grpc]`, on the impl of a tonic service, runs the same pipeline a method at a time, under
//! `grpc/` (read in `grpc.rs`): parse (`grpc/parse.rs`, each method's arguments by `args.rs`),
//! validate (`grpc/validate.rs` and `grpc/rpc.rs`, the method as a handler by `handler.rs`),
//! expand (`grpc/expand.rs`, from the parts of `expand/`), a stand-in of the trait's signature
//! for each refused method (`grpc/refused.rs`). A plain `fn` under `#[idempotent]` is first
//! asked whether async-trait made it of a tonic method (`grpc/async_trait.rs`); an `async fn`,
//! as every Axum handler is, never is.
//!
//! The output of each kind of handler is recorded under `tests/expansion/` (see
//! `expansion_tests.rs`). No chain of imports between the files comes back to where it
//! started: a stage imports the ones before it (`grpc/` imports all three, and none of them
//! `grpc/`), and `errors.rs` and `expand/paths.rs`, which any file may import, import nothing of
//! the crate.

use proc_macro::TokenStream;

mod args;
mod duration;
mod errors;
mod expand;
#[cfg(test)]
mod expansion_tests;
mod fields;
mod grpc;
mod handler;
mod key;

/// Makes an Axum handler safe to retry with the `Idempotency-Key` header.
///
/// ```text
/// #[idempotent(scope = "tenant", retention = "24h", replay_5xx = false)]
/// async fn create_payment(
///     tenant: Tenant,
///     tx: &mut Transaction<'_, Postgres>,
///     Json(body): Json<NewPayment>,
/// ) -> Result<(StatusCode, Json<Payment>), ApiError> { ... }
/// ```
///
/// Arguments:
///
/// - `scope = "<param>"`: the parameter that identifies the caller; its type implements
///   `idem_runtime::IdempotencyScope`. Required unless `global` is given.
/// - `global`: keys are shared by all callers, on purpose.
/// - `retention = "<duration>"`: how long the outcome is replayed (`"90m"`, `"24h"`, `"7d"`,
///   `"1h30m"`; units `s`, `m`, `h`, `d`). Default `"24h"`.
/// - `replay_5xx = <bool>`: store and replay a 5xx outcome (its writes undone) instead of
///   rolling it back. Default `false`.
/// - `timeout = "<duration>"`: how long the handler body may run (`"10s"`, `"2m"`). Past it the
///   body's future is dropped, its transaction rolled back (in external mode its claim
///   released), and the client gets a 503 problem (`HandlerTimedOut`) telling it to retry with
///   the same key; nothing is stored. In external mode it must be shorter than `lease`.
///   Needs a Tokio runtime with the time driver (as `#[tokio::main]` builds). Default: none, the
///   body runs for as long as it takes.
///
/// - `external`: the handler has no transaction parameter, on purpose: its side effect is
///   outside the database (external mode, below). Required then, and refused otherwise, so
///   that a handler that loses its transaction parameter never changes mode unnoticed.
/// - `lease = "<duration>"`: external mode only: how long a claim is exclusive, after which a
///   retry may take the key over. Longer than the slowest legitimate run, at most `retention`.
///   Default `"30s"`.
/// - `backend = <type>`: external mode only: the database of the key table, `sqlx::Postgres`,
///   `sqlx::Sqlite` or `sqlx::MySql` (a transactional handler's transaction names it, a
///   `Steps<DB>` parameter its `DB`). Default: the database whose feature is on in
///   `idem-runtime`; with several on, required.
///
/// - `key_header = "<name>"`: the key is in this request header instead of `Idempotency-Key` (a
///   webhook's `"webhook-id"`, `"X-GitHub-Delivery"`); same syntax, limits and 400s.
/// - `key_pointer = "<pointer>"`: the key is the string field of the JSON body this JSON
///   Pointer names (`"/request_id"`); the field still counts in the fingerprint.
/// - `key_field = "<field>"`: tonic methods only: the key is this string field of the request
///   message (AIP-155's `"request_id"`), checked at compile time to exist and be a string.
/// - `key_optional`: a request without a key runs once, unprotected, storing nothing (not with
///   `Steps`).
///
/// - `state = <type>`: the router's state. Optional, recommended: the handler is then checked
///   at its definition, with errors on the type at fault, that the state provides
///   `Store<DB>` (`FromRef`) and that every argument but the last reads only the request's
///   parts (instead of one `Handler` error at `.route(...)`). The handler is then an Axum
///   handler of exactly that state (a hidden extractor pins it).
///
/// On PostgreSQL a handler with a `timeout` also gets `statement_timeout` = twice the timeout
/// for its transaction, so that a statement in flight when the body is stopped ends too.
///
/// A handler may have type parameters, such as its database (`async fn create<DB: Backend>(tx:
/// &mut Transaction<'_, DB>, ...)`, routed as `post(create::<Postgres>)`); not lifetimes.
///
/// Two modes, chosen by the signature:
///
/// - **Transactional**: the handler takes one `&mut sqlx::Transaction<'_, DB>`; the macro
///   begins it, claims the key in it, and commits the handler's writes together with the
///   stored response, or neither.
/// - **External** (`external`): the handler takes no transaction; the claim is committed first
///   as a `started` row with a lease, the body runs (a call to another system), and the
///   response is stored afterwards. Pass `IdempotencyContext::derive` keys downstream. A
///   handler with an `idem_runtime::Steps<DB>` parameter runs in this mode too.
///
/// Any handler may take an `idem_runtime::IdempotencyContext` parameter. The router's state
/// must provide `idem_runtime::Store<DB>` through `FromRef`.
#[proc_macro_attribute]
pub fn idempotent(attr: TokenStream, item: TokenStream) -> TokenStream {
    expand_or_refuse(attr.into(), item.into()).into()
}

/// Marks the impl of a tonic service whose methods are `#[idempotent]`: put it above
/// `#[tonic::async_trait]` (it adds that attribute when it is missing), so that it rewrites each
/// marked `async fn` before async-trait does. The service's full name comes from the server
/// tonic generated for the trait (`Payments` is served by `PaymentsServer`, next to it); name
/// another with `#[grpc(server = path::to::Server)]`.
///
/// A marked method takes `&self`, then the values it reads from the call's metadata (each
/// `FromMetadata`), the transaction (`&mut sqlx::Transaction<'_, DB>`, or nothing in external
/// mode), and last the call's `tonic::Request<Message>`; it returns `Result<Response<Reply>,
/// Status>`. The service provides the store through `FromRef`. Its arguments are those of
/// `#[idempotent]` on an Axum handler, but `state` and the `fingerprint_*` ones; and `rpc =
/// "GetHTTPStatus"` gives the method's name in the `.proto` when it is not the Rust name in
/// upper camel case (checked against the name tonic makes of it).
#[proc_macro_attribute]
pub fn grpc(attr: TokenStream, item: TokenStream) -> TokenStream {
    grpc::service(attr.into(), item.into()).into()
}

/// The handler rewritten, or, when it is refused, the errors beside it.
fn expand_or_refuse(
    attr: proc_macro2::TokenStream,
    item: proc_macro2::TokenStream,
) -> proc_macro2::TokenStream {
    let function = syn::parse2::<syn::ItemFn>(item.clone());
    // A plain `fn` may be what async-trait made of a tonic method whose impl has no `#[grpc]`;
    // such a method is refused alone, and what stands in for it matches the trait.
    if let Ok(function) = &function
        && function.sig.asyncness.is_none()
        && let Some(refusal) = grpc::async_trait::refusal(function)
    {
        return refusal;
    }
    match parse_and_validate(attr, function) {
        Ok((args, handler)) => expand::handler(&args, &handler),
        Err(errors) => expand::after_errors(item, &errors),
    }
}

/// The arguments and the handler, each checked; the errors of both at once when either is
/// wrong (the signature is still checked against the arguments that could be read).
fn parse_and_validate(
    attr: proc_macro2::TokenStream,
    function: syn::Result<syn::ItemFn>,
) -> Result<(args::Args, handler::Handler), syn::Error> {
    let (args, mut errors) = args::parse(attr);
    if let Some(rpc) = &args.rpc {
        errors.push(syn::Error::new_spanned(
            rpc,
            "`rpc` names a method of a tonic service, in an impl marked `#[idem_runtime::grpc]`; an Axum handler's route is its path",
        ));
    }
    if let key::KeyArg::Field(field) = &args.key {
        errors.push(syn::Error::new(
            field.span(),
            "`key_field` names a field of a tonic request message; an Axum handler takes its key from a header (`key_header`) or a field of its JSON body (`key_pointer`)",
        ));
    }
    let validated = match function {
        Ok(function) => handler::analyse(function, &args),
        Err(error) => Err(syn::Error::new(
            error.span(),
            "`#[idempotent]` applies to an `async fn` handler",
        )),
    };
    let handler = errors::unless_collected(errors, validated)?;
    Ok((args, handler))
}
