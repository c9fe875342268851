//! Identifiers that end up inside Redis keys, and the reservation id format.
//!
//! A tenant id is part of every key's hash tag (see [`crate::store::keys`]), so it may not contain
//! `{` or `}` (they would move the tag) or `:` (the key separator). User ids, model names and
//! idempotency keys end a key, so only visible ASCII and a length bound are asked of them.

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
    #[error("may not contain '{{', '}}' or ':'")]
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
    if id.contains(['{', '}', ':']) {
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

/// A new reservation id: the tenant, the backend pool when capacity admission holds work in one,
/// then 128 random bits in hex, joined by `:`. What the id carries is what lets Commit, Renew and
/// Release find every leg of the hold with nothing but the id.
pub fn new_reservation_id(tenant: &str, pool: Option<&str>) -> String {
    match pool {
        Some(pool) => format!("{tenant}:{pool}:{:032x}", fastrand::u128(..)),
        None => format!("{tenant}:{:032x}", fastrand::u128(..)),
    }
}

/// The legs of a reservation, read from its id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReservationRef<'a> {
    pub tenant: &'a str,
    pub pool: Option<&'a str>,
}

/// Reads a reservation id, or `None` if it is not one tollgate issued.
pub fn parse_reservation_id(id: &str) -> Option<ReservationRef<'_>> {
    let (tenant, rest) = id.split_once(':')?;
    let (pool, random) = match rest.split_once(':') {
        Some((pool, random)) => (Some(pool), random),
        None => (None, rest),
    };
    let hex = random.len() == 32 && random.bytes().all(|b| b.is_ascii_hexdigit());
    let valid = hex && check_tenant(tenant).is_ok() && pool.is_none_or(|p| check_tenant(p).is_ok());
    valid.then_some(ReservationRef { tenant, pool })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tenant_ids_that_would_break_the_hash_tag_are_refused() {
        for bad in ["a{b", "a}b", "a:b", "", "a b", "é"] {
            assert!(check_tenant(bad).is_err(), "{bad:?}");
        }
        assert!(check_tenant(&"x".repeat(129)).is_err());
        assert!(check_tenant("acme-prod.eu_1").is_ok());
        assert!(check_user("alice:ops").is_ok());
    }

    #[test]
    fn reservation_ids_round_trip() {
        let id = new_reservation_id("acme", None);
        assert_eq!(parse_reservation_id(&id), Some(ReservationRef { tenant: "acme", pool: None }));
        let id = new_reservation_id("acme", Some("gpu-a"));
        assert_eq!(parse_reservation_id(&id), Some(ReservationRef { tenant: "acme", pool: Some("gpu-a") }));
        assert_eq!(parse_reservation_id("acme:a{b:0123456789abcdef0123456789abcdef"), None);
        assert_eq!(parse_reservation_id("acme:zz"), None);
        assert_eq!(parse_reservation_id("a{b:0123456789abcdef0123456789abcdef"), None);
        assert_eq!(parse_reservation_id("no-separator"), None);
    }
}
