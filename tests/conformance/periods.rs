//! Budgets of every measure and period, on every store: input and output tokens apart, hours and
//! weeks beside days and months, and periods that turn at local midnight in a tenant's zone.
//! The manual clock starts on Sunday 2026-11-29 at 12:00 UTC; on Redis, time is real and the
//! waits are checked against the real clock.

use super::*;
use tollgate::hold::{BudgetKey, Measure, Period};

const HOUR: u64 = 3_600_000;
const DAY: u64 = 24 * HOUR;

/// Input and output buckets and budgets beside the totals.
pub const SIDES: &str = "limits:\n  input_tokens_per_minute: 600\n  output_tokens_per_day: 1000\n  \
    input_tokens_per_week: 5000\n";
/// An hour's and a week's tokens (holds that outlive the turns they cross).
pub const HOURLY_WEEKLY: &str = "lease_ttl_ms: 86400000\nlimits:\n  tokens_per_hour: 1000\n  tokens_per_week: 1500\n";
/// A day's tokens nine hours ahead of UTC, and a month's.
pub const TOKYO: &str =
    "time_zone: Asia/Tokyo\nlease_ttl_ms: 86400000\nlimits:\n  tokens_per_day: 1000\n  tokens_per_month: 1800\n";
/// A week's tokens in New York (five hours behind UTC in November), by the zone's name.
pub const NEW_YORK: &str = "time_zone: America/New_York\nlimits:\n  tokens_per_week: 1000\n";
/// A day's tokens eight hours behind UTC (Los Angeles in winter), and a month's.
pub const LOS_ANGELES: &str = "time_zone: America/Los_Angeles\nlease_ttl_ms: 86400000\nlimits:\n  \
    tokens_per_day: 1000\n  tokens_per_month: 1800\n";
/// A week's tokens five and a half hours ahead of UTC.
pub const KOLKATA: &str = "time_zone: Asia/Kolkata\nlimits:\n  tokens_per_week: 1000\n";
/// The sides' other windows: output tokens a minute, input tokens an hour, output tokens a month.
pub const OTHER_SIDES: &str = "lease_ttl_ms: 86400000\nlimits:\n  output_tokens_per_minute: 600\n  \
    input_tokens_per_hour: 2000\n  output_tokens_per_month: 3000\n";
/// Money by the hour and by the week (the harness's model: 1,000 nanos an input token, 3,000 an
/// output token).
pub const MONEY_HOURLY_WEEKLY: &str =
    "lease_ttl_ms: 86400000\nlimits:\n  cost_per_hour: 0.001\n  cost_per_week: 0.0015\n";

/// Ms from now until period `p` turns in a zone `offset` minutes east of UTC, by the clock the
/// store reads.
pub fn to_turn<S: Store>(h: &Harness<S>, offset: i64, p: Period) -> u64 {
    let now = h.now_ms();
    let local = i64::try_from(now).unwrap() + offset * 60_000;
    let day = local.div_euclid(DAY as i64);
    let ends = match p {
        Period::Hour => (local.div_euclid(HOUR as i64) + 1) * HOUR as i64,
        Period::Day => (day + 1) * DAY as i64,
        // Week 0 began on Monday 1969-12-29, day -3.
        Period::Week => (((day + 3).div_euclid(7) + 1) * 7 - 3) * DAY as i64,
        Period::Month => {
            let month = support::model::month_of(u64::try_from(day).unwrap());
            i64::try_from(support::model::month_start(month + 1)).unwrap() * DAY as i64
        }
    };
    u64::try_from(ends - offset * 60_000 - i64::try_from(now).unwrap()).unwrap()
}

/// The wait a budget refusal gave: exactly the turn on the manual clock, within seconds of it on
/// a real one. (`offset`: the zone's on the manual clock's date; on a real one, the tenant's zone
/// says what it is today, daylight saving and all.)
fn waits_for_turn<S: Store>(h: &Harness<S>, wait: u64, offset: i64, p: Period) {
    let offset = if h.exact_time() {
        offset
    } else {
        i64::from(h.admission.policy().tenants[&h.tenant].zone.offset_minutes_at(h.now_ms()))
    };
    let expected = to_turn(h, offset, p);
    if h.exact_time() {
        assert_eq!(wait, expected, "{p:?} at {offset} min");
    } else {
        assert!(wait.abs_diff(expected) < 5_000, "{p:?} at {offset} min: {wait} vs {expected}");
    }
}

/// What the tenant scope's budget of `m` over `p` counted, and of it held.
fn period_use(scopes: &[tollgate::admission::ScopeBudget], m: Measure, p: Period) -> (u64, u64) {
    let u = scopes[0].used.period(BudgetKey::new(m, p));
    (u.counted, u.held)
}

/// The same, read now.
async fn used<S: Store>(h: &Harness<S>, m: Measure, p: Period) -> (u64, u64) {
    period_use(&h.admission.budgets(&h.tenant, None, None).await.unwrap(), m, p)
}

/// A reserve the tenant scope's bucket of one side (`side`: input | output) refuses, 100 tokens
/// short at 10 a second.
async fn refused_a_hundred_short<S: Store>(h: &Harness<S>, prompt: u64, output: u64, side: &str) {
    let no = denied(&h.reserve(prompt, output).await).clone();
    assert_eq!(no.reason, Reason::TokenRate, "{no:?}");
    assert!(no.message.contains(&format!("{side} token rate limit of scope tenant")), "{no:?}");
    let wait = no.retry_after_ms.unwrap();
    assert!((9_000..=10_000).contains(&wait), "{wait}");
}

/// A reserve a budget refuses, its message saying which (`says`), its wait the turn of period
/// `p` in a zone `offset` minutes east (see waits_for_turn).
async fn refused_until_turn<S: Store>(
    h: &Harness<S>,
    (prompt, output): (u64, u64),
    says: &str,
    offset: i64,
    p: Period,
) -> tollgate::admission::Denial {
    let no = denied(&h.reserve(prompt, output).await).clone();
    assert_eq!(no.reason, Reason::Budget, "{no:?}");
    assert!(no.message.contains(says), "{no:?}");
    waits_for_turn(h, no.retry_after_ms.unwrap(), offset, p);
    no
}

/// The prompt and the output are held and corrected each on its own side: a bucket of input
/// tokens refuses a long prompt while output is plentiful, a day's output budget refuses a large
/// max_tokens while input is, and a commit gives back (or charges) each side what it did not use
/// (or overran).
pub async fn input_and_output_limits_hold_and_correct_each_side<S: Store>(h: Harness<S>) {
    let first = admitted(&h.reserve(400, 300).await).reservation_id.clone();
    refused_a_hundred_short(&h, 300, 10, "input").await;
    refused_until_turn(&h, (100, 800), "daily output token budget of scope tenant", 0, Period::Day).await;
    // Larger than the input bucket could ever hold: no wait helps.
    assert_eq!(denied(&h.reserve(601, 1).await).reason, Reason::Unsatisfiable);

    assert_eq!(used(&h, Measure::Output, Period::Day).await, (300, 300), "held, all of it");
    assert_eq!(used(&h, Measure::Input, Period::Week).await, (400, 400));

    // 400 in and 50 out: 250 of the output comes back, the input stands.
    h.admission.commit(&first, 400, 50).await.unwrap();
    assert_eq!(used(&h, Measure::Output, Period::Day).await, (50, 0));
    assert_eq!(used(&h, Measure::Input, Period::Week).await, (400, 0));
    assert_eq!(used(&h, Measure::Tokens, Period::Day).await, (450, 0), "the total moves with both");
    let second = admitted(&h.reserve(100, 800).await).reservation_id.clone();
    // An output past its hold is debt on the output side: 50 + 1,000 is past the day's 1,000.
    h.admission.commit(&second, 100, 1000).await.unwrap();
    assert_eq!(used(&h, Measure::Output, Period::Day).await, (1050, 0));
    let scopes = h.admission.budgets(&h.tenant, None, None).await.unwrap();
    assert_eq!(period_use(&scopes, Measure::Input, Period::Week), (500, 0));
    assert_eq!(denied(&h.reserve(0, 1).await).reason, Reason::Budget);
    // The limits as Get reports them, by the policy's names.
    let states = tollgate::grpc::budgets::limit_states(&scopes[0]);
    let names: Vec<&str> = states.iter().map(|l| l.name.as_str()).collect();
    assert_eq!(names, ["input_tokens_per_minute", "output_tokens_per_day", "input_tokens_per_week"]);
    if h.exact_time() {
        h.advance(to_turn(&h, 0, Period::Day)).await;
        admitted(&h.reserve(0, 900).await);
    }
}

/// An hour's budget turns on the hour, a week's on Monday at midnight; a hold released after its
/// hour turned gives its tokens back to the week, not to the new hour.
pub async fn hourly_and_weekly_budgets_turn_on_their_boundaries<S: Store>(h: Harness<S>) {
    let first = admitted(&h.reserve(0, 800).await).reservation_id.clone();
    refused_until_turn(&h, (0, 300), "hourly token budget of scope tenant", 0, Period::Hour).await;
    if !h.exact_time() {
        assert_eq!(used(&h, Measure::Tokens, Period::Week).await, (800, 800));
        return;
    }
    // Sunday 13:00: a new hour, the same week.
    h.advance(HOUR).await;
    let second = admitted(&h.reserve(0, 300).await).reservation_id.clone();
    let no = denied(&h.reserve(0, 500).await).clone();
    assert!(no.message.contains("weekly token budget of scope tenant"), "{no:?}");
    assert_eq!(no.retry_after_ms, Some(11 * HOUR), "to Monday 00:00 UTC");
    // The first hold's hour has passed: the week gets its 800 back, this hour keeps its 300.
    h.admission.release(&first).await.unwrap();
    let scope = h.tenant_scope().await;
    assert_eq!((scope.num("hu"), scope.num("wu")), (300.0, 300.0));
    admitted(&h.reserve(0, 500).await);
    h.admission.commit(&second, 0, 100).await.unwrap();
    // Monday: a new week and a new hour.
    h.advance(11 * HOUR).await;
    admitted(&h.reserve(0, 1000).await);
    assert_eq!(denied(&h.reserve(0, 1).await).reason, Reason::Budget);
    let scope = h.tenant_scope().await;
    assert_eq!((scope.num("hu"), scope.num("wu")), (1000.0, 1000.0));
}

/// Nine hours ahead of UTC, the day turns at 15:00 UTC and so does the month; a hold of the old
/// local day released after the turn does not refund the new one.
pub async fn a_zone_ahead_of_utc_turns_the_day_at_its_midnight<S: Store>(h: Harness<S>) {
    // 21:00 in Tokyo on 29 November: three hours to midnight.
    the_day_and_the_month_turn_at_local_midnight(h, 9 * 60, 3 * HOUR).await;
}

/// Eight hours behind UTC, the day turns at 08:00 UTC and so does the month.
pub async fn a_zone_behind_utc_turns_the_day_at_its_midnight<S: Store>(h: Harness<S>) {
    // 04:00 in Los Angeles on 29 November: twenty hours to midnight.
    the_day_and_the_month_turn_at_local_midnight(h, -8 * 60, 20 * HOUR).await;
}

/// A day's budget of 1,000 and a month's of 1,800 in a zone `offset` minutes east of UTC, whose
/// midnight is `to_midnight` ms after the manual clock's start (29 November): the day turns at
/// local midnight, the month two days later (1 December); a hold of the old day released after
/// the turn gives back to the month, not to the new day.
async fn the_day_and_the_month_turn_at_local_midnight<S: Store>(h: Harness<S>, offset: i64, to_midnight: u64) {
    let yesterday = admitted(&h.reserve(0, 900).await).reservation_id.clone();
    let no = refused_until_turn(&h, (0, 200), "daily token budget", offset, Period::Day).await;
    if !h.exact_time() {
        return;
    }
    assert_eq!(no.retry_after_ms, Some(to_midnight));
    h.advance(to_midnight).await;
    admitted(&h.reserve(0, 800).await);
    // 30 November there: the day has 200 left, the month 100.
    let no = denied(&h.reserve(0, 150).await).clone();
    assert!(no.message.contains("monthly token budget"), "{no:?}");
    assert_eq!(no.retry_after_ms, Some(DAY), "1 December, 00:00 in the zone");
    // Yesterday's hold released: back to the month, not to the new day.
    h.admission.release(&yesterday).await.unwrap();
    let scope = h.tenant_scope().await;
    assert_eq!((scope.num("du"), scope.num("mu")), (800.0, 800.0));
    admitted(&h.reserve(0, 150).await);
    h.advance(DAY - 1).await;
    assert_eq!(denied(&h.reserve(0, 1000).await).reason, Reason::Budget, "still November there");
    h.advance(1).await;
    admitted(&h.reserve(0, 1000).await);
}

/// Behind UTC, by the zone's name: New York's week turns on Monday at 05:00 UTC in November.
pub async fn a_zone_behind_utc_turns_the_week_at_its_midnight<S: Store>(h: Harness<S>) {
    // Sunday 07:00 in New York: 17 hours to Monday.
    the_week_turns_at_local_midnight(h, -5 * 60, 17 * HOUR).await;
}

/// Ahead of UTC by five and a half hours: Kolkata's week turns on Sunday at 18:30 UTC.
pub async fn a_zone_ahead_of_utc_turns_the_week_at_its_midnight<S: Store>(h: Harness<S>) {
    // Sunday 17:30 in Kolkata: six and a half hours to Monday.
    the_week_turns_at_local_midnight(h, 5 * 60 + 30, 13 * HOUR / 2).await;
}

/// A week's budget of 1,000 in a zone `offset` minutes east of UTC whose Monday begins
/// `to_monday` ms after the manual clock's start (Sunday 29 November, 12:00 UTC).
async fn the_week_turns_at_local_midnight<S: Store>(h: Harness<S>, offset: i64, to_monday: u64) {
    admitted(&h.reserve(0, 900).await);
    let no = refused_until_turn(&h, (0, 200), "weekly token budget", offset, Period::Week).await;
    if !h.exact_time() {
        return;
    }
    assert_eq!(no.retry_after_ms, Some(to_monday));
    h.advance(to_monday - 1).await;
    assert_eq!(denied(&h.reserve(0, 200).await).reason, Reason::Budget, "still Sunday there");
    h.advance(1).await;
    admitted(&h.reserve(0, 1000).await);
}

/// The sides' other windows: a bucket of output tokens refuses a large max_tokens while input is
/// plentiful, an hour's input budget refuses a long prompt and turns on the hour, and a month's
/// output budget takes an overrun as debt and refuses until the month turns.
pub async fn the_other_windows_of_each_side_hold_and_correct<S: Store>(h: Harness<S>) {
    let first = admitted(&h.reserve(1500, 500).await).reservation_id.clone();
    refused_a_hundred_short(&h, 0, 200, "output").await;
    refused_until_turn(&h, (600, 10), "hourly input token budget of scope tenant", 0, Period::Hour).await;

    // 1,500 in and 100 out: 400 back to the output bucket and the month; the input stands.
    h.admission.commit(&first, 1500, 100).await.unwrap();
    let scopes = h.admission.budgets(&h.tenant, None, None).await.unwrap();
    assert_eq!(period_use(&scopes, Measure::Output, Period::Month), (100, 0));
    assert_eq!(period_use(&scopes, Measure::Input, Period::Hour), (1500, 0));
    let states = tollgate::grpc::budgets::limit_states(&scopes[0]);
    let names: Vec<&str> = states.iter().map(|l| l.name.as_str()).collect();
    assert_eq!(names, ["output_tokens_per_minute", "input_tokens_per_hour", "output_tokens_per_month"]);
    let second = admitted(&h.reserve(400, 500).await).reservation_id.clone();
    // 2,901 out of a hold of 500: debt on the output side, the month past its 3,000.
    h.admission.commit(&second, 400, 2901).await.unwrap();
    assert_eq!(used(&h, Measure::Output, Period::Month).await, (3001, 0));
    assert_eq!(used(&h, Measure::Input, Period::Hour).await, (1900, 0));
    refused_until_turn(&h, (0, 1), "monthly output token budget of scope tenant", 0, Period::Month).await;
    if !h.exact_time() {
        return;
    }
    // The hour turns: the input budget is whole again, and only the month refuses.
    h.advance(to_turn(&h, 0, Period::Hour)).await;
    assert_eq!(used(&h, Measure::Input, Period::Hour).await, (0, 0));
    let no = denied(&h.reserve(2000, 1).await).clone();
    assert!(no.message.contains("monthly output token budget"), "{no:?}");
    h.advance(to_turn(&h, 0, Period::Month)).await;
    admitted(&h.reserve(2000, 600).await);
}

/// Money by the hour and the week: the hour refuses first and turns on the hour; the week, which
/// frees last, is the reason once both refuse, until Monday.
pub async fn budgets_in_money_turn_by_the_hour_and_the_week<S: Store>(h: Harness<S>) {
    // 100 in and 200 out: 700,000 nanos held.
    let first = admitted(&h.reserve(100, 200).await).reservation_id.clone();
    refused_until_turn(&h, (100, 200), "hourly cost budget of scope tenant", 0, Period::Hour).await;
    let c = h.admission.commit(&first, 100, 50).await.unwrap();
    assert_eq!(c.usage().unwrap().cost_nanos, 250_000);
    assert_eq!(used(&h, Measure::Cost, Period::Hour).await, (250_000, 0));
    assert_eq!(used(&h, Measure::Cost, Period::Week).await, (250_000, 0));
    if !h.exact_time() {
        return;
    }
    // Sunday 13:00: a new hour, the same week.
    h.advance(HOUR).await;
    let second = admitted(&h.reserve(100, 200).await).reservation_id.clone();
    h.admission.commit(&second, 100, 200).await.unwrap();
    assert_eq!(used(&h, Measure::Cost, Period::Hour).await, (700_000, 0), "a new hour");
    assert_eq!(used(&h, Measure::Cost, Period::Week).await, (950_000, 0), "the same week");
    // 700,000 more would pass the hour's 1,000,000 and the week's 1,500,000: the week frees last.
    let no = denied(&h.reserve(100, 200).await).clone();
    assert!(no.message.contains("weekly cost budget of scope tenant"), "{no:?}");
    assert_eq!(no.retry_after_ms, Some(11 * HOUR), "to Monday 00:00 UTC");
    admitted(&h.reserve(10, 10).await);
    h.advance(11 * HOUR).await;
    admitted(&h.reserve(100, 200).await);
    let scope = h.tenant_scope().await;
    assert_eq!((scope.num("hc"), scope.num("wc")), (700_000.0, 700_000.0));
}

/// A day's tokens only, and holds that outlive the reloads below.
pub const DAY_ONLY: &str = "lease_ttl_ms: 86400000\nlimits:\n  tokens_per_day: 100000\n";

/// Replaces the tenant's policy with what `change` makes of it.
fn reload<S: Store>(h: &Harness<S>, change: impl FnOnce(&mut tollgate::config::TenantPolicy)) {
    let mut policy = tollgate::config::Policy::clone(&h.admission.policy());
    let mut tp = tollgate::config::TenantPolicy::clone(&policy.tenants[&h.tenant]);
    change(&mut tp);
    policy.tenants.insert(h.tenant.clone(), std::sync::Arc::new(tp));
    h.admission.reload(policy);
}

/// A budget a reload adds counts the holds made after it; a hold made before gives nothing back to
/// it (it never charged it), so the budget is never credited with what it never held.
pub async fn a_budget_a_reload_adds_is_not_credited_by_older_holds<S: Store>(h: Harness<S>) {
    let older = admitted(&h.reserve(1000, 8000).await).reservation_id.clone();
    reload(&h, |tp| tp.limits.tokens_per_week = Some(50_000));
    admitted(&h.reserve(1000, 8000).await);
    // The older hold used 1,500 of its 9,000: 7,500 back to the day, none to the week.
    h.admission.commit(&older, 1000, 500).await.unwrap();
    let scope = h.tenant_scope().await;
    assert_eq!((scope.num("du"), scope.num("wu")), (10_500.0, 9_000.0), "{scope:?}");
    assert_eq!(used(&h, Measure::Tokens, Period::Week).await, (9_000, 9_000));
}

/// Debt charged with a zone's offset that has moved since the period was counted (a reload that
/// changed the zone, or a daylight-saving change) counts in the period the counters are in: a
/// marker never goes back, and nothing counted is lost.
pub async fn debt_in_an_earlier_period_than_the_counted_one_is_kept<S: Store>(h: Harness<S>) {
    reload(&h, |tp| tp.zone = tollgate::config::Zone::parse("+09:00").unwrap());
    if !h.exact_time() {
        return;
    }
    // 16:00 UTC: 30 November, 01:00 in the zone.
    h.advance(4 * HOUR).await;
    let first = admitted(&h.reserve(0, 1000).await).reservation_id.clone();
    admitted(&h.reserve(0, 1000).await);
    let day = h.tenant_scope().await.num("d");
    // Back to UTC: it is 29 November there. The first hold overruns by 500.
    reload(&h, |tp| tp.zone = tollgate::config::Zone::utc());
    h.admission.commit(&first, 0, 1500).await.unwrap();
    let scope = h.tenant_scope().await;
    assert_eq!((scope.num("d"), scope.num("du")), (day, 2_500.0), "{scope:?}");
}

/// Debt charged after the period its hold was counted in has turned starts the new period's count
/// (every counter of the period the scope has at zero, then the debt, tokens and money alike): the
/// hold's own tokens stay with the day that ended, and the month, which has not turned, counts
/// them all.
pub async fn debt_after_the_period_turned_starts_the_new_one<S: Store>(h: Harness<S>) {
    if !h.exact_time() {
        return;
    }
    // Sunday 29 November, 12:00 UTC: a hold of 1,000; Monday 30 November, 01:00: it used 1,500.
    let first = admitted(&h.reserve(0, 1000).await).reservation_id.clone();
    let day = h.tenant_scope().await.num("d");
    h.advance(13 * HOUR).await;
    h.admission.commit(&first, 0, 1500).await.unwrap();
    let scope = h.tenant_scope().await;
    // (The harness's model costs 3,000 nanos an output token: the debt's money moves as its tokens.)
    assert_eq!((scope.num("d"), scope.num("du"), scope.num("dc")), (day + 1.0, 500.0, 1_500_000.0), "{scope:?}");
    assert_eq!((scope.num("mu"), scope.num("mc")), (1_500.0, 4_500_000.0), "{scope:?}");
    assert_eq!(used(&h, Measure::Tokens, Period::Day).await, (500, 0), "counted, held");
}
