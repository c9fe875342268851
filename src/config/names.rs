//! The rules for names that end up inside store keys: tenants, pools, users, models and
//! idempotency keys. They are policy (a policy file names tenants and users too), so they live
//! here, and admission applies the same rules to what a request carries.
//!
//! A tenant id is part of every key's hash tag (see `store::keys`), so it may not contain `{` or
//! `}` (they would move the tag), `:` (the key separator, and the separator of a reservation
//! id's parts) or `@` (a leased hold's id ends `@<replica>`, and the lease index names replicas
//! `@<replica>`: a tenant starting or holding `@` would read as one). User ids, model names and idempotency keys end a key, so only visible ASCII and a
//! length bound are asked of them.

/// Longest tenant, user, model or idempotency key accepted.
pub const MAX_ID_LEN: usize = 128;

/// Why an identifier was refused; the message is shown to the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    #[error("is empty")]
    Empty,
    #[error("is longer than 128 bytes")]
    TooLong,
    #[error("may contain only visible ASCII characters")]
    NotVisibleAscii,
    #[error("may not contain '{{', '}}', ':' or '@'")]
    Reserved,
}

fn visible(id: &str) -> Result<(), IdError> {
    if id.is_empty() {
        return Err(IdError::Empty);
    }
    if id.len() > MAX_ID_LEN {
        return Err(IdError::TooLong);
    }
    if !id.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(IdError::NotVisibleAscii);
    }
    Ok(())
}

pub fn check_tenant(id: &str) -> Result<(), IdError> {
    visible(id)?;
    if id.contains(['{', '}', ':', '@']) {
        return Err(IdError::Reserved);
    }
    Ok(())
}

pub fn check_user(id: &str) -> Result<(), IdError> {
    visible(id)
}

pub fn check_idempotency_key(key: &str) -> Result<(), IdError> {
    visible(key)
}

pub fn check_model(name: &str) -> Result<(), IdError> {
    visible(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tenant_ids_that_would_break_the_hash_tag_are_refused() {
        for bad in ["a{b", "a}b", "a:b", "@", "a@b", "", "a b", "é"] {
            assert!(check_tenant(bad).is_err(), "{bad:?}");
        }
        assert!(check_tenant(&"x".repeat(129)).is_err());
        assert!(check_tenant("acme-prod.eu_1").is_ok());
        assert!(check_user("alice:ops").is_ok());
    }
}
