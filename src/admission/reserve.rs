//! The reserve phase: the pool leg, then the tenant leg (or a decision from the slices), then
//! tidying up.
//!
//! # Two key spaces
//!
//! A tenant's keys share the tenant's hash tag; a backend pool is shared by every tenant, so its
//! keys carry the pool's tag and, on a Redis Cluster, may live on another node. No one script can
//! touch both, so a reserve runs two legs, in this order:
//!
//! 1. **Pool leg** (`pool_reserve.lua`): refuse with `deadline` or `queue_full`, or hold the
//!    request's predicted work in the pool under the new reservation id.
//! 2. **Tenant leg** (`reserve.lua`): refuse on quota, or hold the tokens.
//! 3. If the tenant leg did not hold this id (refused, failed, or returned an earlier hold for the
//!    same idempotency key), **release the pool leg** (`pool_release.lua`).
//!
//! So a tenant is never charged for a request the pool refuses, and pool capacity held for a
//! request the tenant refused is given back at once. A leg whose store call failed may still have
//! run (the reply, not the call, may be what was lost), so it is released too. If the process dies
//! between 1 and 3, the pool hold's lease (the tenant's lease TTL) reclaims it. Commit and Release
//! settle the tenant leg first, then release the pool leg by id; pool release is idempotent, so a
//! repeated commit (which retries a pool release the first could not make), a hold already swept,
//! or a retry after a crash between the two changes nothing. Renew extends the pool lease only
//! after the tenant hold was renewed.
//!
//! # Nobody waiting
//!
//! A caller may give up while the legs run (Envoy's ext_authz timeout, a gRPC deadline): tonic then
//! drops the call's future. The legs therefore run on a task of their own, to completion, and hand
//! their decision over a channel; a hold whose decision nobody received is released at once, since
//! the request it was for will never reach the backend.

// Token arithmetic: no unchecked +, -, * (see Cargo.toml's [lints] for the casts).
#![warn(clippy::arithmetic_side_effects)]

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::oneshot;

use super::denials::{self, refusal_reason, scope_refusal, store_unavailable};
use super::lease::Local;
use super::log::{self, StoreMode};
use super::plan::{Plan, PoolLeg, cost_of};
use super::retry::Settlement;
use super::{
    Admission, AdmissionError, Admitted, Attributes, Decision, Denial, Forecast, KeyRepeat, Priority, Reason,
    Unmetered, ids,
};
use crate::config::Policy;
use crate::hold::{Counted, Ending, Refusal, ReleaseOutcome, ReserveOutcome, ScopeLimits, Settled};
use crate::metrics::{Decided, Outcome};
use crate::store::{
    CommitTerms, KeyCall, PoolCall, PoolEnd, PoolOutcome, ProviderCall, ReserveCall, ReserveReply, Store, StoreError,
};

/// How long a request's place in a pool's queue lives without its next call: well past the
/// longest pause between calls and a store call's timeout, so only a replica that died loses it.
const WAITER_TTL_MS: u64 = 1_000;
/// The pause between a waiting request's calls: a quarter of its predicted start, within these.
const POLL_MIN_MS: u64 = 5;
const POLL_MAX_MS: u64 = 50;

impl<S: Store> Admission<S> {
    /// The reserve phase. The legs run to completion even if the caller stops waiting, and a hold
    /// whose decision nobody received is released (see the module's "Nobody waiting").
    pub async fn reserve(self: &Arc<Self>, a: &Attributes) -> Decision {
        let start = std::time::Instant::now();
        let policy = self.policy();
        let (decision, waited, store) = self.decide(&policy, a).await;
        let took = start.elapsed();
        self.record(&policy, a, &decision, took, waited);
        log::decision(&policy, a, &decision, store, took);
        decision
    }

    /// A request that costs nothing (a token count): admitted without a hold once it is known
    /// whose it is.
    pub fn pass_free(&self, a: &Attributes) -> Decision {
        let start = std::time::Instant::now();
        let policy = self.policy();
        let decision = match super::plan::identify(&policy, a) {
            Ok(_) => Decision::Unmetered(Unmetered::Free),
            Err(denial) => Decision::Denied(denial),
        };
        let took = start.elapsed();
        self.record(&policy, a, &decision, took, Duration::ZERO);
        log::decision(&policy, a, &decision, StoreMode::NotNeeded, took);
        decision
    }

    /// Counts a decision, under labels drawn from bounded sets: the tenant's label, a model the
    /// policy serves (any other name a client sent is `other`), the tier, the reason. `took`: from
    /// the call's arrival to its answer; `waited`: the part of it spent waiting for a pool's slot.
    pub(super) fn record(
        &self,
        policy: &Policy,
        a: &Attributes,
        decision: &Decision,
        took: Duration,
        waited: Duration,
    ) {
        if !self.metrics.enabled() {
            return;
        }
        let tenant = a.tenant.as_deref().or(policy.anonymous_tenant.as_deref()).unwrap_or("");
        let tp = self.tenant_policy(policy, tenant);
        let tier = match tp {
            Some(tp) => a.priority.unwrap_or(tp.default_priority).min(tp.max_priority),
            None => a.priority.unwrap_or(Priority::Standard),
        };
        let model = a.model.as_deref().map(|m| policy.model(m).map_or("other", |(name, _)| name));
        let (outcome, reason) = match decision {
            Decision::Admitted(admitted) => {
                if !admitted.replayed {
                    self.metrics.reserved(tenant, admitted.reserved_tokens);
                }
                match admitted.shadow {
                    Some(would) => (Outcome::Shadow, would.code()),
                    None => (Outcome::Admitted, "ok"),
                }
            }
            Decision::Unmetered(_) => (Outcome::Unmetered, "ok"),
            Decision::Denied(d) => (Outcome::Denied, d.reason.code()),
        };
        self.metrics.decided(&Decided { tenant, model, tier: tier.as_str(), outcome, reason, took, waited });
    }

    /// The decision, how long it waited for a pool's slot, and where it was made.
    pub(super) async fn decide(
        self: &Arc<Self>,
        policy: &Arc<Policy>,
        a: &Attributes,
    ) -> (Decision, Duration, StoreMode) {
        let plan = match self.plan(policy, a) {
            Ok(plan) => plan,
            Err(denial) => return (Decision::Denied(denial), Duration::ZERO, StoreMode::NotNeeded),
        };
        // A lease hit decides here, from memory: no store call, no task, nothing to cancel.
        if let (Some(leases), true, None) = (&self.leases, plan.leased, &plan.pool) {
            let t = leases.tenant(&plan.tenant, &plan.tp);
            match leases.try_admit(&t, &plan.ask()) {
                Local::Miss => {}
                local => return (self.leased_decision(&plan, local), Duration::ZERO, StoreMode::Lease),
            }
        }
        let (answer, decision) = oneshot::channel();
        let this = Arc::clone(self);
        self.tasks.spawn(async move {
            let (mut tidy, mut waited) = (Tidy::default(), Duration::ZERO);
            let decided = this.hold(&plan, &mut tidy, &mut waited, || answer.is_closed()).await;
            let sent = answer.send((decided, waited, tidy.store_mode(&plan)));
            // Answered first: tidying up never delays a decision (nor, on a dead store, adds a
            // second timeout to it). The hurry takes no store call: before the tidying, which may.
            if tidy.hurry_commits {
                this.hurry_commits(&plan.tenant);
            }
            this.tidy(&plan, tidy).await;
            if let Err((Decision::Admitted(undelivered), _, _)) = sent
                && !undelivered.replayed
            {
                tracing::debug!(reservation = %undelivered.reservation_id, "nobody received the hold; releasing it");
                this.give_back(&plan, &undelivered.reservation_id).await;
            }
        });
        decision.await.unwrap_or_else(|_| {
            let ended = Denial::now(Reason::StoreUnavailable, "the reserve task ended without a decision");
            (Decision::Denied(ended), Duration::ZERO, StoreMode::Store)
        })
    }

    /// Both legs. `gone` says whether the caller has stopped waiting for the answer (a request
    /// waiting for a slot then gives its place up); `waited` is set to how long it waited.
    pub(super) async fn hold(
        &self,
        plan: &Plan,
        tidy: &mut Tidy,
        waited: &mut Duration,
        gone: impl Fn() -> bool,
    ) -> Decision {
        let forecast = match &plan.pool {
            Some(leg) => match self.pool_leg(plan, leg, waited, gone).await {
                Ok(forecast) => Some(forecast),
                Err(denial) if denial.reason == Reason::StoreUnavailable => {
                    // The call may have run and only its reply been lost.
                    tidy.store_failed = true;
                    let decision = self.on_store_error(plan, denial);
                    tidy.pool_leg = Some(pool_leg_end(&decision));
                    return decision;
                }
                Err(denial) => return Decision::Denied(denial),
            },
            None => None,
        };
        let mut decision =
            if plan.leased { self.leased_leg(plan, tidy).await } else { self.tenant_leg(plan, tidy).await };
        if let Decision::Admitted(a) = &mut decision
            && a.reservation_id == plan.id
        {
            a.forecast = forecast;
        }
        let holds_this_id = matches!(&decision, Decision::Admitted(a) if a.reservation_id == plan.id);
        if let Some(leg) = &plan.pool
            && !holds_this_id
        {
            // The pool gives the work back before a refusal is answered, as the refusal says; after
            // a store failure it is tidied up later, so the answer does not wait on the store twice.
            if tidy.store_failed {
                tidy.pool_leg = Some(pool_leg_end(&decision));
            } else {
                self.release_pool_leg(&leg.name, &plan.id, PoolEnd::Unused).await;
            }
        }
        decision
    }

    /// What a decision left to tidy up, once it has been answered.
    pub(super) async fn tidy(&self, plan: &Plan, tidy: Tidy) {
        self.give_back_legs(plan, &plan.id, tidy.hold, tidy.pool_leg).await;
    }

    /// Gives back legs of a hold nobody will use, now or, when the store does not answer, through
    /// the retry queue until it does: a stalled store leaves no hold charged for its lease. Not
    /// retried for a reserve under an idempotency key that returns its live hold: the caller's
    /// own retry may be handed that hold meanwhile, and it must not be released under it (its
    /// lease reclaims it if nobody comes).
    async fn give_back_legs(&self, plan: &Plan, id: &str, tenant_leg: bool, pool_leg: Option<PoolEnd>) {
        if !(tenant_leg || pool_leg.is_some()) {
            return;
        }
        if let Err(e) = self.abandon(id, tenant_leg, pool_leg).await {
            let replayable = plan.idempotency.as_ref().is_some_and(|(k, _)| k.repeat == KeyRepeat::ReturnHold);
            if replayable && tenant_leg {
                tracing::warn!(error = %e, reservation = id, "giving back a hold nobody received failed; its key may hand it out again, so its lease will reclaim it");
                return;
            }
            tracing::warn!(error = %e, reservation = id, "giving back a hold nobody received failed; retrying");
            self.retry(Settlement::Abandon { id: id.to_string(), tenant_leg, pool_leg });
        }
    }

    /// Gives back what a reserve made under `id` and nobody received: the tenant leg in the store,
    /// the pool leg (settled as `pool_leg` says), or both. Safe to repeat.
    pub(super) async fn abandon(
        &self,
        id: &str,
        tenant_leg: bool,
        pool_leg: Option<PoolEnd>,
    ) -> Result<(), AdmissionError> {
        let r = super::parse_id(id)?;
        if tenant_leg {
            let policy = self.policy();
            let retention_ms = policy.record_retention_ms;
            let released = self.protocol.release_unanswered(r.tenant, id, retention_ms).await?;
            // Its lease ran out first (the store was out of reach that long) and charged it as
            // held: nothing used it, so it is reconciled to nothing, as a late commit would be.
            if released == ReleaseOutcome::Settled(Settled::Expired) {
                // (Nothing ran: nothing to teach the estimate.)
                let terms = CommitTerms { learning: None, ..self.commit_terms(&policy, r.tenant) };
                self.protocol.commit(r.tenant, id, Counted::exact(0, 0), Ending::Released, terms).await?;
                // (The commit took its record away: the note a re-send of its reserve looks for.)
                self.protocol.release_unanswered(r.tenant, id, retention_ms).await?;
            }
        }
        if let (Some(end), Some(pool)) = (pool_leg, r.pool) {
            self.give_pool_leg_back(pool, id, end).await?;
        }
        Ok(())
    }

    /// Capacity: can the pool start and finish this request in time? Holds its work if so, and
    /// says what it predicted. A pool that queues in tollgate may answer "wait": the request then
    /// asks again, with the same id, when this replica gives a pool hold back or after a pause
    /// (a fraction of its predicted start), until it is admitted, refused, out of the time its
    /// caller gave it, or its caller is `gone`.
    pub(super) async fn pool_leg(
        &self,
        plan: &Plan,
        leg: &PoolLeg,
        waited: &mut Duration,
        gone: impl Fn() -> bool,
    ) -> Result<Forecast, Denial> {
        let pool = &leg.pool;
        let waiting_since = std::time::Instant::now();
        let may_wait = plan.wait_ms.unwrap_or(pool.max_queue_delay_ms).min(pool.max_queue_delay_ms);
        let mut call = PoolCall {
            pool: &leg.name,
            id: &plan.id,
            work_ms: leg.work_ms,
            finish_ms: leg.finish_ms,
            kv_tokens: leg.kv_tokens,
            lease_ms: plan.tp.lease_ttl_ms,
            idle_ttl_ms: pool.idle_ttl_ms,
            sweep_batch: plan.policy.sweep_batch,
            slots: pool.max_sequences,
            tier_slots: pool.slots_for(leg.tier),
            max_queue_delay_ms: pool.queue_delay_for(leg.tier),
            tier_kv_tokens: pool.kv_for(leg.tier),
            deadline_ms: plan.deadline_ms,
            recover_per_ms: pool.upstream_throttle.map_or(0.0, |t| t.recover_per_ms),
            tier: leg.tier,
            tenant: &plan.tenant,
            weight_milli: plan.tp.weight_milli,
            queue: pool.queue,
            wait_ms: may_wait,
            waiter_ttl_ms: WAITER_TTL_MS,
            provider: pool.provider.as_ref().map(|provider| {
                // The provider counts what it may generate (the request's ceiling, as providers
                // reckon a request's tokens at its start) until the commit says what it did.
                ProviderCall {
                    limits: ScopeLimits::from(&provider.limits),
                    tier_part: pool.share(leg.tier),
                    prompt_tokens: plan.prompt,
                    output_tokens: plan.ceiling,
                    cost_nanos: cost_of(plan.price, plan.prompt, plan.ceiling),
                    idle_ttl_ms: pool.provider_idle_ttl_ms(provider),
                }
            }),
        };
        let outcome = loop {
            let outcome = self.protocol.pool_reserve(&call).await;
            let Ok(PoolOutcome::Waiting { start_delay_ms }) = outcome else { break outcome };
            // A start predicted now that has not come waits on a hold past its predicted end (or
            // on KV): when it ends nobody can say, so the longest pause (a slot given back on
            // this replica wakes it at once).
            let pause = match start_delay_ms {
                0 => Duration::from_millis(POLL_MAX_MS),
                ms => Duration::from_millis((ms / 4).clamp(POLL_MIN_MS, POLL_MAX_MS)),
            };
            tokio::select! {
                () = self.pool_freed.notified() => {}
                () = tokio::time::sleep(pause) => {}
            }
            *waited = waiting_since.elapsed();
            if gone() {
                // Its place in the queue is given up now, not when the place's TTL runs out.
                self.release_pool_leg(&leg.name, &plan.id, PoolEnd::Unused).await;
                return Err(Denial::now(Reason::QueueFull, "the caller stopped waiting for a slot"));
            }
            let so_far = u64::try_from(waited.as_millis()).unwrap_or(u64::MAX);
            call.wait_ms = may_wait.saturating_sub(so_far);
            // The deadline runs while the request waits.
            call.deadline_ms = plan.deadline_ms.map(|d| d.saturating_sub(so_far).max(1));
        };
        match outcome {
            Ok(PoolOutcome::Admitted { start_delay_ms, .. }) => {
                Ok(Forecast { start_delay_ms, output_tokens: leg.output_tokens })
            }
            Ok(PoolOutcome::Waiting { start_delay_ms }) => {
                Err(denials::waited_out(start_delay_ms, leg, may_wait, plan))
            }
            Ok(PoolOutcome::Denied { reason, retry, start_delay_ms }) => {
                Err(denials::refused(reason, retry, start_delay_ms, leg, plan))
            }
            Err(e) => Err(store_unavailable(&e, plan)),
        }
    }

    /// Quota: every scope of the tenant must pass.
    pub(super) async fn tenant_leg(&self, plan: &Plan, tidy: &mut Tidy) -> Decision {
        let policy = &plan.policy;
        let now_ms = self.clock.now_ms();
        let zone_offset_min = plan.tp.zone.offset_minutes_at(now_ms);
        // A wait the script counted to a period's turn at today's offset, moved by a clock change
        // between now and then (a budget's Retry-After, a soft budget's demotion).
        let to_turn = |wait_ms| plan.tp.zone.wait_to_turn(zone_offset_min, now_ms, wait_ms);
        let call = ReserveCall {
            tenant: &plan.tenant,
            model: &plan.model,
            id: &plan.id,
            prompt_tokens: plan.prompt,
            output_ceiling: plan.ceiling,
            // Nothing to learn from a request that generates nothing (embeddings).
            adaptive: plan.tp.adaptive_output.filter(|_| plan.ceiling > 0).map(|a| (a.min_samples, a.quantile)),
            lease_ms: plan.tp.lease_ttl_ms,
            idle_ttl_ms: plan.tp.idle_ttl_ms,
            retention_ms: policy.record_retention_ms,
            // A generation that outruns its lease by as much again still commits late.
            late_commit_ms: plan.tp.lease_ttl_ms.max(policy.record_retention_ms),
            expired_usage: plan.tp.expired_usage,
            sweep_batch: policy.sweep_batch,
            idempotency: plan.idempotency.as_ref().map(|(k, fingerprint)| KeyCall {
                key: &k.key,
                repeat: k.repeat,
                fingerprint,
            }),
            max_attempts: policy.max_attempts,
            concurrency_retry_cap_ms: policy.concurrency_retry_ms,
            scopes: plan.scopes.iter().map(|s| (s.key.clone(), s.limits)).collect(),
            shadow: plan.tp.shadow,
            user: plan.user.as_deref(),
            tier: plan.tier,
            ledger: policy.ledger.as_ref().map(|l| l.terms),
            price: plan.price,
            token_weights: plan.token_weights,
            zone_offset_min,
            compact_record: self.writes_compact_records(),
        };
        let mut may_ask_again = true;
        let outcome = loop {
            match self.protocol.reserve(&call).await {
                Ok(ReserveReply { outcome, swept, budget_left }) => {
                    self.saw_budgets(plan, &budget_left);
                    self.release_swept_pool_legs(&swept).await;
                    // How short of slots the tenant is decides how long its commits wait here (a
                    // shadowed tenant's go at once).
                    if policy.commit_window().is_some() && !plan.tp.shadow {
                        match &outcome {
                            ReserveOutcome::Admitted { slots_left, .. } => {
                                tidy.hurry_commits = self.batches.short.saw(&plan.tenant, *slots_left);
                            }
                            ReserveOutcome::Denied { reason: Refusal::Concurrency, .. } => {
                                tidy.hurry_commits = self.batches.short.saw(&plan.tenant, Some(0));
                            }
                            ReserveOutcome::Denied { .. } => {}
                        }
                    }
                    // Commits of this tenant waiting in this replica's window still hold their
                    // slots: a refusal for a slot sends them at once and, once the store has taken
                    // them, asks once more (a refusal changed nothing), so that a client sending
                    // one request at a time is not refused for its own last one. (Not a refusal on
                    // tokens or a budget: a waiting commit gives back only what its hold held beyond
                    // its use, and under overload asking again would cost a reserve a window.)
                    if let ReserveOutcome::Denied { reason: Refusal::Concurrency, .. } = &outcome
                        && std::mem::take(&mut may_ask_again)
                        && self.commit_waiting(&plan.tenant).await
                    {
                        continue;
                    }
                    break Ok(outcome);
                }
                Err(e) => break Err(e),
            }
        };
        match outcome {
            Ok(ReserveOutcome::Admitted {
                id,
                held,
                attempts,
                headroom,
                estimated_output,
                replayed,
                shadowed,
                soft,
                slots_left: _,
            }) => {
                // (Only a tenant whose soft budgets act is demoted: no other takes the lock.) The
                // demotion lasts until the period turns.
                let acts_on_soft = plan.tp.acts_on_soft();
                let soft = soft.filter(|_| acts_on_soft).map(|(budget, ends_in_ms)| (budget, to_turn(ends_in_ms)));
                if acts_on_soft {
                    self.remember_soft(&plan.tenant, soft.map(|(_, ends_in_ms)| ends_in_ms));
                }
                self.note_tenant(&plan.tenant, plan.tp.lease_ttl_ms);
                if let Some(output) = estimated_output
                    && plan.pool.is_some()
                {
                    self.remember_estimate(&plan.tenant, &plan.model, output);
                }
                // In shadow, what the limits would have said, as the reason a denial would carry.
                let shadow = shadowed.map(|w| {
                    let scope = plan.scopes.get(w.scope).map_or("?", |s| s.label.as_str());
                    refusal_reason(w.reason, scope, policy.max_attempts).0
                });
                Decision::Admitted(Admitted {
                    reservation_id: id,
                    model: plan.model.clone(),
                    reserved_tokens: held,
                    attempts,
                    replayed,
                    headroom,
                    shadow,
                    soft_limit: soft.map(|(budget, _)| budget),
                    tier: plan.tier,
                    forecast: None,
                    output_ceiling: plan.output_ceiling,
                })
            }
            Ok(ReserveOutcome::Denied { reason, scope, retry_after_ms, headroom }) => {
                let retry_after_ms = match reason {
                    Refusal::Budget(_) => to_turn(retry_after_ms),
                    _ => retry_after_ms,
                };
                let scope = plan.scopes.get(scope).map_or("?", |s| s.label.as_str());
                let (reason, message) = scope_refusal(reason, scope, policy, retry_after_ms, retry_after_ms);
                let retry_after_ms = reason.retryable().then_some(retry_after_ms);
                Decision::Denied(Denial { reason, message, retry_after_ms, headroom })
            }
            Err(e) => {
                // The script may have run and only its reply been lost: give back what it may hold.
                tidy.hold = true;
                tidy.store_failed = true;
                self.on_store_error(plan, store_unavailable(&e, plan))
            }
        }
    }

    /// The tenant leg's sweep settled these expired holds; their pool legs live on other slots and
    /// are taken off here, so pool work leaves with its hold rather than with the pool's own sweep.
    pub(super) async fn release_swept_pool_legs(&self, swept: &[String]) {
        for id in swept {
            let Some(r) = ids::parse_reservation_id(id) else { continue };
            self.metrics.expired(r.tenant);
            if let Some(pool) = r.pool {
                self.release_pool_leg(pool, id, PoolEnd::AsHeld).await;
            }
        }
    }

    /// Releases a hold this call made but nobody received: both legs.
    pub(super) async fn give_back(&self, plan: &Plan, id: &str) {
        let in_store = match (&self.leases, plan.leased) {
            // A leased plan the slices could not cover after its lease call was decided in the
            // store (see `leased_leg`): the slices do not know the hold, the store has it.
            (Some(leases), true) => {
                matches!(leases.release(&plan.tenant, id, Ending::Released), ReleaseOutcome::NotFound)
            }
            _ => true,
        };
        self.give_back_legs(plan, id, in_store, plan.pool.is_some().then_some(PoolEnd::Unused)).await;
    }

    /// Gives a pool leg back. A failure is logged, not returned: the pool hold's lease reclaims it.
    pub(super) async fn release_pool_leg(&self, pool: &str, id: &str, end: PoolEnd) {
        if let Err(e) = self.give_pool_leg_back(pool, id, end).await {
            tracing::warn!(error = %e, pool, reservation = id, "pool release failed; its lease will reclaim it");
        }
    }

    /// Takes a pool leg (or its place in the pool's queue) off the pool, settling its provider
    /// charge by `end`, and wakes this replica's requests waiting for a slot.
    async fn give_pool_leg_back(&self, pool: &str, id: &str, end: PoolEnd) -> Result<(), StoreError> {
        self.protocol.pool_release(pool, id, end).await?;
        self.pool_freed.notify_waiters();
        Ok(())
    }
}

/// How a pool leg left to tidy after a store failure ended, by the decision: a request admitted
/// without a hold (the tenant's `on_store_error` let it through) reaches the backend all the same,
/// so its provider charge stays as held; any other never reached it.
fn pool_leg_end(decision: &Decision) -> PoolEnd {
    if matches!(decision, Decision::Unmetered(_)) { PoolEnd::AsHeld } else { PoolEnd::Unused }
}

/// What a decision leaves to do once it is answered: the store calls a store failure left behind
/// (a decision waits on a failing store once, never twice), and the hurry of its tenant's waiting
/// commits.
#[derive(Debug, Default)]
pub(super) struct Tidy {
    /// A store call failed: the tenant's `on_store_error` decided.
    pub(super) store_failed: bool,
    /// This replica's slices decided without a store call of the request's own (after waiting,
    /// perhaps, for another request's lease call).
    pub(super) from_lease: bool,
    /// Release the tenant leg's hold: its reserve failed, and may have run all the same.
    pub(super) hold: bool,
    /// Release the pool leg's hold (and settle its provider charge so): its call failed, or the
    /// tenant leg's did.
    pub(super) pool_leg: Option<PoolEnd>,
    /// The tenant has just become short of slots: hurry its commits waiting here.
    pub(super) hurry_commits: bool,
}

impl Tidy {
    /// Where the decision was made, as its log line says it.
    fn store_mode(&self, plan: &Plan) -> StoreMode {
        match (self.store_failed, self.from_lease) {
            (true, _) => StoreMode::Unreachable(plan.tp.on_store_error),
            (false, true) => StoreMode::Lease,
            (false, false) => StoreMode::Store,
        }
    }
}
