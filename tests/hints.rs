//! Retry hints are the earliest time, not merely a safe one.
//!
//! A pool's (`pool_reserve.lua`): over random pool states (holds of every tier and three tenants,
//! admitted at random times, some of them reporting progress, some released, some left past their
//! predicted end) and a random request refused with a hint: the same request sent again at now +
//! hint, nothing else arriving and every hold ending when it was predicted to (its admission, its
//! predicted start and its work; or its last progress and the work it had left; a tenth more, at
//! least 50 ms, for speeds a little off and the commit's way to the store), is admitted; one
//! millisecond earlier it is refused. A hold already past its predicted end is not counted on:
//! where the request waits on one, the reply says no time can be predicted, and indeed no hold
//! ending as predicted lets it in. Queueing at the backend and in tollgate (where admitted means it
//! would wait no longer than it may; there a request may wait on a hold past its end, taken to end
//! at once, so with one in the pool a retry may be let in sooner than its hint, never later).
//!
//! A tenant's (`reserve.lua`, through `Admission::reserve`): over random holds, commits and time
//! against a token bucket, a request bucket, concurrency slots and a day's budget, a refusal's
//! hint is when the buckets have refilled, the day has turned and the holds holding the slots
//! have reached their leases' ends: admitted then, refused a millisecond earlier.
//!
//! On the embedded store with a manual clock.

mod support;

use std::collections::BTreeMap;

use proptest::prelude::*;
use support::Harness;
use tollgate::config::{PoolQueue, Priority};
use tollgate::store::embedded::EmbeddedStore;
use tollgate::store::{PoolCall, PoolEnd, PoolOutcome, PoolRetry};

const SLOTS: u64 = 3;
/// Each tier's slots.
const TIERS: [(Priority, u64); 3] = [(Priority::Critical, 3), (Priority::Standard, 2), (Priority::Sheddable, 1)];
const MAX_DELAY_MS: u64 = 1_500;
const TIER_KV: [u64; 3] = [1_000, 800, 500];
/// Longer than any case: holds never expire here.
const LEASE_MS: u64 = 3_600_000;

/// When a hold predicted to take `span` ms from `now` is predicted to end: then, with a tenth more
/// (the error its pool's speeds may have) and at least 50 ms (for its commit to arrive).
fn ends(now: u64, span: u64) -> u64 {
    now + span + span.div_ceil(10).max(50)
}

/// One request as it asks: tier, tenant, work, KV tokens, deadline (0: none), how long it may
/// wait (queueing in tollgate).
#[derive(Debug, Clone, Copy)]
struct Ask {
    tier: usize,
    tenant: usize,
    work: u64,
    kv: u64,
    deadline: u64,
    wait: u64,
}

#[derive(Debug, Clone)]
enum Op {
    /// A request asks; in tollgate's queue it may not wait (so no place outlives the step).
    Ask(Ask),
    /// The `i`-th hold still held reports it has this much work left.
    Progress {
        i: usize,
        left: u64,
    },
    /// The `i`-th hold still held ends.
    Release {
        i: usize,
    },
    Advance {
        ms: u64,
    },
}

fn ask() -> impl Strategy<Value = Ask> {
    (0..3usize, 0..3usize, 100..2_500u64, 1..400u64, prop_oneof![3 => Just(0u64), 1 => 800..5_000u64], 0..3_000u64)
        .prop_map(|(tier, tenant, work, kv, deadline, wait)| Ask { tier, tenant, work, kv, deadline, wait })
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => ask().prop_map(|a| Op::Ask(Ask { wait: 0, ..a })),
        1 => (0..8usize, 0..2_000u64).prop_map(|(i, left)| Op::Progress { i, left }),
        1 => (0..8usize).prop_map(|i| Op::Release { i }),
        2 => prop_oneof![1..300u64, 500..2_000u64].prop_map(|ms| Op::Advance { ms }),
    ]
}

struct Run {
    h: Harness<EmbeddedStore>,
    queue: PoolQueue,
    now: u64,
    /// Each hold still held: its predicted end.
    ends: BTreeMap<String, u64>,
    asked: u64,
}

impl Run {
    async fn ask(&mut self, id: &str, a: Ask) -> PoolOutcome {
        let (tier, tier_slots) = TIERS[a.tier];
        let tenant = format!("t{}", a.tenant);
        let call = PoolCall {
            pool: &self.h.pool,
            id,
            work_ms: a.work,
            finish_ms: a.work,
            kv_tokens: a.kv,
            lease_ms: LEASE_MS,
            idle_ttl_ms: 2 * LEASE_MS,
            sweep_batch: 100,
            slots: SLOTS,
            tier_slots,
            max_queue_delay_ms: MAX_DELAY_MS,
            tier_kv_tokens: Some(TIER_KV[a.tier]),
            deadline_ms: (a.deadline > 0).then_some(a.deadline),
            recover_per_ms: 0.0,
            tier,
            tenant: &tenant,
            weight_milli: [1_000, 2_000, 500][a.tenant],
            queue: self.queue,
            wait_ms: a.wait,
            waiter_ttl_ms: 1_000,
            provider: None,
        };
        self.h.admission.protocol().pool_reserve(&call).await.expect("pool_reserve")
    }

    async fn advance(&mut self, ms: u64) {
        self.h.advance(ms).await;
        self.now += ms;
    }

    async fn release(&mut self, id: &str) {
        let end = PoolEnd::Used { prompt: None, output: None, cost_nanos: None };
        assert!(self.h.admission.protocol().pool_release(&self.h.pool, id, end).await.unwrap());
        self.ends.remove(id);
    }

    async fn step(&mut self, op: &Op) {
        let nth = |ends: &BTreeMap<String, u64>, i: usize| ends.keys().nth(i % ends.len().max(1)).cloned();
        match op {
            Op::Ask(a) => {
                self.asked += 1;
                let id = format!("r{}", self.asked);
                if let PoolOutcome::Admitted { start_delay_ms, .. } = self.ask(&id, *a).await {
                    self.ends.insert(id, ends(self.now, start_delay_ms + a.work));
                }
            }
            Op::Progress { i, left } => {
                if let Some(id) = nth(&self.ends, *i) {
                    self.h.admission.protocol().pool_progress(&self.h.pool, &id, *left).await.unwrap();
                    self.ends.insert(id, ends(self.now, *left));
                }
            }
            Op::Release { i } => {
                if let Some(id) = nth(&self.ends, *i) {
                    self.release(&id).await;
                }
            }
            Op::Advance { ms } => self.advance(*ms).await,
        }
        // Every step in a millisecond of its own.
        self.advance(1).await;
    }

    /// Time passes to `at` with nothing arriving; every hold not yet past its predicted end at
    /// `from` ends at it (those past it already stay: nobody can say when they end).
    async fn ends_as_predicted(&mut self, from: u64, at: u64) {
        self.advance(at - self.now).await;
        let due: Vec<String> =
            self.ends.iter().filter(|(_, end)| **end > from && **end <= at).map(|(id, _)| id.clone()).collect();
        for id in due {
            self.release(&id).await;
        }
    }

    fn admits(&self, outcome: &PoolOutcome) -> bool {
        match outcome {
            PoolOutcome::Admitted { .. } => true,
            PoolOutcome::Waiting { .. } => self.queue == PoolQueue::Tollgate,
            PoolOutcome::Denied { .. } => false,
        }
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

async fn hints_are_the_earliest(queue: PoolQueue, ops: Vec<Op>, probe: Ask) -> Option<PoolRetry> {
    let h = support::embedded("limits: {}\n---pool---\nmax_sequences: 3\nprefill_tokens_per_second: 1000\ndecode_tokens_per_second: 100\nmax_queue_delay_ms: 1500\n").await;
    let now = tollgate::store::clock::Clock::now_ms(h.clock.as_ref().unwrap());
    let mut run = Run { h, queue, now, ends: BTreeMap::new(), asked: 0 };
    for op in &ops {
        run.step(op).await;
    }
    let from = run.now;
    let PoolOutcome::Denied { retry, .. } = run.ask("probe", probe).await else { return None };
    match retry {
        PoolRetry::In(ms) => {
            // Queueing in tollgate, a request may wait on a hold past its end (taken to end at once:
            // each ask looks again), so with one in the pool a retry may wait sooner; never later.
            let late = run.ends.values().any(|end| *end <= from);
            run.ends_as_predicted(from, from + ms - 1).await;
            let early = run.ask("probe", probe).await;
            if queue == PoolQueue::Backend || !late {
                assert!(!run.admits(&early), "admitted 1 ms before its hint of {ms}: {early:?}");
            }
            run.ends_as_predicted(from, from + ms).await;
            let on_time = run.ask("probe", probe).await;
            assert!(run.admits(&on_time), "refused at its hint of {ms} ms: {on_time:?}");
        }
        PoolRetry::Unpredictable { .. } => {
            // Every hold with an end ahead ends: still no room without those past theirs.
            let last = run.ends.values().copied().filter(|end| *end > from).max().unwrap_or(from);
            run.ends_as_predicted(from, last.max(from + 1)).await;
            // (Queueing in tollgate, short only of KV tokens the late holds keep, it may wait: it is
            // not let in.)
            let still = run.ask("probe", probe).await;
            assert!(
                !matches!(still, PoolOutcome::Admitted { .. }),
                "no time was predicted, yet the holds' ends let it in: {still:?}"
            );
        }
        PoolRetry::Never => {
            let never_fits = (probe.deadline > 0 && probe.work > probe.deadline) || probe.kv > TIER_KV[probe.tier];
            assert!(never_fits, "refused for good: {probe:?}");
        }
    }
    Some(retry)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn a_backend_queues_hint_is_the_earliest_admission(ops in prop::collection::vec(op(), 1..30), probe in ask()) {
        runtime().block_on(hints_are_the_earliest(PoolQueue::Backend, ops, probe));
    }

    #[test]
    fn a_tollgate_queues_hint_is_the_earliest_wait_it_may_take(ops in prop::collection::vec(op(), 1..30), probe in ask()) {
        runtime().block_on(hints_are_the_earliest(PoolQueue::Tollgate, ops, probe));
    }
}

/// The case: a full pool's hint is when its holds end, where the old hint (the pool
/// "draining" by time, which admission never counts) was refused again.
#[test]
fn a_full_pools_retry_is_admitted() {
    runtime().block_on(async {
        // Four holds of 1,500 ms on three slots (the fourth starts in 1,500 ms, the most the
        // tier may queue); a fifth would start in 2,000 ms. The old hint, the pool drained by
        // time to 1,500 ms of queue, said 500 ms, and admission then refused it again. As the
        // first three end, when predicted (1,650 ms: a tenth more), one hold is left: it is
        // admitted then.
        let critical = |work| Ask { tier: 0, tenant: 0, work, kv: 1, deadline: 0, wait: 0 };
        let ops: Vec<Op> = (0..4).map(|_| Op::Ask(critical(1_500))).collect();
        let retry = hints_are_the_earliest(PoolQueue::Backend, ops, critical(1_500)).await;
        assert_eq!(
            retry,
            Some(PoolRetry::In(1_650 - 4)),
            "the first three end 1,650 ms after they came, four steps ago"
        );
    });
}

/// What happens to a tenant before its probe.
#[derive(Debug, Clone)]
enum TenantOp {
    Reserve {
        prompt: u64,
        max_tokens: u64,
    },
    /// The `i`-th hold still live commits this much of its output.
    Commit {
        i: usize,
        output: u64,
    },
    Advance {
        ms: u64,
    },
}

fn tenant_op() -> impl Strategy<Value = TenantOp> {
    prop_oneof![
        5 => (1..400u64, 1..900u64).prop_map(|(prompt, max_tokens)| TenantOp::Reserve { prompt, max_tokens }),
        2 => (0..4usize, 0..900u64).prop_map(|(i, output)| TenantOp::Commit { i, output }),
        2 => prop_oneof![1..200u64, 300..1_500u64].prop_map(|ms| TenantOp::Advance { ms }),
    ]
}

/// A tenant's limits: 3,000 tokens a bucket refilled at 100 a second, six requests a minute, three
/// requests at once (each held for its 800 ms lease unless it commits: below the 1 s back-off, so
/// the hint is the lease's end), and 12,000 tokens a day.
const TENANT: &str = "lease_ttl_ms: 800\nlimits: { tokens_per_minute: 6000, burst_tokens: 3000, requests_per_minute: 6, max_concurrency: 3, tokens_per_day: 12000 }\n";

async fn tenant_hints_are_the_earliest(ops: Vec<TenantOp>, probe: (u64, u64)) {
    use tollgate::admission::Decision;
    let h = support::embedded(TENANT).await;
    let mut live: Vec<(String, u64)> = Vec::new();
    for op in &ops {
        match *op {
            TenantOp::Reserve { prompt, max_tokens } => {
                if let Decision::Admitted(a) = h.reserve(prompt, max_tokens).await {
                    live.push((a.reservation_id, prompt));
                }
            }
            TenantOp::Commit { i, output } => {
                if !live.is_empty() {
                    let (id, prompt) = live.remove(i % live.len());
                    h.admission.commit(&id, prompt, output).await.unwrap();
                }
            }
            TenantOp::Advance { ms } => h.advance(ms).await,
        }
        h.advance(1).await;
    }
    let Decision::Denied(no) = h.reserve(probe.0, probe.1).await else { return };
    let Some(ms) = no.retry_after_ms.filter(|_| no.reason.retryable()) else { return };
    // Nothing arrives and nothing commits: the buckets refill, the day turns, the holds' leases end.
    h.advance(ms - 1).await;
    let early = h.reserve(probe.0, probe.1).await;
    assert!(matches!(early, Decision::Denied(_)), "admitted 1 ms before its {ms} ms hint ({no:?}): {early:?}");
    h.advance(1).await;
    let on_time = h.reserve(probe.0, probe.1).await;
    assert!(matches!(on_time, Decision::Admitted(_)), "refused at its {ms} ms hint ({no:?}): {on_time:?}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn a_tenants_hint_is_the_earliest_admission(
        ops in prop::collection::vec(tenant_op(), 1..24),
        probe in (1..400u64, 1..900u64),
    ) {
        runtime().block_on(tenant_hints_are_the_earliest(ops, probe));
    }
}

/// Queueing in tollgate, a request with a slot free but short of its tier's KV tokens is told when
/// the holds that keep them end (not at once: it would be refused again the same way).
#[test]
fn a_request_short_of_kv_is_told_when_the_kv_frees() {
    runtime().block_on(async {
        let critical = |kv, wait| Ask { tier: 0, tenant: 0, work: 1_000, kv, deadline: 0, wait };
        // Two holds of 400 of the tier's 1,000 KV tokens; a third slot free.
        let ops = vec![Op::Ask(critical(400, 0)), Op::Ask(critical(400, 0))];
        let retry = hints_are_the_earliest(PoolQueue::Tollgate, ops, critical(400, 100)).await;
        // The first ends 1,100 ms after it came (two steps ago): sent 100 ms before, it waits.
        assert_eq!(retry, Some(PoolRetry::In(1_100 - 2 - 100)), "{retry:?}");
    });
}
