//! The Budgets API's side of admission: what a tenant's scopes have used and have left
//! ([`Admission::budgets`]), an adjustment of one period budget ([`Admission::adjust_budget`]),
//! and the remaining-budget gauges kept from periodic reads ([`Admission::run_budget_gauges`]).

use std::sync::Arc;
use std::time::Duration;

use super::{Admission, AdmissionError, plan};
use crate::config::{Policy, TenantPolicy};
use crate::hold::BudgetKey;
use crate::store::Store;
use crate::store::phase::budget::Adjusted;

/// One scope's limits and what the store has counted against them (see `Admission::budgets`).
#[derive(Debug, Clone, PartialEq)]
pub struct ScopeBudget {
    /// `tenant`, `user <id>`, `model <name>`.
    pub scope: String,
    pub limits: crate::hold::ScopeLimits,
    pub used: crate::store::phase::budget::ScopeUse,
}

/// A credit, debit or reset of one period budget (see `Admission::adjust_budget`).
#[derive(Debug, Clone, Copy)]
pub struct Adjustment<'a> {
    pub tenant: &'a str,
    /// The user's scope instead of the tenant's.
    pub user: Option<&'a str>,
    /// The model's scope instead of the tenant's.
    pub model: Option<&'a str>,
    pub budget: BudgetKey,
    /// Taken off what the period counted (tokens, or nanos for money); below zero, added to it.
    pub credit: i64,
    /// Everything the period counted taken off it.
    pub reset: bool,
    /// Makes the adjustment once, however often it is sent.
    pub request_id: &'a str,
    /// Who asked, and why: entered in the ledger.
    pub by: &'a str,
    pub why: &'a str,
}

/// How long an adjustment's request id is remembered: a week.
const ADJUSTMENT_TTL_MS: u64 = 7 * 86_400_000;

impl<S: Store> Admission<S> {
    /// What `tenant`'s scope (and its `user`'s and `model`'s, where the policy limits them) has
    /// used, holds and has left, with the limits it was read against: for the Budgets API.
    pub async fn budgets(
        &self,
        tenant: &str,
        user: Option<&str>,
        model: Option<&str>,
    ) -> Result<Vec<ScopeBudget>, AdmissionError> {
        self.read_budgets(tenant, user, model, true).await
    }

    /// The same; `count_held` false leaves what live holds hold at 0 (the tenant's holds unread).
    async fn read_budgets(
        &self,
        tenant: &str,
        user: Option<&str>,
        model: Option<&str>,
        count_held: bool,
    ) -> Result<Vec<ScopeBudget>, AdmissionError> {
        let (_, tp, scopes) = self.budgets_scopes(tenant, user, model)?;
        let read: Vec<_> = scopes.iter().map(|s| (s.key.clone(), s.limits)).collect();
        let offset = tp.zone.offset_minutes_at(self.clock.now_ms());
        let used = self.protocol.budget(tenant, &read, count_held, offset).await?;
        Ok(scopes
            .into_iter()
            .zip(used)
            .map(|(s, used)| ScopeBudget { scope: s.label, limits: s.limits, used })
            .collect())
    }

    /// Credits, debits or resets one period budget of one of `tenant`'s scopes (its user's or
    /// model's when the adjustment names one), once per request id, entered in the ledger with
    /// who asked and why. The scope must have that budget.
    pub async fn adjust_budget(&self, a: &Adjustment<'_>) -> Result<Adjusted, AdmissionError> {
        let bad = AdmissionError::BadName;
        crate::config::names::check_idempotency_key(a.request_id).map_err(|e| bad(format!("request_id {e}")))?;
        let scopes = self.budgets_scopes(a.tenant, a.user, a.model)?;
        let (policy, tp, scopes) = scopes;
        let scope = match (a.user, a.model) {
            (Some(user), _) => scopes.iter().find(|s| s.label == format!("user {user}")),
            (None, Some(_)) => scopes.iter().find(|s| s.label.starts_with("model ")),
            (None, None) => scopes.first(),
        };
        let Some(scope) = scope else {
            let named = a.user.map(|u| format!("user {u}")).or(a.model.map(|m| format!("model {m}")));
            return Err(bad(format!("tenant {} sets no limits for {}", a.tenant, named.unwrap_or_default())));
        };
        if scope.limits.budget(a.budget).is_none() {
            return Err(bad(format!("{} of tenant {} has no {}", scope.label, a.tenant, a.budget.name())));
        }
        let fingerprint = format!("{} {} {} {}", scope.key, a.budget.name(), a.credit, a.reset);
        let call = crate::store::phase::budget::AdjustCall {
            tenant: a.tenant,
            scope_key: &scope.key,
            budget: a.budget,
            credit: a.credit,
            reset: a.reset,
            request_id: a.request_id,
            fingerprint: &fingerprint,
            remember_ms: ADJUSTMENT_TTL_MS,
            idle_ttl_ms: tp.idle_ttl_ms,
            ledger: policy.ledger.as_ref().map(|l| l.terms),
            entry: [a.user.unwrap_or(""), a.model.unwrap_or(""), a.by, a.why],
            zone_offset_min: tp.zone.offset_minutes_at(self.clock.now_ms()),
        };
        Ok(self.protocol.adjust_budget(&call).await?)
    }

    /// The policy, the tenant's, and the scopes a tenant's (user's, model's) budgets are kept in.
    #[allow(clippy::type_complexity)]
    fn budgets_scopes(
        &self,
        tenant: &str,
        user: Option<&str>,
        model: Option<&str>,
    ) -> Result<(Arc<Policy>, Arc<TenantPolicy>, Vec<plan::Scope>), AdmissionError> {
        let bad = |what: &str, why: crate::config::names::IdError| AdmissionError::BadName(format!("{what} {why}"));
        crate::config::names::check_tenant(tenant).map_err(|e| bad("tenant id", e))?;
        if let Some(user) = user {
            crate::config::names::check_user(user).map_err(|e| bad("user id", e))?;
        }
        let policy = self.policy();
        let tp = Arc::clone(
            self.tenant_policy(&policy, tenant)
                .ok_or_else(|| AdmissionError::BadName(format!("tenant {tenant:?} has no policy")))?,
        );
        let model =
            match model {
                Some(m) => Some(policy.model(m).map(|(name, _)| name.to_string()).ok_or_else(|| {
                    AdmissionError::BadName(format!("model {m:?} is not one of the policy's models"))
                })?),
                None => None,
            };
        let scopes = plan::scopes(tenant, user, model.as_deref().unwrap_or(""), &tp);
        Ok((policy, tp, scopes))
    }

    /// Reads the period budgets of every tenant with series of its own, every `every`, into the
    /// remaining-budget gauges, until `shutdown`. A read that fails leaves the last one standing.
    pub async fn run_budget_gauges(&self, every: Duration, shutdown: tokio_util::sync::CancellationToken) {
        if !self.metrics.enabled() {
            return;
        }
        let mut ticks = tokio::time::interval(every);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = ticks.tick() => self.read_budget_gauges().await,
                () = shutdown.cancelled() => break,
            }
        }
    }

    async fn read_budget_gauges(&self) {
        let policy = self.policy();
        let tenants = self.metrics.budget_tenants();
        for tenant in &tenants {
            // An unlisted tenant admitted under a plan its token named has that plan's limits only
            // while this replica remembers the plan: otherwise its counters would be shown against
            // another plan's limits. (One on `default_tenant` where the policy reads plans from
            // identity cannot be told from a forgotten one, so neither has gauges.)
            if !self.plan_known(&policy, tenant) {
                self.metrics.budgets_read(tenant, None);
                continue;
            }
            // What is left is all the gauges show: the tenant's live holds are not read.
            let scopes = match self.read_budgets(tenant, None, None, false).await {
                Ok(scopes) => scopes,
                Err(AdmissionError::Store(e)) => {
                    tracing::debug!(error = %e, tenant, "reading budgets for the gauges failed; keeping the last");
                    continue;
                }
                Err(_) => {
                    self.metrics.budgets_read(tenant, None);
                    continue;
                }
            };
            let Some(scope) = scopes.first() else { continue };
            let seconds = |ms: u64| Duration::from_millis(ms).as_secs_f64();
            let levels: Vec<_> = BudgetKey::all()
                .filter_map(|b| {
                    let limit = scope.limits.budget(b)?.get();
                    let used = scope.used.period(b);
                    let remaining = i64::try_from(limit)
                        .unwrap_or(i64::MAX)
                        .saturating_sub(i64::try_from(used.counted).unwrap_or(i64::MAX));
                    Some((b.name(), limit, remaining, seconds(used.ends_in_ms)))
                })
                .collect();
            self.metrics.budgets_read(tenant, (!levels.is_empty()).then_some(levels));
        }
        self.metrics.keep_budgets_of(&tenants);
    }
}
