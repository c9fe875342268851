//! Names that end up in store keys, as a hostile or careless client sends them: `{`, `}`, `:`, `@`, NUL,
//! non-ASCII, 10 kB. Each is refused with `invalid_request` (charging nothing) or, where a key ends
//! with it (users, idempotency keys), handled as a name of its own; two names never share a key: on every store, the Cluster included, where a
//! name that moved a key's hash tag would also move it off its tenant's slot.

mod support;

use support::{Harness, admitted, denied};
use tollgate::admission::{IdempotencyKey, KeyRepeat, Reason};
use tollgate::config::names;
use tollgate::store::Store;

/// A user may have at most 150 tokens of burst; the tenant 100,000.
const BODY: &str = "limits: { tokens_per_minute: 600000, burst_tokens: 100000 }\n\
                    default_user: { tokens_per_minute: 600, burst_tokens: 150 }\n";

fn hostile() -> Vec<String> {
    vec![
        "a{b".into(),
        "}".into(),
        "{x}".into(),
        "a:b".into(),
        "@".into(),
        "a@0123456789ab".into(),
        "nul\u{0}".into(),
        "é".into(),
        "tab\there".into(),
        " ".into(),
        "x".repeat(10_000),
        String::new(),
    ]
}

async fn hostile_names_are_refused_and_charge_nothing<S: Store>(h: Harness<S>) {
    let before = h.reserve(0, 1).await;
    let left = admitted(&before).headroom.tokens.expect("a token window").remaining;
    for name in hostile() {
        let mut tenant = h.attributes(10, 10);
        tenant.tenant = Some(name.clone());
        let mut model = h.attributes(10, 10);
        model.model = Some(name.clone());
        let mut key = h.attributes(10, 10);
        key.idempotency = Some(IdempotencyKey { key: name.clone(), repeat: KeyRepeat::NewAttempt });
        let shown: String = name.chars().take(20).collect();
        for (field, a) in [("tenant", tenant), ("model", model), ("idempotency key", key)] {
            let d = h.admission.reserve(&a).await;
            // An idempotency key ends its key, so `{`, `}` and `:` are fine in it: a key of its own.
            if field == "idempotency key" && names::check_idempotency_key(&name).is_ok() {
                let id = admitted(&d).reservation_id.clone();
                h.admission.release(&id).await.unwrap();
                continue;
            }
            let refused = denied(&d);
            // A malformed (or unserved) name is a bad request.
            let expected = Reason::InvalidRequest;
            assert_eq!(refused.reason, expected, "{field} {shown:?}: {refused:?}");
        }
    }
    let after = h.reserve(0, 1).await;
    let now = admitted(&after).headroom.tokens.expect("a token window").remaining;
    // The first probe's 1 token is still held; the refusals between the probes charged nothing
    // (refill can only add).
    assert!(now >= left - 1, "refusals charged the tenant: {left} then {now}");
}

/// User ids may hold `{`, `}` and `:` (they end a key, after the tenant's hash tag): each is a
/// user of its own, with its own bucket, even when it spells another key's suffix.
async fn odd_user_ids_are_users_of_their_own<S: Store>(h: Harness<S>) {
    let users = ["a", "a:b", "{a}", "a}", "s:t", "m:m", "i:k"];
    for user in users {
        let mut a = h.attributes(140, 10);
        a.user = Some(user.to_string());
        admitted(&h.admission.reserve(&a).await);
    }
    // Each user's 150-token burst is now spent by its own hold, and only by it.
    for user in users {
        let mut a = h.attributes(140, 10);
        a.user = Some(user.to_string());
        let d = h.admission.reserve(&a).await;
        assert_eq!(denied(&d).reason, Reason::TokenRate, "user {user:?} shares no bucket: {d:?}");
    }
    for bad in ["a b", "nul\u{0}", "é", &"u".repeat(10_000)] {
        let mut a = h.attributes(1, 1);
        a.user = Some(bad.to_string());
        let shown: String = bad.chars().take(9).collect();
        assert_eq!(denied(&h.admission.reserve(&a).await).reason, Reason::InvalidRequest, "{shown:?}");
    }
}

#[tokio::test]
async fn embedded_hostile_names_are_refused_and_charge_nothing() {
    hostile_names_are_refused_and_charge_nothing(support::embedded(BODY).await).await;
}

#[tokio::test]
async fn redis_hostile_names_are_refused_and_charge_nothing() {
    hostile_names_are_refused_and_charge_nothing(support::redis(BODY).await).await;
}

#[tokio::test]
async fn cluster_hostile_names_are_refused_and_charge_nothing() {
    hostile_names_are_refused_and_charge_nothing(support::cluster(BODY).await).await;
}

#[tokio::test]
async fn embedded_odd_user_ids_are_users_of_their_own() {
    odd_user_ids_are_users_of_their_own(support::embedded(BODY).await).await;
}

#[tokio::test]
async fn redis_odd_user_ids_are_users_of_their_own() {
    odd_user_ids_are_users_of_their_own(support::redis(BODY).await).await;
}

#[tokio::test]
async fn cluster_odd_user_ids_are_users_of_their_own() {
    odd_user_ids_are_users_of_their_own(support::cluster(BODY).await).await;
}
