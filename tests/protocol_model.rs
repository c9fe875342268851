//! The protocol against its reference model (`support/model.rs`), on random sequences: reserves
//! over two tenants, their users and two models (one served by a pool), with random sizes,
//! priorities, deadlines and idempotency keys in both modes; commits that under- and overrun;
//! releases, renews, repeated and late commits; scripts run twice (a client re-sending after a
//! lost reply); calls whose reply is lost or that never arrive, through a replica behind a circuit
//! breaker that opens (a reserve nobody received is given back, at once or through the retry
//! queue; a settlement sent again counts once); budgets of input and output tokens apart, of
//! hours and weeks, buckets of one side, money by the hour, the day, the week and the month, one
//! tenant's periods twelve hours ahead of UTC and the other's five hours behind, with a soft
//! budget (its admissions marked, its next pooled requests demoted by each replica that heard);
//! clock jumps past leases and refills, across an hour's, a day's, a week's and a month's turn in
//! each tenant's zone; tenants gone quiet past every key's TTL (their holds swept, every key
//! expired, the next reserve afresh); reloads that tighten and loosen a tenant's limits and
//! shorten its lease mid-sequence (holds made before keep their terms). After every step the
//! store's reply must equal the model's, and the store's counters the model's: every scope's holds
//! in flight, token, request and side levels and every period's counters, the pool's holds and
//! work. At the end every live hold is released, or (half the cases) left abandoned, its tenant
//! quiet, until the background sweeper settles it after its lease; then every slot and every unit
//! of pool work must be back; and the usage ledger must hold every hold made, each once (or
//! expired, then late-committed), its entries charging together exactly the day usage the
//! counters charged (on the embedded store, its ledger file too).
//!
//! A thousand cases a run on the embedded store with its manual clock, where every number must
//! agree exactly. A shorter run on Redis and on the Cluster, whose clock is the server's own:
//! there the policy refills slowly and leases are long, time does not jump, and only what real
//! time cannot move is compared exactly. A failing case shrinks to a minimal sequence; proptest
//! keeps it in `tests/protocol_model.proptest-regressions` and replays it first on every later
//! run.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use proptest::prelude::*;
use support::faults::{Fault, Queued, Resend};
use support::model::{self, Ask, Model, NEW_ID, TenantRules};
use support::{Backend, Harness};
use tokio_util::sync::CancellationToken;
use tollgate::admission::{Attributes, Decision, Denial, IdempotencyKey, KeyRepeat, Priority, Reason};
use tollgate::config::Policy;
use tollgate::estimate::PromptSize;
use tollgate::hold::{Counted, Ending};
use tollgate::hold::{Headroom, Period};
use tollgate::store::breaker::{Breaker, BreakerSettings};
use tollgate::store::clock::ManualClock;
use tollgate::store::embedded::EmbeddedStore;
use tollgate::store::redis::{RedisOptions, RedisStore, RedisTarget};
use tollgate::store::{CommitCall, Store, keys};

/// One step of a sequence.
#[derive(Debug, Clone)]
enum Op {
    Reserve {
        tenant: usize,
        user: Option<usize>,
        pooled: bool,
        prompt: u64,
        max_tokens: u64,
        priority: usize,
        deadline_ms: Option<u64>,
        key: Option<(usize, bool)>,
        twice: bool,
    },
    /// Commits the `hold`-th id issued so far (modulo), with usage around its hold.
    Commit {
        hold: usize,
        prompt: u64,
        output: u64,
        twice: bool,
    },
    Release {
        hold: usize,
        twice: bool,
    },
    Renew {
        hold: usize,
        twice: bool,
    },
    /// Commits the ids picked as `Commit` does, those of the first one's tenant, together in one
    /// call (`Admission::commit_together`, as a batch of commits from responses goes): each must
    /// be answered, and charge, as if committed alone in turn.
    CommitTogether {
        commits: Vec<(usize, u64, u64)>,
    },
    /// Commits an id no reserve issued.
    CommitUnknown,
    /// Reloads the policy: tenant a's burst down from 2,000 to 1,200 and its lease from 1,000 ms
    /// to 600 (`tight`), or back.
    Reload {
        tight: bool,
    },
    Advance {
        ms: u64,
    },
    /// The tenants go quiet for longer than any key of theirs lives: their live holds expire and
    /// the background sweeper settles them, then every scope, record, key and pool hash runs out
    /// of its TTL (33 days: a month's counters live 32), and the next reserve starts afresh.
    Idle,
    /// A reserve, commit, release or renewal whose store call fails: it runs and its reply is
    /// lost (a timeout), or it never reaches the store; or (`Lost::Outage`) its reply is lost and
    /// the call giving back what it may have held fails too, opening the breaker, so the give-back
    /// waits in the retry queue.
    Faulted {
        op: Box<Op>,
        lost: Lost,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lost {
    Reply,
    Call,
    Outage,
}

fn op() -> impl Strategy<Value = Op> {
    let lost = prop_oneof![4 => Just(Lost::Reply), 4 => Just(Lost::Call), 1 => Just(Lost::Outage)];
    prop_oneof![
        12 => plain_op(),
        1 => (plain_op(), lost).prop_map(|(op, lost)| Op::Faulted { op: Box::new(op), lost }),
    ]
}

fn plain_op() -> impl Strategy<Value = Op> {
    let reserve =
        (
            0..2usize,
            prop::option::weighted(0.6, 0..2usize),
            any::<bool>(),
            0..300u64,
            1..=400u64,
            0..3usize,
            prop::option::weighted(0.2, 1..6000u64),
            prop::option::weighted(0.4, (0..3usize, any::<bool>())),
            prop::bool::weighted(0.15),
        )
            .prop_map(|(tenant, user, pooled, prompt, max_tokens, priority, deadline_ms, key, twice)| {
                Op::Reserve { tenant, user, pooled, prompt, max_tokens, priority, deadline_ms, key, twice }
            });
    prop_oneof![
        5 => reserve,
        3 => (any::<usize>(), 0..400u64, 0..900u64, prop::bool::weighted(0.15))
            .prop_map(|(hold, prompt, output, twice)| Op::Commit { hold, prompt, output, twice }),
        1 => (any::<usize>(), prop::bool::weighted(0.15)).prop_map(|(hold, twice)| Op::Release { hold, twice }),
        1 => (any::<usize>(), prop::bool::weighted(0.15)).prop_map(|(hold, twice)| Op::Renew { hold, twice }),
        1 => Just(Op::CommitUnknown),
        1 => prop::collection::vec((any::<usize>(), 0..400u64, 0..900u64), 1..5)
            .prop_map(|commits| Op::CommitTogether { commits }),
        1 => any::<bool>().prop_map(|tight| Op::Reload { tight }),
        2 => prop_oneof![3 => 0..400u64, 1 => 900..2600u64].prop_map(|ms| Op::Advance { ms }),
        1 => prop::bool::weighted(0.1).prop_map(|idle| if idle { Op::Idle } else { Op::Advance { ms: 0 } }),
    ]
}

/// Store time covered by the advances of one case at most: well inside every key's idle TTL (a
/// minute for the pool), so no key expires under the model but by an [`Op::Idle`].
const CASE_TIME_LIMIT_MS: u64 = 45_000;

/// How long an [`Op::Idle`] lasts: past every key's TTL (a month's counters live 32 days, and a
/// scope hash up to a sixteenth more: see `lasting` in lua/common.lua). A case idles three times at
/// most, well inside the ledger's retention (a year).
const IDLE_MS: u64 = 35 * model::DAY_MS;
const MOST_IDLES: usize = 3;

/// The policy: exact (embedded, manual clock) or real-time (Redis: slow refill, long leases).
fn policy(
    tenants: &[String; 2],
    pool: &str,
    store: &str,
    exact: bool,
    ledger_file: Option<&Path>,
    tight: bool,
) -> String {
    let (a, b) = (&tenants[0], &tenants[1]);
    let a_lease = if tight && exact { "    lease_ttl_ms: 600\n" } else { "" };
    let (defaults, a_limits, a_user, b_limits, b_model) = if exact {
        (
            "lease_ttl_ms: 1000\n  concurrency_retry_ms: 800\n  sweep_batch: 2\n  max_attempts: 3\n  record_retention_ms: 5000\n  on_store_error: fail_closed",
            if tight {
                "{ tokens_per_minute: 60000, burst_tokens: 1200, requests_per_minute: 600, max_concurrency: 4, cost_per_day: 0.006, output_tokens_per_day: 3000 }"
            } else {
                "{ tokens_per_minute: 60000, burst_tokens: 2000, requests_per_minute: 600, max_concurrency: 4, cost_per_day: 0.006, output_tokens_per_day: 4000 }"
            },
            "{ tokens_per_minute: 30000, burst_tokens: 1000, max_concurrency: 2, cost_per_month: 0.003, cost_per_hour: 0.002, input_tokens_per_minute: 600, input_tokens_per_hour: 3000 }",
            "{ tokens_per_minute: 6000, burst_tokens: 1500, tokens_per_day: 3000, tokens_per_month: 20000, tokens_per_hour: 2500, output_tokens_per_week: 5000, cost_per_week: 0.006 }",
            "{ tokens_per_minute: 3000, burst_tokens: 800, tokens_per_month: 1500, output_tokens_per_minute: 900, input_tokens_per_month: 1200 }",
        )
    } else {
        (
            "lease_ttl_ms: 600000\n  concurrency_retry_ms: 800\n  sweep_batch: 2\n  max_attempts: 3\n  on_store_error: fail_closed",
            if tight {
                "{ tokens_per_minute: 2, burst_tokens: 1200, max_concurrency: 4, cost_per_day: 0.006, output_tokens_per_day: 3000 }"
            } else {
                "{ tokens_per_minute: 2, burst_tokens: 2000, max_concurrency: 4, cost_per_day: 0.006, output_tokens_per_day: 4000 }"
            },
            "{ tokens_per_minute: 1, burst_tokens: 1000, max_concurrency: 2, cost_per_month: 0.003, cost_per_hour: 0.002, input_tokens_per_hour: 3000 }",
            "{ tokens_per_minute: 2, burst_tokens: 1500, tokens_per_day: 3000, tokens_per_month: 20000, tokens_per_hour: 2500, output_tokens_per_week: 5000, cost_per_week: 0.006 }",
            "{ tokens_per_minute: 1, burst_tokens: 800, tokens_per_month: 1500, input_tokens_per_month: 1200 }",
        )
    };
    let file = ledger_file.map_or_else(String::new, |f| format!("  file: {}\n", f.display()));
    format!(
        "{store}\nledger:\n  max_len: 100000\n  retention_ms: 31622400000\n{file}defaults:\n  {defaults}\nmodels:\n  m: {{ max_output_tokens: 400, pool: {pool}, price: {{ input_per_million: 1, output_per_million: 4 }} }}\n  \
         n: {{ max_output_tokens: 400, price: {{ input_per_million: 0.5, output_per_million: 2.125 }} }}\n\
         pools:\n  {pool}: {{ max_sequences: 3, prefill_tokens_per_second: 1000, decode_tokens_per_second: 100, max_queue_delay_ms: 8000, calibrate: false }}\n\
         tenants:\n  {a}:\n    time_zone: '+12:00'\n{a_lease}    limits: {a_limits}\n    default_user: {a_user}\n  {b}:\n    time_zone: '-05:00'\n    expired_usage: refund\n    soft_limits: {{ tokens_per_day: 1500 }}\n    limits: {b_limits}\n    models: {{ n: {b_model} }}\n"
    )
}

fn model_of(policy: &Policy, tenants: &[String; 2], pool: &str) -> Model {
    let rules = tenants
        .iter()
        .map(|t| {
            let tp = &policy.tenants[t];
            (
                t.clone(),
                TenantRules {
                    lease_ms: tp.lease_ttl_ms,
                    expired_usage: tp.expired_usage,
                    zone_offset_min: i64::from(tp.zone.offset_minutes_at(0)),
                    tenant: model::Limits { soft: tp.soft, ..model::Limits::from(&tp.limits) },
                    user: tp.default_user.as_ref().map(model::Limits::from),
                    model_n: tp.models.get("n").map(model::Limits::from),
                },
            )
        })
        .collect::<BTreeMap<_, _>>();
    let mut model = Model::new(
        rules,
        pool.to_string(),
        (*policy.pools[pool]).clone(),
        policy.sweep_batch as usize,
        policy.max_attempts,
        policy.record_retention_ms,
        policy.concurrency_retry_ms,
    );
    for (name, m) in &policy.models {
        if let Some(p) = m.price {
            model.prices.insert(name.clone(), (p.input_nanos, p.output_nanos));
        }
    }
    model
}

/// One case's world: the store, the model, and a clock both read.
struct World<S> {
    h: Harness<S>,
    twice: Harness<Resend<S>>,
    /// A replica whose store calls fail when the test says, behind a breaker that opens after two
    /// failures in a row, with its retry queue's worker running.
    lossy: Harness<Breaker<Queued<S>>>,
    faults: Queued<S>,
    model: Model,
    tenants: [String; 2],
    exact: bool,
    clock: Option<ManualClock>,
    elapsed: u64,
    ids: Vec<String>,
    /// The embedded store's ledger file.
    ledger_file: Option<PathBuf>,
    /// What the policy is made of: the pool's name and the store section.
    pool: String,
    store_yaml: String,
    /// What the API answered for each hold's settlement: the usage a commit charged, or `None`
    /// for a release. (The outside oracle knows only this and the ledger.)
    answered: BTreeMap<String, Option<u64>>,
    /// The day the case started on (store clock).
    first_day: u64,
    /// Per tenant, what its ledger entries charged (tokens, cost) when it last went idle: the
    /// counters that held it have run out since.
    ledger_before_idle: BTreeMap<String, (u64, u64)>,
    /// Per tenant, when (store clock) its counters last started afresh: the case's start, or its
    /// last idle.
    counted_since: BTreeMap<String, u64>,
    idles: usize,
    /// What each replica that hears reserves' answers (`h`, then `twice`) last heard of each
    /// tenant's soft budgets: until when (store clock) it is past one, and so demotes the
    /// tenant's requests a tier. (The lossy replica hears no admission.)
    soft_seen: [BTreeMap<String, u64>; 2],
}

impl<S: Store + Clone> World<S> {
    fn now(&self) -> u64 {
        match &self.clock {
            Some(c) => tollgate::store::clock::Clock::now_ms(c),
            None => tollgate::store::clock::Clock::now_ms(&tollgate::store::clock::SystemClock),
        }
    }

    fn ask(&self, op: &Op) -> Option<(Ask, Attributes, bool)> {
        let Op::Reserve { tenant, user, pooled, prompt, max_tokens, priority, deadline_ms, key, twice } = op else {
            return None;
        };
        let tenant = self.tenants[*tenant].clone();
        let user = user.map(|u| format!("u{u}"));
        let model = if *pooled { "m" } else { "n" }.to_string();
        let priority = [Priority::Sheddable, Priority::Standard, Priority::Critical][*priority];
        let key =
            key.map(|(k, same)| (format!("k{k}"), if same { KeyRepeat::ReturnHold } else { KeyRepeat::NewAttempt }));
        let attributes = Attributes {
            plan: None,
            tenant: Some(tenant.clone()),
            user: user.clone(),
            model: Some(model.clone()),
            priority: Some(priority),
            deadline_ms: *deadline_ms,
            wait_ms: None,
            idempotency: key.clone().map(|(key, repeat)| IdempotencyKey { key, repeat }),
            prompt: PromptSize::Tokens(*prompt),
            max_tokens: Some(*max_tokens),
            stream: false,
            input_only: false,
            outputs: 1,
        };
        let ask = Ask {
            tenant,
            user,
            model,
            prompt: *prompt,
            max_tokens: *max_tokens,
            priority,
            deadline_ms: *deadline_ms,
            key,
        };
        Some((ask, attributes, *twice))
    }

    fn pick(&self, hold: usize) -> Option<String> {
        (!self.ids.is_empty()).then(|| self.ids[hold % self.ids.len()].clone())
    }

    async fn step(&mut self, op: &Op, i: usize) {
        let now = self.now();
        let at = format!("step {i}: {op:?}");
        match op {
            Op::Faulted { op, lost } => match &**op {
                Op::Reserve { key: None | Some((_, false)), .. } => self.faulted_reserve(op, *lost, &at).await,
                Op::Commit { .. } | Op::Release { .. } | Op::Renew { .. } => {
                    self.faulted_settlement(op, *lost, &at).await;
                }
                // Nothing of these to lose: a reserve under a key that returns its live hold is
                // given back by its caller's retry, not by tollgate (see reserve.rs).
                other => return Box::pin(self.step(other, i)).await,
            },
            Op::Reserve { .. } => {
                let (mut ask, attributes, twice) = self.ask(op).expect("a reserve");
                // Past a soft budget, as this replica last heard: a tier lower.
                // (As `soft_tier`: only a tenant with soft budgets is demoted.)
                let soft = self.model.rules[&ask.tenant].tenant.soft.iter().any(|&n| n > 0);
                let seen = &mut self.soft_seen[usize::from(twice)];
                if soft && seen.get(&ask.tenant).is_some_and(|&until| until > now) {
                    ask.priority = ask.priority.demoted();
                }
                let expected = self.model.reserve(&ask, now, twice);
                if soft && matches!(expected, Decision::Admitted(_)) {
                    match self.model.last_soft_ends_ms {
                        Some(ms) => seen.insert(ask.tenant.clone(), now + ms),
                        None => seen.remove(&ask.tenant),
                    };
                }
                let got = if twice {
                    self.twice.admission.reserve(&attributes).await
                } else {
                    self.h.admission.reserve(&attributes).await
                };
                same_decision(&got, &expected, self.exact, &at);
                if let (Decision::Admitted(g), Decision::Admitted(e)) = (&got, &expected)
                    && e.reservation_id == NEW_ID
                {
                    assert!(!self.ids.contains(&g.reservation_id), "{at}: a new hold reuses an id");
                    self.model.adopt(&g.reservation_id);
                    self.ids.push(g.reservation_id.clone());
                }
            }
            Op::Commit { hold, prompt, output, twice } => {
                let Some(id) = self.pick(*hold) else { return };
                let mut expected = self.model.commit(&id, *prompt, *output, now);
                let got = if *twice {
                    // The first run charged; the re-sent one answers with its stored result.
                    if let tollgate::hold::CommitOutcome::Committed(u) = &mut expected {
                        (u.duplicate, u.model) = (true, None);
                    }
                    self.twice.admission.commit(&id, *prompt, *output).await
                } else {
                    self.h.admission.commit(&id, *prompt, *output).await
                };
                let got = got.unwrap();
                // The first answer stands (a duplicate repeats what the first run charged).
                if let tollgate::hold::CommitOutcome::Committed(u) = &got {
                    self.answered.entry(id.clone()).or_insert(Some(u.used));
                }
                assert_eq!(got, expected, "{at}");
            }
            Op::Release { hold, twice } => {
                let Some(id) = self.pick(*hold) else { return };
                let mut expected = self.model.release(&id, now);
                let got = if *twice {
                    if let tollgate::hold::ReleaseOutcome::Released { refunded, .. } = expected {
                        expected = tollgate::hold::ReleaseOutcome::Released { refunded, repeated: true };
                    }
                    self.twice.admission.release(&id).await
                } else {
                    self.h.admission.release(&id).await
                };
                let got = got.unwrap();
                if matches!(got, tollgate::hold::ReleaseOutcome::Released { .. }) {
                    self.answered.entry(id.clone()).or_insert(None);
                }
                assert_eq!(got, expected, "{at}");
            }
            Op::Renew { hold, twice } => {
                let Some(id) = self.pick(*hold) else { return };
                let expected = self.model.renew(&id, now);
                let got = if *twice {
                    self.twice.admission.renew(&id, 0).await
                } else {
                    self.h.admission.renew(&id, 0).await
                };
                let got = got.unwrap_or_else(|e| panic!("{at}: {e}"));
                assert_eq!(got, expected, "{at}");
            }
            Op::CommitTogether { commits } => {
                let picked: Vec<(String, u64, u64)> = commits
                    .iter()
                    .filter_map(|&(hold, prompt, output)| Some((self.pick(hold)?, prompt, output)))
                    .collect();
                let Some(tenant) = picked.first().map(|(id, ..)| id.split_once(':').expect("an id").0.to_string())
                else {
                    return;
                };
                let picked: Vec<_> =
                    picked.into_iter().filter(|(id, ..)| id.starts_with(&format!("{tenant}:"))).collect();
                let calls: Vec<CommitCall> = picked
                    .iter()
                    .map(|(id, prompt, output)| {
                        let counted = Counted::exact(*prompt, *output);
                        CommitCall { id: id.clone(), counted, ending: Ending::of(counted) }
                    })
                    .collect();
                let expected: Vec<_> =
                    picked.iter().map(|(id, prompt, output)| self.model.commit(id, *prompt, *output, now)).collect();
                let got =
                    self.h.admission.commit_together(&tenant, &calls).await.unwrap_or_else(|e| panic!("{at}: {e}"));
                for ((id, ..), outcome) in picked.iter().zip(&got) {
                    if let tollgate::hold::CommitOutcome::Committed(u) = outcome {
                        self.answered.entry(id.clone()).or_insert(Some(u.used));
                    }
                }
                assert_eq!(got, expected, "{at}");
            }
            Op::CommitUnknown => {
                let id = format!("{}:{}", self.tenants[0], "0".repeat(32));
                let expected = self.model.commit(&id, 1, 1, now);
                assert_eq!(self.h.admission.commit(&id, 1, 1).await.unwrap(), expected, "{at}");
            }
            Op::Reload { tight } => {
                let text = policy(
                    &self.tenants,
                    &self.pool,
                    &self.store_yaml,
                    self.exact,
                    self.ledger_file.as_deref(),
                    *tight,
                );
                let new = Policy::parse("model.yaml", &text).expect("reloaded model policy");
                // New holds and calls take the new terms; holds already made keep theirs.
                self.model.rules = model_of(&new, &self.tenants, &self.pool).rules;
                self.h.admission.reload(new.clone());
                self.lossy.admission.reload(new.clone());
                self.twice.admission.reload(new);
            }
            Op::Idle => {
                if let Some(clock) = self.clock.clone()
                    && self.idles < MOST_IDLES
                {
                    self.idles += 1;
                    self.sweep_abandoned(&clock).await;
                    for tenant in &self.tenants {
                        let mut last = BTreeMap::new();
                        for e in self.h.ledger_of(tenant).await {
                            let n = |f: &str| e[f].parse::<u64>().unwrap();
                            last.insert(e["id"].clone(), (n("charged_tokens"), n("cost_nanos")));
                        }
                        let sum = last.values().fold((0, 0), |a, c| (a.0 + c.0, a.1 + c.1));
                        self.ledger_before_idle.insert(tenant.clone(), sum);
                    }
                    let scopes: Vec<String> = self.model.scopes.keys().cloned().collect();
                    clock.advance_ms(IDLE_MS);
                    let now = self.now();
                    for tenant in &self.tenants {
                        self.counted_since.insert(tenant.clone(), now);
                    }
                    self.elapsed = 0;
                    self.model.forget_idle();
                    let mut gone = scopes;
                    for tenant in &self.tenants {
                        gone.extend([keys::leases(tenant), keys::holds(tenant)]);
                        let mine = self.ids.iter().filter(|id| id.starts_with(&format!("{tenant}:")));
                        gone.extend(mine.map(|id| keys::record(tenant, id)));
                    }
                    let pool = &self.model.pool_name;
                    gone.extend([keys::pool_state(pool), keys::pool_holds(pool), keys::pool_leases(pool)]);
                    for key in gone {
                        assert!(self.h.scope(&key).await.is_none(), "{at}: {key} outlived its TTL");
                    }
                }
            }
            Op::Advance { ms } => {
                if let Some(c) = &self.clock
                    && self.elapsed + ms <= CASE_TIME_LIMIT_MS
                {
                    c.advance_ms(*ms);
                    self.elapsed += ms;
                }
            }
        }
        self.same_counters(&at).await;
    }

    /// A reserve through the lossy replica whose store call fails (`lost`). Its caller hears
    /// `store_unavailable` (the tenants fail closed); what the call may have held is given back,
    /// at once or (`Lost::Outage`, the breaker open) through the retry queue, before the next step.
    async fn faulted_reserve(&mut self, op: &Op, lost: Lost, at: &str) {
        let now = self.now();
        let (ask, attributes, _) = self.ask(op).expect("a reserve");
        self.faults.next_for("reserve", if lost == Lost::Call { Fault::Unreachable(1) } else { Fault::LostReply });
        if lost == Lost::Outage {
            self.faults.next_for("release", Fault::Unreachable(1));
        }
        let got = self.lossy.admission.reserve(&attributes).await;
        self.quiet(at).await;
        let unmet = self.faults.clear();
        let unavailable = Decision::Denied(Denial {
            retry_after_ms: Some(1_000),
            ..Denial::now(Reason::StoreUnavailable, "admission store unavailable")
        });
        let expected = match lost {
            // It never ran: only what comes before it (the plan, a pool leg given back) did.
            Lost::Call => self.model.reserve_unreached(&ask, now).unwrap_or(unavailable),
            Lost::Reply | Lost::Outage => match self.model.reserve_reply_lost(&ask, now) {
                // It ran: the hold was made, then given back by its id.
                Decision::Admitted(e) => {
                    assert_eq!(e.reservation_id, NEW_ID, "{at}: only a new hold is given back");
                    // Both calls failed: the reserve's reply, and (an outage) its give-back's.
                    assert_eq!(unmet, 0, "{at}: a fault no call met");
                    let id = self.faults.last_first_arg("reserve").expect("the reserve's id");
                    self.model.adopt(&id);
                    self.ids.push(id.clone());
                    self.answered.insert(id.clone(), None);
                    self.model.release(&id, now);
                    unavailable
                }
                // A refusal before the call (the plan, the pool) is heard; one by the call is lost.
                Decision::Denied(d)
                    if matches!(d.reason, Reason::Unsatisfiable | Reason::QueueFull | Reason::Deadline) =>
                {
                    Decision::Denied(d)
                }
                Decision::Denied(_) | Decision::Unmetered(_) => unavailable,
            },
        };
        same_decision(&got, &expected, self.exact, at);
    }

    /// A commit, release or renewal through the lossy replica whose store call fails; its caller
    /// sends it again (the breaker's count of failures back to zero), and is answered as if the
    /// first had counted (when it ran) or never been (when it did not).
    async fn faulted_settlement(&mut self, op: &Op, lost: Lost, at: &str) {
        let now = self.now();
        let ran = lost != Lost::Call;
        let fault = if ran { Fault::LostReply } else { Fault::Unreachable(1) };
        let Some(id) = (match op {
            Op::Commit { hold, .. } | Op::Release { hold, .. } | Op::Renew { hold, .. } => self.pick(*hold),
            _ => None,
        }) else {
            return;
        };
        match op {
            Op::Commit { prompt, output, .. } => {
                self.faults.next_for("commit", fault);
                let failed = self.lossy.admission.commit(&id, *prompt, *output).await;
                assert!(failed.is_err(), "{at}: a lost commit answered {failed:?}");
                let mut expected = self.model.commit(&id, *prompt, *output, now);
                if let (true, tollgate::hold::CommitOutcome::Committed(u)) = (ran, &mut expected) {
                    (u.duplicate, u.model) = (true, None);
                }
                let got = self.lossy.admission.commit(&id, *prompt, *output).await.unwrap();
                if let tollgate::hold::CommitOutcome::Committed(u) = &got {
                    self.answered.entry(id.clone()).or_insert(Some(u.used));
                }
                assert_eq!(got, expected, "{at}: the commit sent again");
            }
            Op::Release { .. } => {
                self.faults.next_for("release", fault);
                let failed = self.lossy.admission.release(&id).await;
                assert!(failed.is_err(), "{at}: a lost release answered {failed:?}");
                let mut expected = self.model.release(&id, now);
                if let (true, tollgate::hold::ReleaseOutcome::Released { refunded, .. }) = (ran, expected) {
                    expected = tollgate::hold::ReleaseOutcome::Released { refunded, repeated: true };
                }
                let got = self.lossy.admission.release(&id).await.unwrap();
                if matches!(got, tollgate::hold::ReleaseOutcome::Released { .. }) {
                    self.answered.entry(id.clone()).or_insert(None);
                }
                assert_eq!(got, expected, "{at}: the release sent again");
            }
            _ => {
                self.faults.next_for("renew", fault);
                let failed = self.lossy.admission.renew(&id, 0).await;
                assert!(failed.is_err(), "{at}: a lost renewal answered {failed:?}");
                let expected = self.model.renew(&id, now);
                let got = self.lossy.admission.renew(&id, 0).await.unwrap_or_else(|e| panic!("{at}: {e}"));
                assert_eq!(got, expected, "{at}: the renewal sent again");
            }
        }
        self.faults.clear();
    }

    /// Waits (real time, bounded) until the lossy replica has tidied up after every reserve and
    /// its retry queue is empty; the manual clock does not move meanwhile.
    async fn quiet(&self, at: &str) {
        let a = &self.lossy.admission;
        let done = self
            .lossy
            .eventually(std::time::Duration::from_secs(10), || async {
                a.reserves_running() == 0 && a.retries_waiting() == 0
            })
            .await;
        assert!(done, "{at}: {} reserves running, {} settlements waiting", a.reserves_running(), a.retries_waiting());
    }

    /// The store's counters against the model's.
    async fn same_counters(&self, at: &str) {
        let scope_keys: Vec<String> = self.model.scopes.keys().cloned().collect();
        // One look per tenant: a Cluster runs a script only over keys of one slot.
        let mut views = BTreeMap::new();
        for tenant in &self.tenants {
            let tag = format!("tg:{{{tenant}}}:");
            let mine: Vec<String> = scope_keys.iter().filter(|k| k.starts_with(&tag)).cloned().collect();
            if !mine.is_empty() {
                views.extend(self.h.inspect(mine).await);
            }
        }
        let close =
            |a: f64, b: f64| if self.exact { (a - b).abs() <= 1e-9 * a.abs().max(1.0) } else { (a - b).abs() < 1.0 };
        for key in &scope_keys {
            let s = &self.model.scopes[key];
            let v = &views[key];
            let num = |f: &str| v.fields.get(f).map(|x| x.parse::<f64>().unwrap());
            let c = num("c").unwrap_or(0.0);
            assert_eq!(c, self.model.in_flight(key) as f64, "{at}: holds in flight in {key}: {v:?}");
            if let Some(t) = s.t {
                let got = num("t").unwrap();
                assert!(close(got, t), "{at}: tokens in {key}: store {got}, model {t}");
                if self.exact {
                    assert_eq!(num("tt"), Some(s.tt as f64), "{at}: refill time of {key}");
                }
            }
            if let Some(r) = s.r {
                let got = num("r").unwrap();
                assert!(close(got, r), "{at}: requests in {key}: store {got}, model {r}");
            }
            for (budget, counted) in &s.counts {
                let counter = budget.counter();
                assert_eq!(num(&counter), Some(*counted as f64), "{at}: {counter} of {key}: {v:?}");
            }
            for (period, marker) in &s.markers {
                let field = if *period == Period::Month { "mo" } else { &period.as_str()[..1] };
                assert_eq!(num(field), Some(*marker as f64), "{at}: the {period:?} marker of {key}: {v:?}");
            }
            // A counter is written only with its period's marker (what read_scope relies on).
            for field in v.fields.keys() {
                let b = field.as_bytes();
                if b.len() == 2 && b"hdwm".contains(&b[0]) && b"ucpg".contains(&b[1]) {
                    let marker = if b[0] == b'm' { "mo" } else { &field[..1] };
                    assert!(v.fields.contains_key(marker), "{at}: {field} of {key} without its marker: {v:?}");
                }
            }
            for (side, level) in [("pt", s.input), ("gt", s.output)] {
                if let Some(b) = level {
                    let got = num(side).unwrap();
                    assert!(close(got, b.level), "{at}: {side} in {key}: store {got}, model {}", b.level);
                }
            }
        }
        let pool = &self.model.pool_name;
        let pool_keys = vec![keys::pool_state(pool), keys::pool_holds(pool), keys::pool_leases(pool)];
        let views = self.h.inspect(pool_keys.clone()).await;
        let get = |f: &str| views[&pool_keys[0]].fields.get(f).map_or(0, |v| v.parse::<u64>().unwrap());
        assert_eq!((get("n"), get("w")), self.model.pool.load(), "{at}: pool holds and work");
        assert_eq!(views[&pool_keys[1]].fields.len() as u64, self.model.pool.load().0, "{at}: pool holds hash");
    }

    /// The ledger, once every hold is settled: every hold each tenant made, entered once (twice
    /// when a late commit followed its expiry), the last entries charging the day's usage exactly.
    async fn same_ledger(&self) {
        let mut entries = 0;
        for tenant in &self.tenants {
            let ledger = self.h.ledger_of(tenant).await;
            entries += ledger.len();
            let mut outcomes: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
            let mut charged = BTreeMap::new();
            for e in &ledger {
                outcomes.entry(e["id"].as_str()).or_default().push(e["outcome"].as_str());
                let cost = e["cost_nanos"].parse::<u64>().unwrap();
                charged.insert(e["id"].as_str(), (e["charged_tokens"].parse::<u64>().unwrap(), cost));
            }
            let made: BTreeSet<&str> =
                self.ids.iter().map(String::as_str).filter(|id| id.starts_with(&format!("{tenant}:"))).collect();
            assert_eq!(outcomes.keys().copied().collect::<BTreeSet<_>>(), made, "the ledger of {tenant}: {ledger:?}");
            for (id, o) in &outcomes {
                assert!(o.len() == 1 || *o == ["expired", "late_committed"], "{id} entered as {o:?}");
            }
            let counted = |k: &model::BudgetKey| {
                self.model.scopes.get(&keys::tenant_scope(tenant)).and_then(|s| s.counts.get(k).copied()).unwrap_or(0)
            };
            let (du, dc) = (counted(&model::ALWAYS[0]), counted(&model::ALWAYS[1]));
            // (The day's counters hold only the day's: once the tenant's day has turned since they
            // started, the ledger's entries charge more than they do.)
            let offset = self.model.rules[tenant].zone_offset_min;
            let day = |ms: u64| model::Periods::at(ms, offset).day;
            if day(self.counted_since[tenant]) != day(self.now()) {
                continue;
            }
            // What was charged before the last idle spell is no longer in any counter.
            let (before_tokens, before_cost) = self.ledger_before_idle.get(tenant).copied().unwrap_or_default();
            let since =
                |all: u64, before: u64| all.checked_sub(before).expect("the ledger lost entries since the idle");
            let tokens = since(charged.values().map(|c| c.0).sum(), before_tokens);
            let cost = since(charged.values().map(|c| c.1).sum(), before_cost);
            assert_eq!((tokens, cost), (du, dc), "what {tenant}'s ledger charges, tokens and cost: {ledger:?}");
        }
        if let Some(file) = &self.ledger_file {
            let lines = std::fs::read_to_string(file).unwrap_or_default();
            assert_eq!(lines.lines().count(), entries, "every entry is in the ledger file");
            let _ = std::fs::remove_file(file);
        }
    }

    /// Leaves every live hold abandoned, its tenant quiet, until the background sweeper settles
    /// it after its lease (on the manual clock).
    async fn sweep_abandoned(&mut self, clock: &ManualClock) {
        // Past every lease; no tenant calls again. The sweeper's first tick writes its
        // notes (each tenant due a lease and two sweep periods on: 3 s); once those are
        // due, its ticks settle everything, all at one moment.
        // (Both admissions are replicas, each with its own sweeper and notes.)
        clock.advance_ms(2_000);
        self.h.admission.sweep_tick().await.expect("a sweep");
        self.twice.admission.sweep_tick().await.expect("a sweep");
        self.lossy.admission.sweep_tick().await.expect("a sweep");
        clock.advance_ms(4_000);
        let now = self.now();
        for _ in 0..400 {
            self.h.admission.sweep_tick().await.expect("a sweep");
            self.twice.admission.sweep_tick().await.expect("a sweep");
            self.lossy.admission.sweep_tick().await.expect("a sweep");
            if self.lease_indexes_empty().await {
                break;
            }
        }
        if !self.lease_indexes_empty().await {
            let mut look: Vec<String> = self.tenants.iter().map(|t| keys::leases(t)).collect();
            look.extend((0..keys::SWEEP_SHARDS).map(keys::sweep_shard));
            let shards: Vec<_> = look.iter().map(|k| self.h.inspect(vec![k.clone()])).collect();
            let mut views = Vec::new();
            for f in shards {
                views.push(f.await);
            }
            panic!("the sweeper left holds unsettled at {now}: {views:?}");
        }
        self.model.sweep_all(now);
    }

    /// Releases every live hold, or leaves them all to the background sweeper after their leases
    /// (`abandon`, on the manual clock): then nothing may be in flight anywhere.
    async fn settle(&mut self, abandon: bool) {
        match (abandon, self.clock.clone()) {
            (true, Some(clock)) => self.sweep_abandoned(&clock).await,
            _ => {
                for id in self.model.live_ids() {
                    let now = self.now();
                    let expected = self.model.release(&id, now);
                    let got = self.h.admission.release(&id).await.unwrap();
                    if matches!(got, tollgate::hold::ReleaseOutcome::Released { repeated: false, .. }) {
                        self.answered.insert(id.clone(), None);
                    }
                    assert_eq!(got, expected, "settling {id}");
                }
            }
        }
        self.same_counters("after settling").await;
        self.same_ledger().await;
        self.outside_oracle().await;
        for key in self.model.scopes.keys() {
            assert_eq!(self.model.in_flight(key), 0);
        }
        // Every pool leg left is one whose reserve reply was lost after its sweep settled the hold:
        // its lease has run out, and the pool's own sweep reclaims it.
        assert_eq!(self.model.pool_holds_in_lease(self.now()), 0, "pool work held for nothing: {:?}", self.model.pool);
    }
}

impl<S: Store + Clone> World<S> {
    /// The books as an outsider sees them, knowing only what the API answered and what the ledger
    /// says (not the model): each hold's last entry charges what its commit was answered with,
    /// nothing for a release, and for a hold nobody settled what its tenant's expired usage says
    /// (the hold, or nothing under `refund`); and, within one day, those entries add up to the
    /// store's day usage of the tenant.
    async fn outside_oracle(&self) {
        let same_day = self.now() / model::DAY_MS == self.first_day;
        for (t, tenant) in self.tenants.iter().enumerate() {
            let mut last: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
            for e in self.h.ledger_of(tenant).await {
                last.insert(e["id"].clone(), e);
            }
            let mut charged = 0;
            for (id, e) in &last {
                let n = |f: &str| e[f].parse::<u64>().unwrap();
                let expected = match self.answered.get(id) {
                    Some(Some(used)) => *used,
                    Some(None) => 0,
                    // Tenant b refunds what expires; tenant a charges the hold.
                    None if t == 1 => 0,
                    None => n("reserved_tokens"),
                };
                assert_eq!(n("charged_tokens"), expected, "{id}: answered {:?}, entered {e:?}", self.answered.get(id));
                charged += n("charged_tokens");
            }
            if same_day && let Some(scope) = self.h.scope(&keys::tenant_scope(tenant)).await {
                let du = scope.fields.get("du").map_or(0, |v| v.parse::<u64>().unwrap());
                assert_eq!(charged, du, "what {tenant}'s ledger entries charge against its day usage in the store");
            }
        }
    }

    /// No hold left in either tenant's lease index.
    async fn lease_indexes_empty(&self) -> bool {
        for tenant in &self.tenants {
            let index = keys::leases(tenant);
            if self.h.inspect(vec![index.clone()]).await.get(&index).is_some_and(|v| v.kind != "none") {
                return false;
            }
        }
        true
    }
}

fn same_decision(got: &Decision, expected: &Decision, exact: bool, at: &str) {
    // On real time only what time cannot move: tokens left (refill stays under one token) and limits.
    let tokens = |h: &Headroom| h.tokens.map(|w| (w.remaining, w.limit));
    match (got, expected) {
        (Decision::Admitted(g), Decision::Admitted(e)) => {
            if e.reservation_id != NEW_ID {
                assert_eq!(g.reservation_id, e.reservation_id, "{at}: the replayed hold");
            }
            assert_eq!(
                (g.reserved_tokens, g.attempts, g.replayed, g.soft_limit, g.tier),
                (e.reserved_tokens, e.attempts, e.replayed, e.soft_limit, e.tier),
                "{at}: {g:?} vs {e:?}"
            );
            if exact {
                assert_eq!(g.headroom, e.headroom, "{at}: headroom {g:?} vs {e:?}");
            } else {
                assert_eq!(tokens(&g.headroom), tokens(&e.headroom), "{at}: tokens left {g:?} vs {e:?}");
            }
        }
        (Decision::Denied(g), Decision::Denied(e)) => {
            assert_eq!(g.reason, e.reason, "{at}: {g:?} vs {e:?}");
            if exact {
                assert_eq!(g.retry_after_ms, e.retry_after_ms, "{at}: retry after, {g:?} vs {e:?}");
                assert_eq!(g.headroom, e.headroom, "{at}: headroom {g:?} vs {e:?}");
            } else {
                assert_eq!(g.retry_after_ms.is_some(), e.retry_after_ms.is_some(), "{at}: {g:?} vs {e:?}");
                assert_eq!(tokens(&g.headroom), tokens(&e.headroom), "{at}: tokens left {g:?} vs {e:?}");
            }
        }
        _ => panic!("{at}: store {got:?}, model {expected:?}"),
    }
}

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap())
}

async fn world_on<S: Store + Clone>(
    stop: &CancellationToken,
    store: S,
    clock: Option<ManualClock>,
    backend: Backend,
    tenants: [String; 2],
    ledger_file: Option<PathBuf>,
) -> World<S> {
    let pool = support::unique_tenant("p");
    let exact = clock.is_some();
    let store_yaml = if backend == Backend::Embedded { String::new() } else { backend.store_yaml() };
    let text = policy(&tenants, &pool, &store_yaml, exact, ledger_file.as_deref(), false);
    let policy = Policy::parse("model.yaml", &text).expect("model policy");
    let model = model_of(&policy, &tenants, &pool);
    let h = Harness::from_parts(store, policy, tenants[0].clone(), pool.clone(), clock.clone()).await;
    let all = &["reserve", "commit", "renew", "release", "pool_reserve", "pool_release", "pool_renew"];
    let twice = h.wrapped(|s| Resend { inner: s, scripts: all }).await;
    let faults = Queued::new(h.admission.protocol().store().clone(), "reserve");
    let settings = BreakerSettings {
        failures: 2,
        open_for: std::time::Duration::from_millis(20),
        max_open: std::time::Duration::from_millis(50),
    };
    let lossy = h.wrapped(|_| Breaker::new(faults.clone(), settings)).await;
    lossy.admission.run_retries(stop.clone()).expect("the lossy replica's retry worker");
    let started = match &clock {
        Some(c) => tollgate::store::clock::Clock::now_ms(c),
        None => tollgate::store::clock::Clock::now_ms(&tollgate::store::clock::SystemClock),
    };
    let first_day = started / model::DAY_MS;
    let counted_since = tenants.iter().map(|t| (t.clone(), started)).collect();
    World {
        h,
        twice,
        lossy,
        faults,
        model,
        tenants,
        exact,
        clock,
        elapsed: 0,
        ids: Vec::new(),
        ledger_file,
        pool,
        store_yaml,
        answered: BTreeMap::new(),
        first_day,
        ledger_before_idle: BTreeMap::new(),
        counted_since,
        idles: 0,
        soft_seen: [BTreeMap::new(), BTreeMap::new()],
    }
}

async fn run_on<S: Store + Clone>(mut w: World<S>, ops: &[Op], abandon: bool) {
    for (i, op) in ops.iter().enumerate() {
        w.step(op, i).await;
    }
    w.settle(abandon).await;
}

/// Stops the lossy replica's retry worker when a case ends, however it ends.
struct StopOnDrop(CancellationToken);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.cancel();
    }
}

/// Where a case's clock starts (the manual clock's start is Sunday 2026-11-29, 12:00 UTC): mid-day;
/// and 20 s before each tenant's turns in its zone: tenant a's (twelve hours ahead) day and week
/// at noon UTC on Sunday, its month (into 1 December) a day later; tenant b's (five hours behind)
/// day and week at 05:00 UTC on Monday, its month at 05:00 UTC on 1 December.
const STARTS: [u64; 5] = [
    support::CLOCK_START_MS,
    support::CLOCK_START_MS - 20_000,
    support::CLOCK_START_MS + 24 * 3_600_000 - 20_000,
    support::CLOCK_START_MS + 17 * 3_600_000 - 20_000,
    support::CLOCK_START_MS + 41 * 3_600_000 - 20_000,
];

async fn run(backend: Backend, ops: Vec<Op>) {
    run_from(backend, ops, STARTS[0], false).await;
}

async fn run_from(backend: Backend, ops: Vec<Op>, start: u64, abandon: bool) {
    let tenants = [support::unique_tenant("a"), support::unique_tenant("b")];
    match backend {
        Backend::Embedded => {
            let clock = ManualClock::new(start);
            let file = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("model-ledger-{}.jsonl", tenants[0]));
            let store = EmbeddedStore::with_ledger_file(Arc::new(clock.clone()), &file).expect("embedded store");
            let stop = StopOnDrop(CancellationToken::new());
            run_on(world_on(&stop.0, store, Some(clock), backend, tenants, Some(file)).await, &ops, abandon).await;
        }
        Backend::Redis | Backend::Cluster => {
            let target = match backend {
                Backend::Cluster => RedisTarget::Cluster(support::redis_cluster_nodes()),
                _ => RedisTarget::Single(support::redis_url()),
            };
            let store = RedisStore::connect(&target, RedisOptions::default()).await.expect("redis");
            // Real time does not jump: leases are long and refill is slow under this policy.
            let ops: Vec<Op> = ops.into_iter().filter(|op| !matches!(op, Op::Advance { .. } | Op::Idle)).collect();
            let stop = StopOnDrop(CancellationToken::new());
            run_on(world_on(&stop.0, store.clone(), None, backend, tenants, None).await, &ops, false).await;
            store.close().await;
        }
    }
}

fn config(cases: u32) -> ProptestConfig {
    ProptestConfig { cases, max_shrink_iters: 2048, ..ProptestConfig::default() }
}

proptest! {
    #![proptest_config(config(1000))]
    #[test]
    fn the_embedded_store_keeps_the_models_books(
        ops in prop::collection::vec(op(), 1..40),
        start in prop::sample::select(STARTS.to_vec()),
        abandon in any::<bool>(),
    ) {
        runtime().block_on(run_from(Backend::Embedded, ops, start, abandon));
    }
}

proptest! {
    #![proptest_config(config(40))]
    #[test]
    fn redis_keeps_the_models_books(ops in prop::collection::vec(op(), 1..30)) {
        runtime().block_on(run(Backend::Redis, ops));
    }

    #[test]
    fn the_cluster_keeps_the_models_books(ops in prop::collection::vec(op(), 1..30)) {
        runtime().block_on(run(Backend::Cluster, ops));
    }
}

// The minimal sequences of the bugs this test found on its own, kept as plain tests.

fn reserve(pooled: bool, twice: bool) -> Op {
    Op::Reserve {
        tenant: 0,
        user: None,
        pooled,
        prompt: 0,
        max_tokens: 1,
        priority: 0,
        deadline_ms: None,
        key: None,
        twice,
    }
}

/// A pooled hold that expires and is settled by another reserve's sweep used to keep its pool
/// work until the pool's own sweep reached it, so the pool counted work nobody held.
#[test]
fn a_hold_settled_by_the_sweep_leaves_its_pool_at_once() {
    let ops = vec![
        reserve(true, false),
        reserve(false, false),
        reserve(true, false),
        reserve(true, false),
        Op::Advance { ms: 1000 },
        reserve(false, false),
    ];
    runtime().block_on(run(Backend::Embedded, ops));
}

/// A reserve re-sent after a lost reply used to sweep a second batch of expired holds: a re-sent
/// call must change nothing its first run did not.
#[test]
fn a_resent_reserve_does_not_sweep_again() {
    let mut ops: Vec<Op> = (0..6).map(|_| reserve(false, false)).collect();
    ops.push(Op::Advance { ms: 1000 });
    ops.push(reserve(false, true));
    runtime().block_on(run(Backend::Embedded, ops));
}

/// Tenant b past its soft budget (1,500 tokens a day): the hold that crosses it is marked at its
/// own tier, and the replica that heard so demotes b's next pooled request a tier, while the
/// replica that re-sends (a replica of its own) has heard nothing yet; the model says each.
#[test]
fn a_soft_budget_marks_and_each_replica_demotes_by_what_it_heard() {
    let b = |prompt, max_tokens, twice| Op::Reserve {
        tenant: 1,
        user: None,
        pooled: true,
        prompt,
        max_tokens,
        priority: 2,
        deadline_ms: None,
        key: None,
        twice,
    };
    let commit = |hold| Op::Commit { hold, prompt: 300, output: 400, twice: false };
    let ops = vec![
        b(300, 400, false),
        commit(0),
        Op::Advance { ms: 10_000 },
        b(300, 400, false),
        commit(1),
        Op::Advance { ms: 10_000 },
        // 2,100 of the day's soft 1,500: marked.
        b(300, 400, false),
        commit(2),
        // Demoted here; not by the re-sending replica, until it hears.
        b(0, 50, false),
        b(0, 50, true),
        b(0, 50, true),
    ];
    runtime().block_on(run(Backend::Embedded, ops));
}
