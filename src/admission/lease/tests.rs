//! The slices and leased holds of one replica, on a manual clock.

use super::slice::Taken;
use super::*;
use crate::config::Policy;
use crate::hold::Amounts;
use crate::hold::{RenewOutcome, Settled};
use crate::store::clock::ManualClock;

const START: u64 = 1_795_953_600_000;

fn leases(clock: &ManualClock) -> (Leases, Arc<TenantPolicy>) {
    let policy = Policy::parse(
        "t.yaml",
        "leasing: { window_ms: 250, max_share: 0.1 }\nmodels:\n  m: { max_output_tokens: 100 }\n\
         tenants:\n  acme: { lease_ttl_ms: 4000, limits: { tokens_per_minute: 60000, burst_tokens: 10000, max_concurrency: 10 } }\n",
    )
    .unwrap();
    let tp = Arc::clone(&policy.tenants["acme"]);
    (Leases::new("0a1b2c3d4e5f".into(), policy.leasing.unwrap(), Arc::new(clock.clone()), 60_000, None), tp)
}

fn slice(tp: &TenantPolicy, day: u64) -> Slice {
    Slice::new(ScopeOf::Tenant, Some(&tp.limits), day, 0.1)
}

/// A slice that holds `tokens` and `slots` free, as a lease call would have left it.
fn stock(t: &TenantLease, tp: &TenantPolicy, tokens: i64, slots: u64, valid_until: u64) {
    let mut s = t.lock();
    let mut slice = slice(tp, START / DAY_MS);
    slice.tokens = tokens;
    slice.slots_free = slots;
    s.slices.insert("scope".into(), slice);
    s.valid_until = valid_until;
    s.day = START / DAY_MS;
    s.day_ends_at = START + DAY_MS / 2;
}

fn ask(id: &str, hold: u64) -> Ask<'_> {
    let scopes = vec![AskScope { key: "scope", of: &ScopeOf::Tenant }];
    let price = crate::config::Price::default();
    Ask {
        id,
        model: "m",
        scopes,
        hold,
        prompt: 0,
        user: None,
        tier: "standard",
        price,
        token_weights: Default::default(),
    }
}

/// What a hold gives back: `held` against `used`, of a hold that took `took`.
fn give_back(slice: &mut Slice, took: Taken, held: Spend, used: Spend, day: u64) {
    slice.settle(took, held, Spend::default(), used, day, day);
}

#[test]
fn a_refund_beyond_the_share_is_given_back_not_spent() {
    let clock = ManualClock::new(START);
    let (_, tp) = leases(&clock);
    let mut slice = slice(&tp, 7);
    assert_eq!(slice.cap.tokens, 1_000, "a tenth of 10,000");
    slice.tokens = 900;
    let took = Taken { tokens: Some(300), cost: None };
    give_back(&mut slice, took, Spend { tokens: 300, cost: 7 }, Spend::default(), 7);
    assert_eq!((slice.tokens, slice.surplus.tokens), (1_000, 200));
    assert_eq!((slice.cost, slice.surplus.cost), (0, 0), "the scope has no budget in money");
    for (tokens, day) in [(50, 6), (20, 5), (5, 6), (1, 3)] {
        give_back(&mut slice, took, Spend { tokens, cost: 0 }, Spend::default(), day);
    }
    // Days 3 to 6 since the epoch are in January 1970: one entry, under the latest of them (6).
    let earlier: Vec<(u64, u64)> = slice.earlier.values().map(|(d, s)| (*d, s.tokens)).collect();
    assert_eq!(earlier, [(6, 76)], "a hold of another day refunds its month, kept apart");
}

/// Money is leased as tokens are: a slice of a budget in money holds a share of it, a hold
/// takes what it may cost, and a commit gives back what it did not use, or runs up debt.
#[test]
fn a_slice_of_a_money_budget_keeps_cost_beside_tokens() {
    let mut slice = money_slice("cost_per_day: 0.001, tokens_per_month: 800", 0);
    assert_eq!((slice.cap.tokens, slice.cap.cost), (400, 500_000), "half the month's tokens and the day's money");
    slice.tokens = 400;
    slice.cost = 500_000;
    let hold = Spend { tokens: 30, cost: 70_000 };
    assert!(slice.covers(hold));
    let took = slice.take(hold);
    assert_eq!(took, Taken { tokens: Some(30), cost: Some(70_000) });
    assert_eq!((slice.tokens, slice.cost), (370, 430_000));
    give_back(&mut slice, took, hold, Spend { tokens: 20, cost: 540_000 }, 7);
    assert_eq!((slice.tokens, slice.cost), (380, -40_000), "debt in money, tokens to spare");
    assert!(!slice.covers(hold), "a slice in debt covers nothing");
}

/// A hold settles what it took, under the terms it was taken with: a reload that gives its scope
/// a budget in money gives the slice no money the hold never drew, and what the hold used of it
/// is counted in the scope's usage instead, as a store hold counts it.
#[test]
fn a_hold_settles_what_it_took_whatever_a_reload_limits_since() {
    let mut slice = money_slice("tokens_per_minute: 60000, burst_tokens: 10000", 1_000);
    let held = Spend { tokens: 1_000, cost: 2_600_000 };
    let took = slice.take(held);
    assert_eq!(took, Taken { tokens: Some(1_000), cost: None }, "no money limit: none drawn");
    let after = money_tenant("tokens_per_minute: 60000, burst_tokens: 10000, cost_per_day: 0.01");
    slice.retune(Some(&after.limits), 0.5);
    give_back(&mut slice, took, held, Spend { tokens: 300, cost: 500_000 }, 7);
    assert_eq!((slice.tokens, slice.cost), (700, 0), "tokens back; no money that was never drawn");
    assert_eq!(slice.charge_today, Spend { tokens: 0, cost: 500_000 }, "the money used, counted");
    let scope = slice.ready("scope", Amounts::default(), None, 7);
    assert_eq!((scope.charge_tokens, scope.charge_cost), (0, 500_000), "sent with the next call");
    assert!(slice.charge_today.is_zero());
}

/// Debt run up after the slice's day has passed is the new day's: charged today, apart from what
/// the slice gives back to its own day.
#[test]
fn debt_after_midnight_is_charged_to_the_new_day() {
    let mut slice = money_slice("tokens_per_minute: 60000, burst_tokens: 10000", 1_000);
    let held = Spend { tokens: 100, cost: 0 };
    let took = slice.take(held);
    slice.settle(took, held, Spend::default(), Spend { tokens: 400, cost: 0 }, 7, 8);
    assert_eq!((slice.tokens, slice.charge_today.tokens), (900, 300), "free tokens of day 7 kept whole");
    let scope = slice.ready("scope", Amounts { tokens: 1_000, ..Amounts::default() }, None, 8);
    assert_eq!((scope.back_tokens, scope.back_day, scope.charge_tokens), (900, 7, 300));
}

/// A slice of day 7, half the share, of a `money_tenant` scope under `limits`, holding `tokens` free.
fn money_slice(limits: &str, tokens: i64) -> Slice {
    let tp = money_tenant(limits);
    let mut slice = Slice::new(ScopeOf::Tenant, Some(&tp.limits), 7, 0.5);
    slice.tokens = tokens;
    slice
}

/// A tenant whose model `m` is priced (1 and 3 per million tokens), under `limits`.
fn money_tenant(limits: &str) -> Arc<TenantPolicy> {
    let policy = Policy::parse(
        "t.yaml",
        &format!(
            "leasing: {{ window_ms: 250, max_share: 0.5 }}\nmodels:\n  m: {{ max_output_tokens: 100, price: {{ input_per_million: 1, output_per_million: 3 }} }}\n\
             tenants:\n  acme: {{ limits: {{ {limits} }} }}\n"
        ),
    )
    .unwrap();
    Arc::clone(&policy.tenants["acme"])
}

#[test]
fn a_leased_hold_never_outlives_its_replicas_lease_record() {
    let clock = ManualClock::new(START);
    let (leases, tp) = leases(&clock);
    let t = leases.tenant("acme", &tp);
    stock(&t, &tp, 1_000, 5, START + 1_500);
    assert!(matches!(leases.try_admit(&t, &ask("h1", 100)), Local::Admitted { .. }));
    assert_eq!(t.lock().holds["h1"].lease_until, START + 1_500, "not START + 4,000");
    assert_eq!(leases.renew("acme", "h1", 4_000), RenewOutcome::Renewed { lease_remaining_ms: 1_500 });
    clock.advance_ms(1_500);
    assert!(matches!(leases.try_admit(&t, &ask("h2", 100)), Local::Miss), "the lease lapsed");
    assert_eq!(leases.renew("acme", "h1", 4_000), RenewOutcome::Settled(Settled::Expired));
}

/// A slice belongs to the store's day: none of it is spent past the store's midnight (as the
/// last answer placed it on this replica's clock), nor after an answer of another day.
#[test]
fn a_slice_is_not_spent_past_its_day() {
    let clock = ManualClock::new(START);
    let (leases, tp) = leases(&clock);
    let t = leases.tenant("acme", &tp);
    stock(&t, &tp, 1_000, 5, START + 4_000);
    t.lock().day_ends_at = START + 1_000;
    assert!(matches!(leases.try_admit(&t, &ask("h1", 100)), Local::Admitted { .. }));
    clock.advance_ms(1_000);
    assert!(matches!(leases.try_admit(&t, &ask("h2", 100)), Local::Miss), "the store's day has ended");
    assert_eq!(t.lock().today(START + 1_000), START / DAY_MS + 1);
    // An answer placing the replica in the next day, with the slice still of the last.
    t.lock().day = START / DAY_MS + 1;
    t.lock().day_ends_at = START + DAY_MS;
    assert!(matches!(leases.try_admit(&t, &ask("h3", 100)), Local::Miss), "a slice of yesterday");
}

/// A leased hold a commit finds expired is counted with the ones the window expired.
#[test]
fn a_hold_found_expired_by_a_commit_is_reported_by_the_next_upkeep() {
    let clock = ManualClock::new(START);
    let (leases, tp) = leases(&clock);
    let t = leases.tenant("acme", &tp);
    stock(&t, &tp, 1_000, 5, START + 10_000);
    assert!(matches!(leases.try_admit(&t, &ask("h1", 100)), Local::Admitted { .. }));
    clock.advance_ms(4_000);
    let late = leases.commit("acme", "h1", crate::hold::Counted::exact(1, 1), crate::hold::Ending::Completed);
    assert!(matches!(late, crate::hold::CommitOutcome::Committed(ref u) if u.late), "{late:?}");
    assert_eq!(leases.upkeep(&t).0, vec!["h1".to_string()], "expired, for the expired-holds count");
    assert!(leases.upkeep(&t).0.is_empty(), "and counted once");
}

#[test]
fn a_leased_decision_never_reports_more_remaining_than_the_limit() {
    use crate::hold::Window;
    let clock = ManualClock::new(START);
    let (leases, tp) = leases(&clock);
    let t = leases.tenant("acme", &tp);
    stock(&t, &tp, 1_000, 5, START + 4_000);
    // The store's view at the last call: full. The slice's 900 free tokens are inside it.
    t.lock().headroom =
        Headroom { tokens: Some(Window { remaining: 10_000, limit: 10_000, reset_ms: 0 }), ..Headroom::default() };
    let Local::Admitted { headroom } = leases.try_admit(&t, &ask("h1", 100)) else { panic!("admitted") };
    assert_eq!(headroom.tokens.map(|w| w.remaining), Some(10_000));
}

#[test]
fn a_replica_with_only_settled_holds_polls_four_times_a_lease() {
    let clock = ManualClock::new(START);
    let (leases, tp) = leases(&clock);
    let t = leases.tenant("acme", &tp);
    stock(&t, &tp, 0, 0, START + 4_000);
    t.lock().closed.insert("done".into(), Closed::Released { refunded: 1 });
    t.lock().last_call = START;
    leases.upkeep(&t); // the window the tenant was created in: active
    clock.advance_ms(999);
    assert_eq!(leases.upkeep(&t).1, None, "nothing to give back, polled a moment ago");
    clock.advance_ms(1);
    assert_eq!(leases.upkeep(&t).1, Some(false), "a quarter of the 4,000 ms lease since the last call");
}
