//! Plans: named sets of tenant settings. A listed tenant takes its plan's settings under its own;
//! a tenant the policy does not list is admitted under the plan its trusted plan header names (its
//! own counters, the plan's limits and terms), or `default_tenant`'s.

mod support;

use std::sync::Arc;

use tollgate::admission::{Admission, Attributes, Decision, Reason};
use tollgate::config::{ExpiredUsage, Policy, Priority};
use tollgate::estimate::PromptSize;
use tollgate::hold::RenewOutcome;
use tollgate::store::Protocol;
use tollgate::store::embedded::EmbeddedStore;

const POLICY: &str = "server:\n  plan_header: x-tollgate-plan\n\
    models:\n  m: { max_output_tokens: 2000 }\n  n: { max_output_tokens: 2000 }\n\
    plans:\n\
    \x20 gold:\n\
    \x20   lease_ttl_ms: 600000\n\
    \x20   max_priority: critical\n\
    \x20   limits: { tokens_per_minute: 600, burst_tokens: 1000, tokens_per_day: 100000, max_concurrency: 8 }\n\
    \x20   default_user: { tokens_per_minute: 60, burst_tokens: 500 }\n\
    \x20   users: { alice: { burst_tokens: 700, tokens_per_minute: 60 } }\n\
    \x20   models: { m: { tokens_per_minute: 60, burst_tokens: 900 } }\n\
    \x20 free:\n\
    \x20   default_priority: sheddable\n\
    \x20   max_priority: sheddable\n\
    \x20   expired_usage: refund\n\
    \x20   limits: { tokens_per_minute: 60, burst_tokens: 150 }\n\
    tenants:\n\
    \x20 acme:\n\
    \x20   plan: gold\n\
    \x20   expired_usage: refund\n\
    \x20   limits: { tokens_per_day: 5000 }\n\
    \x20   users: { bob: { tokens_per_minute: 60, burst_tokens: 100 } }\n\
    \x20   models: { m: { burst_tokens: 800 } }\n\
    default_tenant:\n  plan: free\n";

async fn admission() -> Arc<Admission<EmbeddedStore>> {
    let policy = Policy::parse("plans.yaml", POLICY).unwrap();
    Arc::new(Admission::new(Arc::new(policy), Protocol::new(EmbeddedStore::new().unwrap()).await.unwrap()))
}

fn request(tenant: &str, plan: Option<&str>, max_tokens: u64) -> Attributes {
    Attributes {
        tenant: Some(tenant.into()),
        plan: plan.map(str::to_string),
        user: None,
        model: Some("n".into()),
        priority: None,
        deadline_ms: None,
        wait_ms: None,
        idempotency: None,
        prompt: PromptSize::Tokens(0),
        max_tokens: Some(max_tokens),
        stream: false,
        input_only: false,
        outputs: 1,
    }
}

/// A tenant's own settings win over its plan's, limit by limit; its users and models join the
/// plan's, its own winning a name both give.
#[test]
fn a_tenant_takes_its_plans_settings_under_its_own() {
    let policy = Policy::parse("plans.yaml", POLICY).unwrap();
    let acme = &policy.tenants["acme"];
    let l = &acme.limits;
    assert_eq!(
        (l.tokens_per_minute, l.burst_tokens, l.tokens_per_day, l.max_concurrency),
        (Some(600), Some(1000), Some(5000), Some(8)),
        "the plan's rate and burst, its own day budget"
    );
    assert_eq!(
        (acme.lease_ttl_ms, acme.expired_usage, acme.max_priority),
        (600_000, ExpiredUsage::Refund, Priority::Critical)
    );
    assert_eq!(acme.users["alice"].burst_tokens, Some(700), "the plan's user");
    assert_eq!(acme.users["bob"].burst_tokens, Some(100), "its own user");
    assert_eq!(acme.default_user.as_ref().and_then(|u| u.burst_tokens), Some(500));
    assert_eq!(
        (acme.models["m"].tokens_per_minute, acme.models["m"].burst_tokens),
        (Some(60), Some(800)),
        "the plan's model limits, its own burst"
    );
    let unlisted = policy.default_tenant.as_ref().unwrap();
    assert_eq!((unlisted.limits.burst_tokens, unlisted.max_priority), (Some(150), Priority::Sheddable));
    assert_eq!(policy.plans["gold"].limits.tokens_per_day, Some(100_000), "a plan is a tenant policy of its own");
}

#[tokio::test]
async fn an_unlisted_tenant_is_admitted_under_the_plan_its_header_names() {
    let a = admission().await;
    // 400 tokens: within gold's burst of 1,000, past free's 150.
    let Decision::Admitted(gold) = a.reserve(&request("newteam", Some("gold"), 400)).await else { panic!() };
    assert!(gold.reservation_id.starts_with("newteam:"), "{}", gold.reservation_id);
    let Decision::Denied(d) = a.reserve(&request("plainteam", None, 400)).await else { panic!() };
    assert_eq!(d.reason, Reason::Unsatisfiable, "no header: default_tenant's plan, free: {d:?}");
    // Each tenant under a plan has counters of its own: a second gold team has all 1,000.
    let second = a.reserve(&request("secondteam", Some("gold"), 900)).await;
    assert!(matches!(second, Decision::Admitted(_)), "{second:?}");
    let Decision::Denied(d) = a.reserve(&request("newteam", Some("gold"), 900)).await else { panic!() };
    assert_eq!(d.reason, Reason::TokenRate, "newteam's own 600 left: {d:?}");

    // Its later calls carry only the id: they go by the plan it was admitted under (gold's lease
    // of 10 minutes, not the default 2).
    let RenewOutcome::Renewed { lease_remaining_ms } = a.renew(&gold.reservation_id, 0).await.unwrap() else {
        panic!()
    };
    assert!(lease_remaining_ms > 120_000, "gold's lease: {lease_remaining_ms}");

    // A listed tenant goes by its own policy, whatever the header says.
    let Decision::Denied(d) = a.reserve(&request("acme", Some("free"), 1500)).await else { panic!() };
    assert_eq!(d.reason, Reason::Unsatisfiable, "acme's burst is gold's 1,000: {d:?}");
    let Decision::Admitted(_) = a.reserve(&request("acme", Some("free"), 400)).await else { panic!() };

    // A plan the policy does not have: refused, never another plan.
    let Decision::Denied(d) = a.reserve(&request("newteam", Some("platinum"), 1)).await else { panic!() };
    assert_eq!(d.reason, Reason::Unauthenticated);
    assert!(d.message.contains("platinum"), "{}", d.message);
}

/// Another replica, which never saw the tenant admitted (or restarted since), still renews its
/// hold, under the most generous of the plans (never `not_found`, which would leave it to expire).
#[tokio::test]
async fn a_replica_that_never_saw_the_plan_still_renews_the_hold() {
    let policy = Arc::new(Policy::parse("plans.yaml", POLICY).unwrap());
    let store = EmbeddedStore::new().unwrap();
    let a = Arc::new(Admission::new(Arc::clone(&policy), Protocol::new(store.clone()).await.unwrap()));
    let b = Arc::new(Admission::new(policy, Protocol::new(store).await.unwrap()));
    let Decision::Admitted(held) = a.reserve(&request("newteam", Some("gold"), 400)).await else { panic!() };
    let RenewOutcome::Renewed { lease_remaining_ms } = b.renew(&held.reservation_id, 0).await.unwrap() else {
        panic!("replica b did not renew")
    };
    assert!(lease_remaining_ms > 120_000, "gold's lease, the longest: {lease_remaining_ms}");
}

/// A plan is read only where the policy reads it from verified identity (`server.plan_header`):
/// without it, a caller naming a plan is admitted as any unlisted tenant is.
#[tokio::test]
async fn without_a_plan_header_a_named_plan_is_not_read() {
    let text = POLICY.replace("server:\n  plan_header: x-tollgate-plan\n", "");
    let policy = Policy::parse("plans.yaml", &text).unwrap();
    let a = Arc::new(Admission::new(Arc::new(policy), Protocol::new(EmbeddedStore::new().unwrap()).await.unwrap()));
    let Decision::Denied(d) = a.reserve(&request("newteam", Some("gold"), 400)).await else { panic!() };
    assert_eq!(d.reason, Reason::Unsatisfiable, "free's burst, not gold's: {d:?}");
}
