//! Soft budgets, on every store: past one a request is admitted all the same, marked, and its
//! tenant's next requests go to their pool one tier lower until the period turns.

use super::*;
use tollgate::hold::{BudgetKey, Measure, Period};

/// A day's soft budget of 300 tokens below a hard one of 1,000, and a pool of four slots whose
/// standard tier may fill three and sheddable two (each request here 1,100 ms of work, the most a
/// tier may wait 1,000 ms).
pub fn soft_policy() -> String {
    super::scenarios::pool_policy(
        "soft_limits: { tokens_per_day: 300 }\nlimits: { tokens_per_day: 1000 }\n",
        "max_sequences: 4\nmax_queue_delay_ms: 1000\ntier_shares: { standard: 0.75, sheddable: 0.5 }\n",
    )
}

pub async fn past_a_soft_budget_a_request_is_admitted_marked_and_demoted<S: Store>(h: Harness<S>) {
    let mut ask = h.attributes(100, 100);
    ask.priority = Some(Priority::Standard);
    let day = BudgetKey::new(Measure::Tokens, Period::Day);
    let first = h.admission.reserve(&ask).await;
    let first = admitted(&first).clone();
    assert_eq!((first.soft_limit, first.tier), (None, Priority::Standard));
    // 400 of a soft 300: admitted, marked; this replica had not seen it yet, so still standard.
    let second = admitted(&h.admission.reserve(&ask).await).clone();
    assert_eq!((second.soft_limit, second.tier), (Some(day), Priority::Standard));
    // From now on sheddable: two holds in the pool are all its tier may wait behind.
    let third = h.admission.reserve(&ask).await;
    assert_eq!(denied(&third).reason, Reason::QueueFull, "a standard request would have had a slot: {third:?}");
    let mut critical = ask.clone();
    critical.priority = Some(Priority::Critical);
    let fourth = admitted(&h.admission.reserve(&critical).await).clone();
    assert_eq!((fourth.soft_limit, fourth.tier), (Some(day), Priority::Standard), "critical, one tier lower");
    // Past the hard budget (a model no pool serves): refused as ever.
    let mut unpooled = h.attributes(0, 500);
    unpooled.model = Some("other".into());
    assert_eq!(denied(&h.admission.reserve(&unpooled).await).reason, Reason::Budget);

    // Given back, the day is under its soft budget again: the next reply says so.
    for id in [&first.reservation_id, &second.reservation_id, &fourth.reservation_id] {
        h.admission.release(id).await.unwrap();
    }
    let back = admitted(&h.admission.reserve(&ask).await).clone();
    assert_eq!((back.soft_limit, back.tier), (None, Priority::Sheddable), "decided before the reply said so");
    h.admission.release(&back.reservation_id).await.unwrap();
    let after = admitted(&h.admission.reserve(&ask).await).clone();
    assert_eq!((after.soft_limit, after.tier), (None, Priority::Standard));
    if !h.exact_time() {
        return;
    }
    // Past it again, then the day turns: no longer demoted, without a reply to say so.
    let past = admitted(&h.admission.reserve(&ask).await).clone();
    assert_eq!(past.soft_limit, Some(day));
    h.admission.release(&after.reservation_id).await.unwrap();
    h.admission.release(&past.reservation_id).await.unwrap();
    h.advance(12 * 3_600_000).await;
    let next = h.admission.reserve(&ask).await;
    assert_eq!(admitted(&next).tier, Priority::Standard);
}

/// A tenant in shadow only measures its limits: past its soft budget a request is neither marked
/// nor demoted, and the budget counts as ever (what it would do shows in the Budgets API).
pub async fn a_tenant_in_shadow_counts_its_soft_budget_and_does_nothing_more<S: Store>(h: Harness<S>) {
    let mut ask = h.attributes(100, 100);
    ask.priority = Some(Priority::Standard);
    for _ in 0..3 {
        let a = admitted(&h.admission.reserve(&ask).await).clone();
        assert_eq!((a.soft_limit, a.tier), (None, Priority::Standard), "{a:?}");
    }
    let scopes = h.admission.budgets(&h.tenant, None, None).await.unwrap();
    let day = scopes[0].used.period(BudgetKey::new(Measure::Tokens, Period::Day));
    assert_eq!(day.counted, 600, "past the soft 300, counted");
}

/// The demotion lasts until the period turns in the tenant's zone, a clock change between
/// included: past its soft budget an hour before New York's clocks go forward (Sunday 14 March
/// 2027, 01:00 there), the tenant is demoted until local midnight, 22 hours later, not 23.
pub async fn a_demotion_ends_at_local_midnight_across_a_clock_change<S: Store>(h: Harness<S>) {
    if !h.exact_time() {
        return; // Moves the clock by months.
    }
    const MARCH_14_0600_UTC: u64 = 1_805_004_000_000;
    h.advance(MARCH_14_0600_UTC - h.now_ms()).await;
    let mut ask = h.attributes(100, 100);
    ask.priority = Some(Priority::Standard);
    admitted(&h.admission.reserve(&ask).await);
    let day = BudgetKey::new(Measure::Tokens, Period::Day);
    assert_eq!(admitted(&h.admission.reserve(&ask).await).soft_limit, Some(day));
    // Demoted: two holds are all a sheddable request may wait behind (a standard one would fit).
    assert_eq!(denied(&h.admission.reserve(&ask).await).reason, Reason::QueueFull, "demoted");
    // Monday 00:30 in New York, summer time: 04:30 UTC.
    h.advance(22 * 3_600_000 + 30 * 60_000).await;
    let next = admitted(&h.admission.reserve(&ask).await).clone();
    assert_eq!((next.tier, next.soft_limit), (Priority::Standard, None), "a new day there");
}
