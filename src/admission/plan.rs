//! The plan of one reserve: everything decided without the store (identity, model, bounds, what
//! can never fit), and what to hold where. A bad request is refused here, so it costs no round
//! trip and can never charge anything.

// Token arithmetic: no unchecked +, -, * (see Cargo.toml's [lints] for the casts).
#![warn(clippy::arithmetic_side_effects)]

use std::sync::Arc;

use super::lease::{Ask, AskScope};
use super::{Admission, Attributes, Denial, IdempotencyKey, Priority, Reason, ids};
use crate::config::names;
use crate::config::{Limits, Money, Policy, PoolPolicy, Price, TenantPolicy, TokenWeights};
use crate::estimate::{self, PromptSize};
use crate::hold::{MAX_TOKEN_COUNT, ScopeLimits};

use crate::store::keys;

/// The largest body size (`content-length`, `prompt_bytes`) a prompt estimate starts from: 1 TiB.
pub const MAX_PROMPT_BYTES: u64 = 1 << 40;

/// Who a request is charged to: its tenant (or the policy's anonymous tenant) and that tenant's
/// policy (its own, else the plan its plan header names, else `default_tenant`'s), with its user
/// id checked.
pub(super) fn identify<'p>(policy: &'p Policy, a: &'p Attributes) -> Result<(&'p str, &'p Arc<TenantPolicy>), Denial> {
    use Reason::{InvalidRequest, Unauthenticated};
    let header = &policy.server.tenant_header;
    let tenant = a
        .tenant
        .as_deref()
        .or(policy.anonymous_tenant.as_deref())
        .ok_or_else(|| Denial::now(Unauthenticated, format!("no tenant identity: {header} is missing")))?;
    names::check_tenant(tenant).map_err(|e| Denial::now(InvalidRequest, format!("tenant id {e}")))?;
    // A plan names terms only where the policy reads one from verified identity.
    let plan = a.plan.as_deref().filter(|_| policy.server.plan_header.is_some());
    let tp = match (policy.tenants.get(tenant), plan) {
        (Some(tp), _) => tp,
        (None, Some(plan)) => policy.plans.get(plan).ok_or_else(|| {
            Denial::now(
                Unauthenticated,
                format!("plan {plan:?} (for tenant {tenant:?}) is not one of the policy's plans"),
            )
        })?,
        (None, None) => policy
            .default_tenant
            .as_ref()
            .ok_or_else(|| Denial::now(Unauthenticated, format!("tenant {tenant:?} has no policy")))?,
    };
    if let Some(user) = &a.user {
        names::check_user(user).map_err(|e| Denial::now(InvalidRequest, format!("user id {e}")))?;
    }
    Ok((tenant, tp))
}

impl<S> Admission<S> {
    /// Checks everything that needs no store and works out what to hold where.
    pub(super) fn plan(&self, policy: &Arc<Policy>, a: &Attributes) -> Result<Plan, Denial> {
        use Reason::{InvalidRequest, Unsatisfiable};
        let (tenant, tp) = identify(policy, a)?;
        if let (Some(plan), false, true) =
            (&a.plan, policy.tenants.contains_key(tenant), policy.server.plan_header.is_some())
        {
            self.claims.note(tenant, plan);
        }
        if let Some(k) = &a.idempotency {
            names::check_idempotency_key(&k.key)
                .map_err(|e| Denial::now(InvalidRequest, format!("idempotency-key {e}")))?;
        }
        let asked = a.model.as_deref().ok_or_else(|| Denial::now(InvalidRequest, "the request names no model"))?;
        let (model_name, model) = policy
            .model(asked)
            .ok_or_else(|| Denial::now(InvalidRequest, format!("model {asked:?} is not served here")))?;
        if let Some(n) = a.max_tokens.filter(|_| !a.input_only)
            && (n == 0 || n > model.max_output_tokens)
        {
            return Err(Denial::now(
                InvalidRequest,
                format!("max_tokens {n} is outside 1..={} for model {model_name}", model.max_output_tokens),
            ));
        }

        let bytes_per_token = if model.learn_bytes_per_token {
            self.fleet.bytes_per_token(tenant, model_name, model.bytes_per_token)
        } else {
            model.bytes_per_token
        };
        let prompt = bounded_prompt(a.prompt, model, bytes_per_token)?;
        let ceiling = if a.input_only {
            0
        } else {
            estimate::output_reservation(a.max_tokens, model).saturating_mul(a.outputs.max(1)).min(MAX_TOKEN_COUNT)
        };
        let hold = prompt.saturating_add(ceiling);
        // With a learned output the hold may be smaller than the ceiling; the script checks the
        // actual hold against every capacity. Here, only what can never fit.
        let smallest = if tp.adaptive_output.is_some() { prompt.saturating_add(1).min(hold) } else { hold };
        let scopes = scopes(tenant, a.user.as_deref(), model_name, tp);
        let price = model.price.unwrap_or_default();
        let cheapest = cost_of(price, prompt, smallest.saturating_sub(prompt));
        // (In shadow the script holds it anyway, and says it would have been unsatisfiable.)
        for s in scopes.iter().filter(|_| !tp.shadow) {
            if let Some(largest) = s.largest
                && smallest > largest
            {
                return Err(Denial::now(
                    Unsatisfiable,
                    format!("request needs {hold} tokens but scope {} can never hold more than {largest}", s.label),
                ));
            }
            let dearest = s.limits.tightest_cost();
            if let Some(budget) = dearest
                && cheapest > budget
            {
                return Err(Denial::now(
                    Unsatisfiable,
                    format!("request may cost {} but scope {}'s budget is {}", Money(cheapest), s.label, Money(budget)),
                ));
            }
        }
        let tier = a.priority.unwrap_or(tp.default_priority).min(tp.max_priority);
        let tier = if tp.acts_on_soft() { self.soft_tier(tenant, tier) } else { tier };
        let pool = match policy.pool_of(model) {
            Some((name, pool)) => {
                let speeds = self.fleet.speeds(name, model_name, pool, self.clock.now_ms());
                // The pool holds the output this tenant's requests to the model have on average
                // (a queue drains on averages), and judges the request's own deadline by a long
                // one; until this replica has seen enough of them, the learned estimate (the
                // tenant's quantile) or the ceiling, for both. Never above the ceiling.
                let learned = self.fleet.output(tenant, model_name).filter(|_| pool.calibrate);
                let (output, long) = match learned {
                    // (A heavy tail can put the quantile below the mean: never judge by less.)
                    Some((mean, long)) => (mean.min(ceiling), long.max(mean).min(ceiling)),
                    None => {
                        let held = match tp.adaptive_output {
                            Some(_) => self.seen_estimate(tenant, model_name).map_or(ceiling, |o| o.min(ceiling)),
                            None => ceiling,
                        };
                        (held, held)
                    }
                };
                let leg = PoolLeg {
                    name: name.to_string(),
                    pool: Arc::clone(pool),
                    tier,
                    work_ms: speeds.service_ms(prompt, output),
                    finish_ms: speeds.service_ms(prompt, long),
                    output_tokens: output,
                    kv_tokens: prompt.saturating_add(output),
                };
                if let Some(kv) = pool.kv_cache_tokens
                    && smallest > kv
                {
                    return Err(Denial::now(
                        Unsatisfiable,
                        format!("request needs {hold} KV-cache tokens but pool {name} has {kv}"),
                    ));
                }
                Some(leg)
            }
            None => None,
        };
        // (Leasing decides tokens and money per UTC day and month from slices; a budget of another
        // period or zone, or a limit on one side, is decided at the store.)
        let leased = self.leases.is_some()
            && !tp.strict
            && !tp.shadow
            && a.idempotency.is_none()
            && tp.adaptive_output.is_none()
            && tp.zone.is_utc()
            && scopes.iter().all(|s| s.limits.leasable());
        let pool_name = pool.as_ref().map(|leg| leg.name.as_str());
        let id = match (&self.leases, leased) {
            (Some(leases), true) => ids::new_leased_reservation_id(tenant, pool_name, &leases.replica),
            _ => ids::new_reservation_id(tenant, pool_name),
        }
        .map_err(|e| {
            tracing::error!(error = %e, "cannot make a reservation id");
            Denial::now(Reason::StoreUnavailable, "no reservation id could be made")
        })?;
        // The request a key stands for: a key reused for another user, model or size is refused.
        let idempotency = a
            .idempotency
            .clone()
            .map(|k| (k, format!("{} {model_name} {prompt} {ceiling}", a.user.as_deref().unwrap_or(""))));
        Ok(Plan {
            policy: Arc::clone(policy),
            id,
            tenant: tenant.to_string(),
            tp: Arc::clone(tp),
            model: model_name.to_string(),
            prompt,
            ceiling,
            // (Only a limit the request itself named: without one, its backend's own default
            // applies, which the policy's ceiling does not bound.)
            output_ceiling: a.max_tokens.filter(|_| !a.input_only).map(|_| ceiling),
            scopes,
            pool,
            deadline_ms: a.deadline_ms.or(tp.default_deadline_ms),
            wait_ms: a.wait_ms,
            idempotency,
            leased,
            user: a.user.clone(),
            tier,
            price,
            token_weights: model.token_weights,
        })
    }
}

/// Prompt tokens to hold (a body's at `bytes_per_token`), or a refusal when a count or size is
/// past what tollgate accepts.
pub(super) fn bounded_prompt(
    size: PromptSize,
    model: &crate::config::ModelPolicy,
    bytes_per_token: f64,
) -> Result<u64, Denial> {
    let too_large = |what: &str, value: u64, max: u64| {
        Denial::now(Reason::InvalidRequest, format!("{what} {value} is above the maximum of {max}"))
    };
    match size {
        PromptSize::Tokens(n) if n > MAX_TOKEN_COUNT => return Err(too_large("prompt tokens", n, MAX_TOKEN_COUNT)),
        PromptSize::Bytes(b) if b > MAX_PROMPT_BYTES => return Err(too_large("body size", b, MAX_PROMPT_BYTES)),
        _ => {}
    }
    let tokens = estimate::prompt_tokens(size, model, bytes_per_token);
    if tokens > MAX_TOKEN_COUNT {
        return Err(too_large("estimated prompt tokens", tokens, MAX_TOKEN_COUNT));
    }
    Ok(tokens)
}

/// The capacity leg of a request whose model is served by a pool.
pub(super) struct PoolLeg {
    pub(super) name: String,
    pub(super) pool: Arc<PoolPolicy>,
    pub(super) tier: Priority,
    /// Predicted slot time (ms): the work the pool holds.
    pub(super) work_ms: u64,
    /// Predicted slot time should it run long (ms): what its deadline is judged by.
    pub(super) finish_ms: u64,
    /// The output its work was predicted for.
    pub(super) output_tokens: u64,
    /// KV-cache tokens it holds: the prompt and the output it is expected to produce.
    pub(super) kv_tokens: u64,
}

/// What one reserve will hold, where: owned, because the legs run on a task of their own.
pub(super) struct Plan {
    /// The policy this decision plans from: one snapshot, carried to its end (a reload swaps the
    /// policy whole, never halfway through a decision).
    pub(super) policy: Arc<Policy>,
    pub(super) id: String,
    pub(super) tenant: String,
    pub(super) tp: Arc<TenantPolicy>,
    pub(super) model: String,
    pub(super) prompt: u64,
    /// The output held when no estimate applies.
    pub(super) ceiling: u64,
    /// The most output the request itself allows (its `max_tokens`, times its outputs), when it
    /// named a limit tollgate read: its backend stops there, so a metered count is held to it.
    pub(super) output_ceiling: Option<u64>,
    pub(super) scopes: Vec<Scope>,
    pub(super) pool: Option<PoolLeg>,
    pub(super) deadline_ms: Option<u64>,
    /// How long the caller lets admission wait for a slot (`Attributes::wait_ms`).
    pub(super) wait_ms: Option<u64>,
    /// The key, and the fingerprint of the request it stands for.
    pub(super) idempotency: Option<(IdempotencyKey, String)>,
    /// Decided from this replica's slices (the policy leases, the tenant is not strict, and the
    /// request needs nothing only the store has: an idempotency key, a learned estimate).
    pub(super) leased: bool,
    /// Who the hold is for, as the ledger enters it.
    pub(super) user: Option<String>,
    pub(super) tier: Priority,
    /// The model's price: the hold charges its cost.
    pub(super) price: Price,
    /// What the model's cached prompt tokens count, for the commit.
    pub(super) token_weights: TokenWeights,
}

impl Plan {
    pub(super) fn ask(&self) -> Ask<'_> {
        Ask {
            id: &self.id,
            model: &self.model,
            scopes: self.scopes.iter().map(|s| AskScope { key: &s.key, of: &s.of }).collect(),
            hold: self.prompt.saturating_add(self.ceiling),
            prompt: self.prompt,
            user: self.user.as_deref(),
            tier: self.tier.as_str(),
            price: self.price,
            token_weights: self.token_weights,
        }
    }
}

/// One scope a request charges.
pub(super) struct Scope {
    /// For messages: `tenant`, `user alice`, `model gpt-4o`.
    pub(super) label: String,
    pub(super) key: String,
    pub(super) of: ScopeOf,
    pub(super) limits: ScopeLimits,
    pub(super) largest: Option<u64>,
}

/// Which of a tenant's limits a scope keeps: what a reload looks up again for the scope's slices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum ScopeOf {
    Tenant,
    User(String),
    Model(String),
}

impl ScopeOf {
    /// The scope's limits under `tp`; `None` if it no longer limits the scope.
    pub(super) fn limits<'p>(&self, tp: &'p TenantPolicy) -> Option<&'p Limits> {
        match self {
            ScopeOf::Tenant => Some(&tp.limits),
            ScopeOf::User(user) => tp.user_limits(user),
            ScopeOf::Model(model) => tp.models.get(model),
        }
    }
}

/// The scopes a request charges: the tenant, then its user and model where the policy limits them.
pub(super) fn scopes(tenant: &str, user: Option<&str>, model: &str, tp: &TenantPolicy) -> Vec<Scope> {
    let scope = |label: String, key: String, of: ScopeOf, limits: &Limits| Scope {
        label,
        key,
        of,
        limits: ScopeLimits::from(limits),
        largest: limits.largest_admissible(),
    };
    let mut tenant_scope = scope("tenant".into(), keys::tenant_scope(tenant), ScopeOf::Tenant, &tp.limits);
    tenant_scope.limits.soft = tp.soft;
    let mut out = vec![tenant_scope];
    if let Some(user) = user
        && let Some(limits) = tp.user_limits(user)
    {
        let of = ScopeOf::User(user.to_string());
        out.push(scope(format!("user {user}"), keys::user_scope(tenant, user), of, limits));
    }
    if let Some(limits) = tp.models.get(model) {
        let of = ScopeOf::Model(model.to_string());
        out.push(scope(format!("model {model}"), keys::model_scope(tenant, model), of, limits));
    }
    out
}

/// What tokens cost at a price, in nanos (saturating: far beyond any budget either way).
pub(super) fn cost_of(price: Price, prompt: u64, output: u64) -> u64 {
    prompt.saturating_mul(price.input_nanos).saturating_add(output.saturating_mul(price.output_nanos))
}
