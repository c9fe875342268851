//! Period budgets: what a budget counts (tokens, input tokens, output tokens or money), over which
//! calendar period (hour, day, week or month, in the tenant's time zone), and the name of its
//! counter in a scope hash (`lua/common.lua`).

/// The calendar period a budget counts over, in the tenant's time zone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Period {
    Hour,
    Day,
    /// Monday to Sunday.
    Week,
    Month,
}

impl Period {
    pub const ALL: [Period; 4] = [Period::Hour, Period::Day, Period::Week, Period::Month];

    /// As the policy and the Budgets API name it: `hour`, `day`, `week`, `month`.
    pub fn as_str(self) -> &'static str {
        match self {
            Period::Hour => "hour",
            Period::Day => "day",
            Period::Week => "week",
            Period::Month => "month",
        }
    }

    /// The adjective of a refusal's message: "hourly", "daily", "weekly", "monthly".
    fn adjective(self) -> &'static str {
        match self {
            Period::Hour => "hourly",
            Period::Day => "daily",
            Period::Week => "weekly",
            Period::Month => "monthly",
        }
    }

    /// The first letter of its counters' names in a scope hash.
    fn letter(self) -> char {
        match self {
            Period::Hour => 'h',
            Period::Day => 'd',
            Period::Week => 'w',
            Period::Month => 'm',
        }
    }
}

/// What a budget counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Measure {
    /// Every token, prompt and output (weighted tokens at their weight).
    Tokens,
    /// Money, in nanos of the policy's currency, at the models' prices.
    Cost,
    /// Prompt tokens (cached ones at their weight).
    Input,
    /// Output tokens (reasoning ones at their weight).
    Output,
}

impl Measure {
    pub const ALL: [Measure; 4] = [Measure::Tokens, Measure::Cost, Measure::Input, Measure::Output];

    /// The second letter of its counters' names: `u` (tokens used), `c` (cost), `p` (prompt),
    /// `g` (generated).
    fn letter(self) -> char {
        match self {
            Measure::Tokens => 'u',
            Measure::Cost => 'c',
            Measure::Input => 'p',
            Measure::Output => 'g',
        }
    }

    /// The policy's name of its budgets, before `_per_<period>`.
    fn field(self) -> &'static str {
        match self {
            Measure::Tokens => "tokens",
            Measure::Cost => "cost",
            Measure::Input => "input_tokens",
            Measure::Output => "output_tokens",
        }
    }

    fn noun(self) -> &'static str {
        match self {
            Measure::Tokens => "token",
            Measure::Cost => "cost",
            Measure::Input => "input token",
            Measure::Output => "output token",
        }
    }
}

/// One period budget: a measure over a period. Its counter in a scope hash is named by two
/// letters, period then measure (`du`: tokens today; `wg`: output tokens this week).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BudgetKey {
    pub period: Period,
    pub measure: Measure,
}

impl BudgetKey {
    pub const fn new(measure: Measure, period: Period) -> BudgetKey {
        BudgetKey { period, measure }
    }

    /// Every budget, periods in order, measures in order within each: the order of
    /// [`BudgetKey::index`].
    pub fn all() -> impl Iterator<Item = BudgetKey> {
        Period::ALL
            .into_iter()
            .flat_map(|period| Measure::ALL.into_iter().map(move |measure| BudgetKey { period, measure }))
    }

    /// Its place in [`BudgetKey::all`], 0 to 15.
    pub fn index(self) -> usize {
        let p = Period::ALL.iter().position(|&p| p == self.period).unwrap_or(0);
        let m = Measure::ALL.iter().position(|&m| m == self.measure).unwrap_or(0);
        p.saturating_mul(4).saturating_add(m)
    }

    /// Its counter's name in a scope hash, two letters.
    pub fn counter(self) -> String {
        [self.period.letter(), self.measure.letter()].iter().collect()
    }

    /// The budget a counter's name stands for.
    pub fn from_counter(counter: &str) -> Option<BudgetKey> {
        BudgetKey::all().find(|k| k.counter() == counter)
    }

    /// As the policy and the Budgets API name it: `tokens_per_day`, `input_tokens_per_hour`,
    /// `cost_per_week`.
    pub fn name(self) -> String {
        format!("{}_per_{}", self.measure.field(), self.period.as_str())
    }

    /// The budget a policy name stands for.
    pub fn from_name(name: &str) -> Option<BudgetKey> {
        BudgetKey::all().find(|k| k.name() == name)
    }

    /// In words, for a refusal's message: "daily token budget", "weekly input token budget".
    pub fn describe(self) -> String {
        format!("{} {} budget", self.period.adjective(), self.measure.noun())
    }

    /// Whether leasing can decide it from a replica's slices: tokens and money per UTC day and
    /// month, as leasing was built for. The others are decided at the store.
    pub fn leasable(self) -> bool {
        matches!(self.measure, Measure::Tokens | Measure::Cost) && matches!(self.period, Period::Day | Period::Month)
    }
}

/// The four budgets leasing decides from slices.
pub const TOKENS_PER_DAY: BudgetKey = BudgetKey::new(Measure::Tokens, Period::Day);
pub const TOKENS_PER_MONTH: BudgetKey = BudgetKey::new(Measure::Tokens, Period::Month);
pub const COST_PER_DAY: BudgetKey = BudgetKey::new(Measure::Cost, Period::Day);
pub const COST_PER_MONTH: BudgetKey = BudgetKey::new(Measure::Cost, Period::Month);

/// A budget's limit for each [`BudgetKey`], by [`BudgetKey::index`] (`0`: none).
pub type BudgetLimits = [u64; 16];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_budget_has_one_counter_and_one_name() {
        let all: Vec<BudgetKey> = BudgetKey::all().collect();
        assert_eq!(all.len(), 16);
        for (i, k) in all.iter().enumerate() {
            assert_eq!(k.index(), i);
            assert_eq!(BudgetKey::from_counter(&k.counter()), Some(*k));
            assert_eq!(BudgetKey::from_name(&k.name()), Some(*k));
        }
        let day_tokens = BudgetKey::new(Measure::Tokens, Period::Day);
        assert_eq!((day_tokens.counter().as_str(), day_tokens.name().as_str()), ("du", "tokens_per_day"));
        let month_cost = BudgetKey::new(Measure::Cost, Period::Month);
        assert_eq!(month_cost.counter(), "mc", "the counters a scope hash had before hours and weeks");
        assert_eq!(BudgetKey::new(Measure::Output, Period::Week).describe(), "weekly output token budget");
    }
}
