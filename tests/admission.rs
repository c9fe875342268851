//! Admission rules that do not depend on the store, on the embedded store: identity, defaults and
//! the checks made before any store call.

mod support;

use std::sync::Arc;

use tollgate::admission::{Admission, Attributes, Decision, Reason};
use tollgate::config::Policy;
use tollgate::estimate::PromptSize;
use tollgate::store::Protocol;
use tollgate::store::embedded::EmbeddedStore;

async fn admission(yaml: &str) -> Arc<Admission<EmbeddedStore>> {
    let policy = Policy::parse("test.yaml", yaml).unwrap();
    Arc::new(Admission::new(Arc::new(policy), Protocol::new(EmbeddedStore::new().unwrap()).await.unwrap()))
}

fn request(tenant: Option<&str>) -> Attributes {
    Attributes {
        plan: None,
        tenant: tenant.map(str::to_string),
        user: None,
        model: Some("m".into()),
        priority: None,
        deadline_ms: None,
        wait_ms: None,
        idempotency: None,
        prompt: PromptSize::Bytes(40),
        max_tokens: None,
        stream: false,
        input_only: false,
        outputs: 1,
    }
}

const MODELS: &str = "models:\n  m: { max_output_tokens: 100, bytes_per_token: 4 }\n";

#[tokio::test]
async fn a_request_without_identity_is_charged_to_the_anonymous_tenant_when_one_is_named() {
    let strict = admission(&format!("{MODELS}tenants:\n  acme: {{}}\n")).await;
    let Decision::Denied(d) = strict.reserve(&request(None)).await else { panic!() };
    assert_eq!(d.reason, Reason::Unauthenticated);
    assert!(d.message.contains("x-tenant-id"), "{}", d.message);

    let open = admission(&format!(
        "{MODELS}anonymous_tenant: public\ntenants:\n  public: {{ limits: {{ max_concurrency: 1 }} }}\n"
    ))
    .await;
    let Decision::Admitted(a) = open.reserve(&request(None)).await else { panic!() };
    assert!(a.reservation_id.starts_with("public:"), "{}", a.reservation_id);
    let Decision::Denied(d) = open.reserve(&request(None)).await else { panic!() };
    assert_eq!(d.reason, Reason::Concurrency, "anonymous requests share the public tenant's limits");
}

#[tokio::test]
async fn unknown_tenants_get_the_default_tenant_policy_each_with_its_own_buckets() {
    let a = admission(&format!("{MODELS}default_tenant:\n  limits: {{ max_concurrency: 1 }}\n")).await;
    assert!(matches!(a.reserve(&request(Some("one"))).await, Decision::Admitted(_)));
    assert!(matches!(a.reserve(&request(Some("two"))).await, Decision::Admitted(_)));
    let Decision::Denied(d) = a.reserve(&request(Some("one"))).await else { panic!() };
    assert_eq!(d.reason, Reason::Concurrency);

    let closed = admission(&format!("{MODELS}tenants:\n  acme: {{}}\n")).await;
    let Decision::Denied(d) = closed.reserve(&request(Some("stranger"))).await else { panic!() };
    assert_eq!(d.reason, Reason::Unauthenticated);
}

#[tokio::test]
async fn the_hold_is_the_prompt_estimate_plus_the_output_ceiling() {
    let a = admission(&format!("{MODELS}tenants:\n  acme: {{}}\n")).await;
    // 40 bytes at 4 bytes/token, and no max_tokens: the model's 100.
    let Decision::Admitted(ok) = a.reserve(&request(Some("acme"))).await else { panic!() };
    assert_eq!(ok.reserved_tokens, 110);
    let mut named = request(Some("acme"));
    named.max_tokens = Some(7);
    let Decision::Admitted(ok) = a.reserve(&named).await else { panic!() };
    assert_eq!(ok.reserved_tokens, 17);
    named.max_tokens = Some(101);
    let Decision::Denied(d) = a.reserve(&named).await else { panic!() };
    assert_eq!(d.reason, Reason::InvalidRequest, "above the model's ceiling");
}

#[tokio::test]
async fn the_expiry_index_stays_bounded_by_the_live_keys_over_ten_thousand_cycles() {
    let store = EmbeddedStore::new().unwrap();
    let policy =
        Policy::parse("test.yaml", &format!("{MODELS}tenants:\n  acme: {{ limits: {{ max_concurrency: 4 }} }}\n"))
            .unwrap();
    let a = Arc::new(Admission::new(Arc::new(policy), Protocol::new(store.clone()).await.unwrap()));
    for i in 0..10_000 {
        let Decision::Admitted(ok) = a.reserve(&request(Some("acme"))).await else { panic!("cycle {i}") };
        a.commit(&ok.reservation_id, 1, 1).await.unwrap();
    }
    let size = store.size().await.unwrap();
    assert!(size.expiry_index <= size.keys, "one index entry per key with a TTL, at most: {size:?}");
}
