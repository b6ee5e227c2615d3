//! What identifies the caller: the `scope` of a key.

use std::borrow::Cow;

/// The longest scope value keys can be stored under, in bytes; a longer one is answered 400
/// [`ProblemKind::InvalidScope`](crate::problem::ProblemKind::InvalidScope). It keeps
/// `(scope, key)` within what a PostgreSQL index entry holds.
pub const MAX_SCOPE_LEN: usize = 1024;

/// A value that identifies the caller of an idempotent handler: a tenant, an account, an API
/// client. Keys are stored and looked up under `(scope, key)`, so two callers never see each
/// other's keys or responses.
///
/// `#[idempotent(scope = "tenant")]` requires the type of the `tenant` parameter to implement
/// this trait. It is implemented for strings, integers, `uuid::Uuid` (feature `uuid`), and for
/// references and smart pointers to those; implement it for your own tenant type:
///
/// ```
/// use std::borrow::Cow;
/// use idem_runtime::IdempotencyScope;
///
/// struct Tenant { id: String }
///
/// impl IdempotencyScope for Tenant {
///     fn idempotency_scope(&self) -> Cow<'_, str> {
///         Cow::Borrowed(&self.id)
///     }
/// }
/// ```
///
/// The value must be stable for a caller: not empty, without U+0000, at most
/// [`MAX_SCOPE_LEN`](crate::scope::MAX_SCOPE_LEN) bytes (anything else is answered with a 400
/// `InvalidScope` problem rather than mixed with global keys or refused by the database).
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be used as an idempotency scope",
    label = "the `scope` parameter's type must implement `idem_runtime::IdempotencyScope`",
    note = "implement `idem_runtime::IdempotencyScope` for `{Self}`, returning the caller's id, or name another parameter in `scope`"
)]
pub trait IdempotencyScope {
    /// The caller's identity as stored beside the key.
    fn idempotency_scope(&self) -> Cow<'_, str>;
}

impl IdempotencyScope for str {
    fn idempotency_scope(&self) -> Cow<'_, str> {
        Cow::Borrowed(self)
    }
}

impl IdempotencyScope for String {
    fn idempotency_scope(&self) -> Cow<'_, str> {
        Cow::Borrowed(self)
    }
}

impl<T: IdempotencyScope + ?Sized> IdempotencyScope for &T {
    fn idempotency_scope(&self) -> Cow<'_, str> {
        (**self).idempotency_scope()
    }
}

impl<T: IdempotencyScope + ?Sized> IdempotencyScope for Box<T> {
    fn idempotency_scope(&self) -> Cow<'_, str> {
        (**self).idempotency_scope()
    }
}

impl<T: IdempotencyScope + ?Sized> IdempotencyScope for std::sync::Arc<T> {
    fn idempotency_scope(&self) -> Cow<'_, str> {
        (**self).idempotency_scope()
    }
}

macro_rules! integer_scopes {
    ($($t:ty),*) => {$(
        impl IdempotencyScope for $t {
            fn idempotency_scope(&self) -> Cow<'_, str> {
                Cow::Owned(self.to_string())
            }
        }
    )*};
}

integer_scopes!(u16, u32, u64, u128, usize, i16, i32, i64, i128, isize);

#[cfg(feature = "uuid")]
impl IdempotencyScope for uuid::Uuid {
    fn idempotency_scope(&self) -> Cow<'_, str> {
        Cow::Owned(self.hyphenated().to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn common_ids_are_scopes() {
        assert_eq!("t1".idempotency_scope(), "t1");
        assert_eq!(String::from("t2").idempotency_scope(), "t2");
        assert_eq!(42_u64.idempotency_scope(), "42");
        let by_ref: &i32 = &-7;
        assert_eq!(IdempotencyScope::idempotency_scope(&by_ref), "-7");
        assert_eq!(
            std::sync::Arc::new(String::from("t3")).idempotency_scope(),
            "t3"
        );
    }
}
