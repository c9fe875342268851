//! The identity filter tollgate's README tells users to have, as shipped in envoy/identity.yaml,
//! spliced into envoy/envoy.yaml before ext_authz and run in real Envoy with a JWKS and tokens made
//! here: the tenant and user come from a verified token only; the identity headers a client sends
//! are removed before tollgate sees the request (so a token without a tenant claim means no tenant,
//! never the client's), as are its x-tollgate-* headers (which Check removes too); no token, a bad
//! one or an expired one is answered 401 by Envoy and never reaches the backend.

mod support;

use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use hmac::{Hmac, Mac};
use sha2::Sha256;
use support::procs::{Envoy, Tollgate};
use support::upstream::{Upstream, post};

const POLICY: &str = "models:\n  m: { max_output_tokens: 64 }\n\
                      tenants:\n  acme:\n    limits: { tokens_per_minute: 60000 }\n  evil:\n    limits: { tokens_per_minute: 60000 }\n";
const SECRET: &[u8] = b"a test key of thirty-two bytes!!";
const CHAT: &str = r#"{"model":"m","max_tokens":8,"messages":[{"role":"user","content":"hi"}]}"#;

/// An HS256 token with these claims, signed with `key`.
fn token(claims: serde_json::Value, key: &[u8]) -> String {
    let header = URL_SAFE_NO_PAD.encode(r#"{"alg":"HS256","typ":"JWT","kid":"k1"}"#);
    let payload = URL_SAFE_NO_PAD.encode(claims.to_string());
    let mut mac = Hmac::<Sha256>::new_from_slice(key).unwrap();
    mac.update(format!("{header}.{payload}").as_bytes());
    format!("{header}.{payload}.{}", URL_SAFE_NO_PAD.encode(mac.finalize().into_bytes()))
}

fn claims(tenant: &str, user: &str, expires_in: i64) -> serde_json::Value {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs() as i64;
    serde_json::json!({
        "iss": "https://identity.example",
        "aud": "tollgate",
        "tenant": tenant,
        "sub": user,
        "exp": now + expires_in,
    })
}

/// envoy.yaml with the identity filters first, reading a JWKS file written here.
fn with_identity(config: String, jwks: &Path) -> String {
    let fragment = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("envoy/identity.yaml")).unwrap();
    let filters: String =
        fragment.lines().filter(|l| !l.starts_with('#')).map(|l| format!("{}{l}\n", " ".repeat(18))).collect();
    let filters = filters.replace("/etc/tollgate/jwks.json", jwks.to_str().unwrap());
    let anchor = "                http_filters:\n";
    assert!(config.contains(anchor), "envoy.yaml changed");
    config.replacen(anchor, &format!("{anchor}{filters}"), 1)
}

/// tollgate with `policy`, the test upstream, and Envoy in front with the identity filters reading
/// a JWKS of the test's key.
async fn behind_identity(policy: &str) -> (Tollgate, Upstream, Envoy) {
    let tollgate = Tollgate::start(policy);
    let jwks = tollgate.dir.write(
        "jwks.json",
        &serde_json::json!({"keys": [{"kty": "oct", "alg": "HS256", "kid": "k1", "k": URL_SAFE_NO_PAD.encode(SECRET)}]})
            .to_string(),
    );
    let upstream = Upstream::start(tollgate.endpoint()).await;
    let envoy = Envoy::start_edited(tollgate.addr, upstream.port, |c| with_identity(c, &jwks));
    (tollgate, upstream, envoy)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_a_verified_token_names_the_tenant() {
    let (_tollgate, _upstream, envoy) = behind_identity(POLICY).await;
    let bearer = |t: &str| format!("Bearer {t}");

    // A verified token: its tenant, whatever the client claims in headers of its own.
    let good = bearer(&token(claims("acme", "alice", 600), SECRET));
    let forged = [
        ("authorization", good.as_str()),
        ("x-tenant-id", "evil"),
        ("x-user-id", "mallory"),
        ("x-tollgate-reservation", "evil:forged"),
        ("x-tollgate-commit", "caller"),
    ];
    let r = post(envoy.port, "/v1/chat/completions", &forged, CHAT).await;
    assert_eq!(r.status, 200, "{r:?}\n{}", envoy.log());
    let reservation = r.header("x-test-reservation").unwrap();
    assert!(reservation.starts_with("acme:"), "the token's tenant holds: {reservation}");
    let seen = r.header("x-test-tollgate-headers").unwrap();
    assert!(!seen.contains("forged") && !seen.contains("x-tollgate-commit"), "client's own headers removed: {seen}");

    // A valid token that names no tenant: the client's own x-tenant-id was removed before, so the
    // request has no tenant at all (tollgate answers 401), never the one the client claims.
    let mut no_tenant = claims("acme", "alice", 600);
    no_tenant.as_object_mut().unwrap().remove("tenant");
    let no_tenant = bearer(&token(no_tenant, SECRET));
    let r = post(
        envoy.port,
        "/v1/chat/completions",
        &[("authorization", no_tenant.as_str()), ("x-tenant-id", "evil")],
        CHAT,
    )
    .await;
    assert_eq!(r.status, 401, "{r:?}");
    assert_eq!(r.header("x-tollgate-reason"), Some("unauthenticated"), "tollgate refused it: {r:?}");

    // No token (tollgate itself would admit this tenant header), a token signed with another key,
    // an expired token: Envoy answers 401 and nothing reaches the backend.
    let wrong_key = bearer(&token(claims("acme", "alice", 600), b"another key, not the one in JWKS"));
    let expired = bearer(&token(claims("acme", "alice", -600), SECRET));
    for (what, headers) in [
        ("no token", vec![("x-tenant-id", "acme")]),
        ("another key", vec![("authorization", wrong_key.as_str())]),
        ("expired", vec![("authorization", expired.as_str())]),
    ] {
        let r = post(envoy.port, "/v1/chat/completions", &headers, CHAT).await;
        assert_eq!(r.status, 401, "{what}: {r:?}");
        assert!(r.header("x-test-reservation").is_none(), "{what} reached the backend");
    }
}

/// Onboarding a team is issuing it a token: a tenant the policy does not list is admitted under
/// the plan its token names (its own counters, that plan's limits); without the claim it goes by
/// `default_tenant`, whatever plan header the client sends itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unlisted_tenant_is_admitted_under_the_plan_its_token_names() {
    let policy = "server:\n  plan_header: x-tollgate-plan\n\
                  models:\n  m: { max_output_tokens: 64 }\n\
                  plans:\n  gold:\n    limits: { tokens_per_minute: 60, burst_tokens: 1000 }\n\
                  \x20 free:\n    limits: { tokens_per_minute: 60, burst_tokens: 40 }\n\
                  default_tenant:\n  plan: free\n";
    let (tollgate, _upstream, envoy) = behind_identity(policy).await;
    // A hold of its prompt and 64: more than free's burst of 40, within gold's 1,000.
    let big = r#"{"model":"m","max_tokens":64,"messages":[{"role":"user","content":"hi"}]}"#;
    let mut gold = claims("newteam", "alice", 600);
    gold["plan"] = "gold".into();
    let gold = format!("Bearer {}", token(gold, SECRET));
    let r = post(envoy.port, "/v1/chat/completions", &[("authorization", gold.as_str())], big).await;
    assert_eq!(r.status, 200, "{r:?}\n{}", tollgate.log());
    assert!(r.header("x-test-reservation").unwrap().starts_with("newteam:"), "{r:?}");

    // No plan claim: the client's own x-tollgate-plan was removed before tollgate saw it, and
    // free's burst cannot hold the request.
    let plain = format!("Bearer {}", token(claims("otherteam", "bob", 600), SECRET));
    let headers = [("authorization", plain.as_str()), ("x-tollgate-plan", "gold")];
    let r = post(envoy.port, "/v1/chat/completions", &headers, big).await;
    assert_eq!((r.status, r.header("x-tollgate-reason")), (400, Some("unsatisfiable")), "{r:?}");

    // A plan the policy does not have: not admitted, under any other.
    let mut unknown = claims("thirdteam", "carol", 600);
    unknown["plan"] = "platinum".into();
    let unknown = format!("Bearer {}", token(unknown, SECRET));
    let r = post(envoy.port, "/v1/chat/completions", &[("authorization", unknown.as_str())], CHAT).await;
    assert_eq!((r.status, r.header("x-tollgate-reason")), (401, Some("unauthenticated")), "{r:?}");
}
