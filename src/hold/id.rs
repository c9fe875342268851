//! The reservation id: what Commit, Renew and Release are given, and all they are given.
//!
//! `<tenant>:<random>` or, when capacity admission holds work in a backend pool,
//! `<tenant>:<pool>:<random>`: the id carries every leg of the hold, so nothing else need be sent.
//! A hold leased from a replica's slice (see `admission::lease`) lives in the replica's memory and
//! says which replica: `<tenant>[:<pool>]:<random>@<replica>`.
//! The random part is 128 bits from the operating system's randomness, because knowing an id is
//! all it takes to commit or release a hold: it must not be guessable from any other id.

use crate::config::names::check_tenant;

/// Why no id could be made.
#[derive(Debug, thiserror::Error)]
#[error("the operating system's randomness is unavailable: {0}")]
pub struct NoRandomness(#[from] getrandom::Error);

/// A new reservation id: the tenant, the backend pool when capacity admission holds work in one,
/// then 128 random bits from the operating system in hex, joined by `:`.
pub fn new_reservation_id(tenant: &str, pool: Option<&str>) -> Result<String, NoRandomness> {
    let mut bits = [0u8; 16];
    getrandom::fill(&mut bits)?;
    let random = u128::from_be_bytes(bits);
    Ok(match pool {
        Some(pool) => format!("{tenant}:{pool}:{random:032x}"),
        None => format!("{tenant}:{random:032x}"),
    })
}

/// A new id for a hold leased from `replica`'s slice.
pub fn new_leased_reservation_id(tenant: &str, pool: Option<&str>, replica: &str) -> Result<String, NoRandomness> {
    Ok(format!("{}@{replica}", new_reservation_id(tenant, pool)?))
}

/// A replica's name: 48 random bits in hex, new each time the process starts.
pub fn new_replica_id() -> Result<String, NoRandomness> {
    let mut bits = [0u8; 6];
    getrandom::fill(&mut bits)?;
    Ok(bits.iter().map(|b| format!("{b:02x}")).collect())
}

/// The legs of a reservation, read from its id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReservationRef<'a> {
    pub tenant: &'a str,
    pub pool: Option<&'a str>,
    /// The replica whose memory holds a leased hold; `None` for a hold in the store.
    pub replica: Option<&'a str>,
}

/// Reads a reservation id, or `None` if it is not one tollgate issued.
pub fn parse_reservation_id(id: &str) -> Option<ReservationRef<'_>> {
    let (id, replica) = match id.split_once('@') {
        Some((id, replica)) => (id, Some(replica)),
        None => (id, None),
    };
    if replica.is_some_and(|r| r.len() != 12 || !r.bytes().all(|b| b.is_ascii_hexdigit())) {
        return None;
    }
    let (tenant, rest) = id.split_once(':')?;
    let (pool, random) = match rest.split_once(':') {
        Some((pool, random)) => (Some(pool), random),
        None => (None, rest),
    };
    let hex = random.len() == 32 && random.bytes().all(|b| b.is_ascii_hexdigit());
    let valid = hex && check_tenant(tenant).is_ok() && pool.is_none_or(|p| check_tenant(p).is_ok());
    valid.then_some(ReservationRef { tenant, pool, replica })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservation_ids_round_trip() {
        let id = new_reservation_id("acme", None).unwrap();
        assert_eq!(parse_reservation_id(&id), Some(ReservationRef { tenant: "acme", pool: None, replica: None }));
        let id = new_reservation_id("acme", Some("gpu-a")).unwrap();
        assert_eq!(
            parse_reservation_id(&id),
            Some(ReservationRef { tenant: "acme", pool: Some("gpu-a"), replica: None })
        );
        let replica = new_replica_id().unwrap();
        let id = new_leased_reservation_id("acme", Some("gpu-a"), &replica).unwrap();
        assert_eq!(
            parse_reservation_id(&id),
            Some(ReservationRef { tenant: "acme", pool: Some("gpu-a"), replica: Some(&replica) })
        );
        assert_eq!(parse_reservation_id("acme:0123456789abcdef0123456789abcdef@short"), None);
        assert_eq!(parse_reservation_id("acme:0123456789abcdef0123456789abcdef@0a1b2c3d4e5f@0a1b2c3d4e5f"), None);
        assert_eq!(parse_reservation_id("acme:a{b:0123456789abcdef0123456789abcdef"), None);
        assert_eq!(parse_reservation_id("acme:zz"), None);
        assert_eq!(parse_reservation_id("a{b:0123456789abcdef0123456789abcdef"), None);
        assert_eq!(parse_reservation_id("no-separator"), None);
    }

    #[test]
    fn ids_do_not_follow_from_the_process_fast_rng() {
        // fastrand is seeded per thread and can be reseeded by any code in the process: an id drawn
        // from it would repeat after the same seed. The OS's randomness does not.
        fastrand::seed(7);
        let first = new_reservation_id("acme", None).unwrap();
        fastrand::seed(7);
        let second = new_reservation_id("acme", None).unwrap();
        assert_ne!(first, second);
        let many: std::collections::HashSet<_> =
            (0..10_000).map(|_| new_reservation_id("acme", None).unwrap()).collect();
        assert_eq!(many.len(), 10_000);
    }
}
