//! The protocol's nouns, with no I/O: what a hold is called, what it holds, how a phase answers.
//! The store's codecs (`store::phase`) turn these into a script's `KEYS`/`ARGV` and back;
//! admission and the edge speak only these.
//!
//! - [`id`]: the reservation id, which carries every leg of a hold.
//! - [`limits`]: a scope's limits as a decision applies them, and the headroom left after it.
//! - [`refusal`]: why a script refused.
//! - [`outcome`]: how each phase answered, what a commit was told and what it charged.
//! - [`ledger`]: a settled hold's ledger entry as a JSON line.
//! - [`charge`]: what reported counts charge, cached prompt tokens at their weight and price.

pub mod charge;
pub mod id;
pub mod ledger;
pub mod limits;
pub mod outcome;
pub mod refusal;

pub use crate::config::MAX_TOKEN_COUNT;
/// Period budgets are the policy's nouns (`config::budget`); decisions speak of them as of holds.
pub use crate::config::budget::{self, BudgetKey, BudgetLimits, Measure, Period};
pub use charge::{Charge, Detail, charge};
pub use id::{ReservationRef, parse_reservation_id};
pub use limits::{Amounts, Bucket, Headroom, ScopeLimits, Sides, Window};
pub use outcome::{
    CommitOutcome, Counted, Ending, Forwarded, ReleaseOutcome, RenewOutcome, ReserveOutcome, Settled, Usage,
};
pub use refusal::{KeyRepeat, PoolRefusal, Refusal, WouldRefuse};

/// One UTC day in milliseconds: budgets reset on the store's day number, `now / DAY_MS`.
pub const DAY_MS: u64 = 86_400_000;

/// The UTC calendar month of a day number (days since 1970-01-01), as year x 12 + month - 1: the
/// month `lua/common.lua`'s `month_of` gives, the period of a monthly budget.
pub fn month_of(day: u64) -> u64 {
    let (y, m, _) = civil_date(day);
    y * 12 + m - 1
}

/// The UTC calendar date (year, month 1-12, day 1-31) of a day number (days since 1970-01-01).
/// (Days to the civil calendar after H. Hinnant; day numbers are far below where u64 arithmetic
/// could overflow.)
pub fn civil_date(day: u64) -> (u64, u64, u64) {
    let z = day + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + u64::from(m <= 2), m, d)
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_day_falls_in_its_calendar_month() {
        // 1970-01-01; 2026-11-30 and 2026-12-01; 2024-02-29 and 2024-03-01.
        for (day, year, month) in
            [(0, 1970, 1), (20_787, 2026, 11), (20_788, 2026, 12), (19_782, 2024, 2), (19_783, 2024, 3)]
        {
            assert_eq!(super::month_of(day), year * 12 + month - 1, "day {day}");
        }
    }
}
