//! Error collection: each check reports into a list instead of stopping the macro, and the list
//! becomes one `syn::Error` whose parts keep their own spans, so that the compiler shows every
//! problem at once (serde_derive's `ctxt.rs` does the same); and the one refusal whose words
//! depend on a feature of idem-runtime. Every other file may import this one; it imports none
//! of them.

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

/// The refusal of a tonic method's `#[idempotent]` that lacks `#[idem_runtime::grpc]` on its
/// impl: `message` where idem-runtime's `grpc` feature is on; where it is off that attribute
/// does not exist (rustc says so beside this), and the fix is the feature, not the attribute.
pub fn unless_grpc_is_off(grpc_feature: bool, message: &str) -> String {
    if grpc_feature {
        return message.to_owned();
    }
    "`#[idempotent]` on a tonic method needs the `grpc` feature of `idem-runtime`, which is off: \
     `idem-runtime = { ..., features = [\"grpc\", ...] }`; then mark the impl \
     `#[idem_runtime::grpc]`, above `#[tonic::async_trait]`"
        .to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tonic_method_without_the_grpc_feature_is_told_to_turn_it_on() {
        let with = unless_grpc_is_off(true, "put `#[idem_runtime::grpc]` on the impl");
        assert_eq!(with, "put `#[idem_runtime::grpc]` on the impl");
        let without = unless_grpc_is_off(false, "put `#[idem_runtime::grpc]` on the impl");
        assert!(
            without.contains("the `grpc` feature of `idem-runtime`, which is off"),
            "{without}"
        );
        assert!(without.contains("features = [\"grpc\""), "{without}");
    }
}
