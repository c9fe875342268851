//! A scope's limits: each one in range, a child's within its tenant's, and a tenant's soft budgets.

use std::collections::{BTreeMap, HashMap};

use super::{Problem, problem};
use crate::config::budget::{BudgetKey, BudgetLimits, Measure};
use crate::config::{Limits, ModelPolicy, Money};

/// The first model, by name, that has no price: a budget in money cannot count it.
fn first_unpriced<'a>(models: impl IntoIterator<Item = (&'a String, &'a ModelPolicy)>) -> Option<&'a str> {
    models.into_iter().filter(|(_, m)| m.price.is_none()).map(|(n, _)| n.as_str()).min()
}

/// A budget in money counts every model that may be charged to it at its price, so none of
/// `models` may be unpriced while `limits` (at `field`) has one.
pub(super) fn money_needs_prices<'a>(
    field: &str,
    limits: &Limits,
    models: impl IntoIterator<Item = (&'a String, &'a ModelPolicy)>,
) -> Result<(), Problem> {
    if let Some((key, _)) = limits.budgets().find(|(k, _)| k.measure == Measure::Cost)
        && let Some(first) = first_unpriced(models)
    {
        return Err(problem(format!("{field}.{}", key.name()), unpriced(first)));
    }
    Ok(())
}

/// Why a budget in money is refused while `model` has no price.
fn unpriced(model: &str) -> String {
    format!("model {model} has no price: a budget in money needs every model priced")
}

/// An amount of `measure` as a message shows it: money in the currency, else a count.
fn shown(measure: Option<Measure>, n: u64) -> String {
    if measure == Some(Measure::Cost) { Money(n).to_string() } else { n.to_string() }
}

/// A tenant's soft budgets: period budgets only, each below the hard budget of the same period and
/// measure where the tenant has one (else it would never degrade before refusing).
pub(super) fn soft_budgets(
    field: &str,
    soft: Option<&Limits>,
    hard: &Limits,
    models: &HashMap<String, ModelPolicy>,
) -> Result<BudgetLimits, Problem> {
    let mut out = BudgetLimits::default();
    let Some(soft) = soft else { return Ok(out) };
    let f = format!("{field}.soft_limits");
    if let Some((name, _)) = soft.rates().into_iter().find(|(_, v)| v.is_some()) {
        return Err(problem(
            format!("{f}.{name}"),
            "only period budgets can be soft (tokens_per_day, cost_per_month, ...)",
        ));
    }
    check_limits(&f, soft)?;
    money_needs_prices(&f, soft, models)?;
    for (key, limit) in soft.budgets() {
        if let Some(h) = hard.budget(key)
            && limit >= h
        {
            let shown = |n| shown(Some(key.measure), n);
            return Err(problem(
                format!("{f}.{}", key.name()),
                format!(
                    "{} is not below the hard {} ({}): it would never degrade first",
                    shown(limit),
                    key.name(),
                    shown(h)
                ),
            ));
        }
        if let Some(slot) = out.get_mut(key.index()) {
            *slot = limit;
        }
    }
    Ok(out)
}

/// Users or models of a tenant: each name checked, each within the tenant's limits.
pub(super) fn children(
    field: &str,
    kind: &str,
    raw: BTreeMap<String, Limits>,
    parent: &Limits,
    check_name: impl Fn(&str) -> Result<(), String>,
) -> Result<HashMap<String, Limits>, Problem> {
    let mut out = HashMap::new();
    for (name, limits) in raw {
        let f = format!("{field}.{kind}.{name}");
        check_name(&name).map_err(|why| problem(f.clone(), why))?;
        check_limits(&f, &limits)?;
        check_within(&f, &limits, parent)?;
        out.insert(name, limits);
    }
    Ok(out)
}

pub(super) fn check_limits(field: &str, l: &Limits) -> Result<(), Problem> {
    let rates = l.rates();
    let counts = l.budgets().filter(|(k, _)| k.measure != Measure::Cost).map(|(k, n)| (k.name(), Some(n)));
    for (name, value) in rates.into_iter().map(|(n, v)| (n.to_string(), v)).chain(counts) {
        if value == Some(0) {
            return Err(problem(format!("{field}.{name}"), "must be at least 1 (leave it out for no limit)"));
        }
        if value.is_some_and(|v| v > 1_000_000_000_000) {
            return Err(problem(format!("{field}.{name}"), "is above 10^12"));
        }
    }
    if let Some((key, _)) = l.budgets().find(|&(k, n)| k.measure == Measure::Cost && n == 0) {
        return Err(problem(format!("{field}.{}", key.name()), "must be above 0 (leave it out for no limit)"));
    }
    if l.burst_tokens.is_some() && l.tokens_per_minute.is_none() {
        return Err(problem(format!("{field}.burst_tokens"), "needs tokens_per_minute (the bucket's refill rate)"));
    }
    Ok(())
}

/// A child scope may not allow more than its tenant: every request passes both, so a larger child
/// limit could never be used and is almost certainly a mistake.
pub(super) fn check_within(field: &str, child: &Limits, parent: &Limits) -> Result<(), Problem> {
    let pairs = [
        ("tokens_per_minute", child.tokens_per_minute, parent.tokens_per_minute),
        ("burst_tokens", child.token_capacity(), parent.token_capacity()),
        ("input_tokens_per_minute", child.input_tokens_per_minute, parent.input_tokens_per_minute),
        ("output_tokens_per_minute", child.output_tokens_per_minute, parent.output_tokens_per_minute),
        ("requests_per_minute", child.requests_per_minute, parent.requests_per_minute),
        ("max_concurrency", child.max_concurrency, parent.max_concurrency),
    ];
    let budgets = BudgetKey::all().map(|k| (k, child.budget(k), parent.budget(k)));
    let pairs = pairs.into_iter().map(|(n, c, p)| (n.to_string(), c, p, None));
    for (name, mine, theirs, money) in pairs.chain(budgets.map(|(k, c, p)| (k.name(), c, p, Some(k.measure)))) {
        if let (Some(mine), Some(theirs)) = (mine, theirs)
            && mine > theirs
        {
            return Err(problem(
                format!("{field}.{name}"),
                format!("{} is above the tenant's {}", shown(money, mine), shown(money, theirs)),
            ));
        }
    }
    Ok(())
}
