//! A pool's provider limits (`provider_limits`), on every store: the account behind the pool,
//! shared by every tenant whose model it serves, checked and charged with the pool's holds and
//! settled by how each request ended.

use super::*;
use tollgate::hold::{BudgetKey, Measure, Period};
use tollgate::store::phase::budget::ScopeUse;

/// The scenario's tenant with `limits` (YAML flow map) and a lease of 300 ms, any other tenant
/// (through the default tenant) with none, on a pool of plenty of slots whose provider allows
/// `provider`.
pub fn provider_policy(limits: &str, provider: &str) -> String {
    super::scenarios::pool_policy(
        &format!("default_tenant:\n  limits: {{}}\n---top---\nlease_ttl_ms: 300\nlimits: {limits}\n"),
        &format!("max_sequences: 64\nmax_queue_delay_ms: 600000\nprovider_limits: {provider}\n"),
    )
}

/// The same with a lease of ten minutes, which renewals keep going.
pub fn long_lease_policy() -> String {
    super::scenarios::pool_policy(
        "default_tenant:\n  limits: {}\n---top---\nlease_ttl_ms: 600000\nlimits: {}\n",
        &format!("max_sequences: 64\nmax_queue_delay_ms: 600000\nprovider_limits: {PROVIDER_RATES}\n"),
    )
}

/// A slow token bucket (1 token a second) of 1,000, and 5 requests a minute.
pub const PROVIDER_RATES: &str = "{ tokens_per_minute: 60, burst_tokens: 1000, requests_per_minute: 5 }";

/// 100 prompt tokens and 100 output at most: 200 tokens of the provider's, at `tier`, for the
/// scenario's tenant or (`other`) another.
fn ask<S: Store>(h: &Harness<S>, tier: Priority, other: bool) -> Attributes {
    let mut a = h.attributes(100, 100);
    a.priority = Some(tier);
    if other {
        a.tenant = Some(format!("{}-b", h.tenant));
    }
    a
}

/// The provider scope as PoolStatus shows it.
async fn provider<S: Store>(h: &Harness<S>) -> ScopeUse {
    h.admission.pool_status(&h.pool).await.unwrap().provider.expect("the pool has provider limits").used
}

/// The provider's token bucket is at `want`, give or take the refill a real clock adds meanwhile.
async fn tokens_left<S: Store>(h: &Harness<S>, want: i64, what: &str) {
    let got = provider(h).await.tokens.level;
    let slack = if h.exact_time() { 0 } else { 3 };
    assert!((want..=want + slack).contains(&got), "{what}: {got} tokens left, want {want}");
}

pub async fn tenants_together_are_refused_at_the_providers_rate<S: Store>(h: Harness<S>) {
    for other in [false, true, false, true, false] {
        admitted(&h.admission.reserve(&ask(&h, Priority::Critical, other)).await);
    }
    // 1,000 tokens taken by two tenants, each within its own (no) limits: the next is the
    // provider's, whoever sends it.
    let before = (provider(&h).await, h.pool_load().await);
    for other in [false, true] {
        let no = h.admission.reserve(&ask(&h, Priority::Critical, other)).await;
        let no = denied(&no);
        assert_eq!(no.reason, Reason::ProviderRate, "{no:?}");
        assert_eq!(no.reason.http_status(), 503);
        assert!(no.message.contains("token rate") && no.message.contains(&h.pool), "{}", no.message);
        // 200 tokens at 1 a second (the request rate is spent too, and frees sooner).
        assert!(no.retry_after_ms.is_some_and(|ms| (195_000..=200_000).contains(&ms)), "{no:?}");
    }
    let after = (provider(&h).await, h.pool_load().await);
    assert_eq!(after.1, before.1, "a refusal holds no pool work");
    assert!(after.0.tokens.level >= before.0.tokens.level, "a refusal takes nothing: {after:?}");
    assert_eq!(after.0.requests.level, before.0.requests.level, "nor a request");
}

pub async fn the_provider_is_charged_what_ran<S: Store>(h: Harness<S>) {
    let a = admitted(&h.admission.reserve(&ask(&h, Priority::Critical, false)).await).reservation_id.clone();
    tokens_left(&h, 800, "held: prompt and ceiling").await;
    let day = BudgetKey::new(Measure::Tokens, Period::Day);
    assert_eq!(provider(&h).await.period(day).counted, 200);
    // 50 and 30 ran: 120 of the 200 come back.
    h.admission.commit(&a, 50, 30).await.unwrap();
    tokens_left(&h, 920, "committed").await;
    assert_eq!(provider(&h).await.period(day).counted, 80);
    h.admission.commit(&a, 50, 30).await.unwrap();
    tokens_left(&h, 920, "a repeated commit changes nothing").await;
    // An overrun is debt, as a tenant's: 600 where 200 was held.
    let b = admitted(&h.admission.reserve(&ask(&h, Priority::Critical, true)).await).reservation_id.clone();
    h.admission.commit(&b, 100, 500).await.unwrap();
    tokens_left(&h, 320, "an overrun").await;
    assert_eq!(provider(&h).await.period(day).counted, 680);
    // Money too, at the model's price (1 and 3 per million): 50 × 1,000 + 30 × 3,000 nanos and
    // 100 × 1,000 + 500 × 3,000.
    let cost = BudgetKey::new(Measure::Cost, Period::Day);
    assert_eq!(provider(&h).await.period(cost).counted, 140_000 + 1_600_000);
}

pub async fn a_request_its_tenant_refuses_gives_the_provider_everything_back<S: Store>(h: Harness<S>) {
    // The tenant allows one request; its pool leg is held first, then given back whole.
    let first = admitted(&h.admission.reserve(&ask(&h, Priority::Critical, false)).await).reservation_id.clone();
    let before = provider(&h).await;
    let no = h.admission.reserve(&ask(&h, Priority::Critical, false)).await;
    assert_eq!(denied(&no).reason, Reason::RequestRate, "{no:?}");
    let after = provider(&h).await;
    assert!(after.tokens.level >= before.tokens.level, "its tokens came back: {after:?} {before:?}");
    assert!(after.requests.level >= before.requests.level, "its request too: {after:?} {before:?}");
    let day = BudgetKey::new(Measure::Tokens, Period::Day);
    assert_eq!(after.period(day).counted, 200, "only the first request counts");
    assert_eq!(h.pool_load().await.0, 1);
    h.admission.release(&first).await.unwrap();
}

pub async fn a_release_keeps_the_request_and_an_expiry_keeps_the_tokens<S: Store>(h: Harness<S>) {
    let a = admitted(&h.admission.reserve(&ask(&h, Priority::Critical, false)).await).reservation_id.clone();
    let requests = provider(&h).await.requests.level;
    h.admission.release(&a).await.unwrap();
    tokens_left(&h, 1000, "a release gives the tokens back").await;
    assert_eq!(provider(&h).await.requests.level, requests, "the request stays counted");
    admitted(&h.admission.reserve(&ask(&h, Priority::Critical, false)).await);
    // Its lease (300 ms) runs out; the next reserve sweeps it: missing usage is not zero usage.
    h.advance(400).await;
    admitted(&h.admission.reserve(&ask(&h, Priority::Critical, true)).await);
    tokens_left(&h, 600, "the expired hold's 200 stay charged, beside the new one's").await;
}

pub async fn lower_tiers_keep_the_providers_headroom<S: Store>(h: Harness<S>) {
    // Sheddable may use half of each limit, counted from the top: two requests of 200 leave 600,
    // and a third would go below the 500 the tiers above keep.
    for _ in 0..2 {
        admitted(&h.admission.reserve(&ask(&h, Priority::Sheddable, false)).await);
    }
    let no = h.admission.reserve(&ask(&h, Priority::Sheddable, true)).await;
    let no = denied(&no);
    assert_eq!(no.reason, Reason::ProviderRate, "{no:?}");
    assert!(no.message.contains("sheddable"), "{}", no.message);
    // 100 tokens short of the tier's share: 100 seconds at 1 a second.
    assert!(no.retry_after_ms.is_some_and(|ms| (95_000..=100_000).contains(&ms)), "{no:?}");
    // Standard may use 80%: two more (600 → 200, what critical keeps), and of the 5 requests
    // a minute, four.
    for other in [true, false] {
        admitted(&h.admission.reserve(&ask(&h, Priority::Standard, other)).await);
    }
    assert_eq!(denied(&h.admission.reserve(&ask(&h, Priority::Standard, false)).await).reason, Reason::ProviderRate);
    // Critical has all of it: the last 200 tokens and the last request.
    admitted(&h.admission.reserve(&ask(&h, Priority::Critical, false)).await);
    tokens_left(&h, 0, "critical took the last of it").await;
    // A request larger than its tier's share could ever be is unsatisfiable, not a wait.
    let mut big = ask(&h, Priority::Sheddable, false);
    big.max_tokens = Some(450);
    assert_eq!(denied(&h.admission.reserve(&big).await).reason, Reason::Unsatisfiable);
}

pub async fn a_providers_day_budget_turns_at_utc_midnight<S: Store>(h: Harness<S>) {
    provider_budget_turns(h, Period::Day, "daily").await;
}

pub async fn a_providers_hour_budget_turns_on_the_utc_hour<S: Store>(h: Harness<S>) {
    provider_budget_turns(h, Period::Hour, "hourly").await;
}

/// (The manual clock's Sunday noon: the week turns at midnight, Monday.)
pub async fn a_providers_week_budget_turns_on_monday_utc<S: Store>(h: Harness<S>) {
    provider_budget_turns(h, Period::Week, "weekly").await;
}

/// (The manual clock's 29 November: the month turns a day and a half later.)
pub async fn a_providers_month_budget_turns_on_the_first_utc<S: Store>(h: Harness<S>) {
    provider_budget_turns(h, Period::Month, "monthly").await;
}

/// A provider's token budget of 400 for `period`: two holds take it, the third is refused
/// `provider_budget` (503) until the period turns in UTC, as its message says; once it has
/// turned, admitted.
async fn provider_budget_turns<S: Store>(h: Harness<S>, period: Period, named: &str) {
    for other in [false, true] {
        admitted(&h.admission.reserve(&ask(&h, Priority::Critical, other)).await);
    }
    let no = h.admission.reserve(&ask(&h, Priority::Critical, false)).await;
    let no = denied(&no);
    assert_eq!(no.reason, Reason::ProviderBudget, "{no:?}");
    assert_eq!(no.reason.http_status(), 503);
    let turn = super::periods::to_turn(&h, 0, period);
    assert!(no.retry_after_ms.is_some_and(|ms| ms <= turn + 1_000 && ms + 5_000 >= turn), "{no:?} {turn}");
    assert!(no.message.contains(&format!("{named} token budget")), "{}", no.message);
    if h.exact_time() {
        assert_eq!(no.retry_after_ms, Some(turn), "{no:?}");
        h.advance(turn - 1).await;
        assert_eq!(
            denied(&h.admission.reserve(&ask(&h, Priority::Critical, true)).await).reason,
            Reason::ProviderBudget
        );
        h.advance(1).await;
        admitted(&h.admission.reserve(&ask(&h, Priority::Critical, true)).await);
    }
}

pub async fn pool_status_shows_the_providers_limits<S: Store>(h: Harness<S>) {
    admitted(&h.admission.reserve(&ask(&h, Priority::Critical, false)).await);
    let status = h.admission.pool_status(&h.pool).await.unwrap();
    let (view, provider) = (status.load, status.provider.unwrap());
    assert_eq!((view.holds, view.share), (1, 1.0));
    assert_eq!(provider.scope, "provider");
    assert_eq!(provider.limits.tokens.map(|b| b.capacity.get()), Some(1000));
    assert_eq!(provider.limits.requests.map(|b| b.capacity.get()), Some(5));
    assert!((800..=803).contains(&provider.used.tokens.level), "{provider:?}");
    assert_eq!(provider.used.requests.level, 4);
}

/// The provider's 429s and its limits compose: while the throttle holds the pool at half, every
/// provider bucket refills at half its rate, and PoolStatus shows both.
pub async fn the_throttle_slows_the_providers_refill<S: Store>(h: Harness<S>) {
    let mut first = None;
    for other in [false, true, false, true, false] {
        let id = admitted(&h.admission.reserve(&ask(&h, Priority::Critical, other)).await).reservation_id.clone();
        first.get_or_insert(id);
    }
    let unthrottled = denied(&h.admission.reserve(&ask(&h, Priority::Critical, false)).await).retry_after_ms.unwrap();
    assert!((195_000..=200_000).contains(&unthrottled), "200 tokens at 1 a second: {unthrottled}");
    assert_eq!(h.admission.upstream_refused(first.as_ref().unwrap(), None).await.unwrap(), Some(0.5));
    let no = h.admission.reserve(&ask(&h, Priority::Critical, true)).await;
    let no = denied(&no);
    assert_eq!(no.reason, Reason::ProviderRate, "{no:?}");
    // At half the rate: twice as long (the share recovers 5% a second: a real clock's
    // milliseconds meanwhile shorten it by a hair).
    assert!(no.retry_after_ms.is_some_and(|ms| (380_000..=400_000).contains(&ms)), "{no:?}");
    let status = h.admission.pool_status(&h.pool).await.unwrap();
    assert!((0.5..0.51).contains(&status.load.share), "{status:?}");
    assert!(status.provider.unwrap().used.tokens.level <= 1);
}

/// A release that finds its hold settled otherwise leaves the provider as that settlement did: an
/// expired hold (the release expiring it itself) and a committed one (whose own pool release was
/// lost) stay charged; only a hold the release gives back gives the provider its tokens back.
pub async fn a_release_of_a_settled_hold_keeps_the_provider_charged<S: Store>(h: Harness<S>) {
    let a = admitted(&h.admission.reserve(&ask(&h, Priority::Critical, false)).await).reservation_id.clone();
    h.advance(400).await;
    let out = h.admission.release(&a).await.unwrap();
    assert_eq!(out, ReleaseOutcome::Settled(tollgate::hold::Settled::Expired), "the lease had run out");
    tokens_left(&h, 800, "an expired hold stays charged as held").await;
    // The tenant leg commits all it held; its pool release never happens (lost); a release follows.
    let b = admitted(&h.admission.reserve(&ask(&h, Priority::Critical, true)).await).reservation_id.clone();
    let terms = tollgate::store::CommitTerms { learning: None, retention_ms: 60_000, zone_offset_min: Some(0) };
    let tenant = format!("{}-b", h.tenant);
    h.admission.protocol().commit(&tenant, &b, Counted::exact(100, 100), Ending::Completed, terms).await.unwrap();
    let out = h.admission.release(&b).await.unwrap();
    assert_eq!(out, ReleaseOutcome::Settled(tollgate::hold::Settled::Committed));
    tokens_left(&h, 600, "a request that ran is not given back").await;
}

/// A request admitted unmetered (its tenant leg's reply lost, `fail_open`) reaches the provider:
/// its pool leg is tidied away, and what it took from the provider stays charged.
pub async fn an_unmetered_request_stays_charged_to_the_provider<S: Store + Clone>(h: Harness<S>) {
    let lossy = h.wrapped(|s| Faulty::new(s, "reserve", Fault::LostReply)).await;
    let d = lossy.admission.reserve(&ask(&lossy, Priority::Critical, false)).await;
    assert!(matches!(d, Decision::Unmetered(_)), "{d:?}");
    // Tidied once answered: the pool leg's work leaves the pool.
    let start = std::time::Instant::now();
    while h.pool_load().await.0 > 0 {
        assert!(start.elapsed() < Duration::from_secs(5), "the pool leg was never tidied");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokens_left(&h, 800, "the request reached the provider").await;
    assert!(provider(&h).await.requests.level <= 4, "and counts as a request");
}

/// A stream renewed long past the provider scope's idle TTL keeps the scope alive (each renewal
/// does), so its commit settles into the scope it took from: the day counts both requests' usage,
/// not the second one's less the first's refund.
pub async fn a_renewed_stream_keeps_the_provider_scope_it_took_from<S: Store>(h: Harness<S>) {
    if !h.exact_time() {
        return;
    }
    let day = BudgetKey::new(Measure::Tokens, Period::Day);
    let a = admitted(&h.admission.reserve(&ask(&h, Priority::Critical, false)).await).reservation_id.clone();
    for _ in 0..3 {
        h.advance(500_000).await;
        let r = h.admission.renew(&a, 0).await.unwrap();
        assert!(matches!(r, RenewOutcome::Renewed { .. }), "{r:?}");
    }
    admitted(&h.admission.reserve(&ask(&h, Priority::Critical, true)).await);
    h.admission.commit(&a, 10, 10).await.unwrap();
    assert_eq!(provider(&h).await.period(day).counted, 220, "200 held by the second, 20 used by the first");
}

/// A commit without counts charges the provider what it knows: a metered stream its output and the
/// prompt as held; none at all, the hold.
pub async fn a_commit_without_counts_charges_the_provider_what_it_knows<S: Store>(h: Harness<S>) {
    let day = BudgetKey::new(Measure::Tokens, Period::Day);
    let a = admitted(&h.admission.reserve(&ask(&h, Priority::Critical, false)).await).reservation_id.clone();
    h.admission.commit_counted(&a, Counted::Metered { output: 30 }).await.unwrap();
    assert_eq!(provider(&h).await.period(day).counted, 130, "the prompt as held, the output metered");
    let b = admitted(&h.admission.reserve(&ask(&h, Priority::Critical, true)).await).reservation_id.clone();
    h.admission.commit_counted(&b, Counted::AsHeld).await.unwrap();
    assert_eq!(provider(&h).await.period(day).counted, 330, "the whole hold");
}
