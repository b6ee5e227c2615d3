//! Error collection: each check reports into a list instead of stopping the macro, and the list
//! becomes one `syn::Error` whose parts keep their own spans, so that the compiler shows every
//! problem at once (serde_derive's `ctxt.rs` does the same); and the fix a tonic method's
//! refusal ends with, whose words depend on a feature of idem-runtime. Every other file may
//! import this one; it imports none of them.

/// Folds errors into one, so that each is reported at its own span.
pub fn combine(errors: impl IntoIterator<Item = syn::Error>) -> Option<syn::Error> {
    errors.into_iter().reduce(|mut all, next| {
        all.combine(next);
        all
    })
}

/// `result` when it is `Ok` and nothing was collected beside it; else every error, those
/// collected first, then `result`'s.
pub fn unless_collected<T>(mut errors: Vec<syn::Error>, result: syn::Result<T>) -> syn::Result<T> {
    match result {
        Ok(value) if errors.is_empty() => Ok(value),
        Ok(_) => Err(combine(errors).expect("one error at least")),
        Err(more) => {
            errors.push(more);
            Err(combine(errors).expect("one error at least"))
        }
    }
}

/// How to make a tonic method's `#[idempotent]` work, to end a refusal with: mark the impl;
/// and where idem-runtime's `grpc` feature is off, turn it on first (`#[idem_runtime::grpc]`
/// does not exist then, as rustc says beside this).
pub fn tonic_method_fix(grpc_feature: bool) -> &'static str {
    if grpc_feature {
        "put `#[idem_runtime::grpc]` on the impl, above `#[tonic::async_trait]`"
    } else {
        "turn on the `grpc` feature of `idem-runtime` (`features = [\"grpc\", ...]`), which is \
         off, and put `#[idem_runtime::grpc]` on the impl, above `#[tonic::async_trait]`"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tonic_method_without_the_grpc_feature_is_told_to_turn_it_on() {
        let with = tonic_method_fix(true);
        assert_eq!(
            with,
            "put `#[idem_runtime::grpc]` on the impl, above `#[tonic::async_trait]`"
        );
        let without = tonic_method_fix(false);
        assert!(
            without.starts_with("turn on the `grpc` feature of `idem-runtime`"),
            "{without}"
        );
        assert!(without.ends_with(with), "{without}");
    }
}
